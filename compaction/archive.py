"""What a compaction summarises stays recallable: each summarised chunk's text, verbatim and content-addressed.

With the option `archive`, the merge writes each chunk's handle after its summary (`[archived: arc-…]`) and
the result carries the chunks' texts (`CompactionResult.archived`, never sent to the client): the service
stores them per tenant (`serving.archive`) and its MCP endpoint returns a text by its handle
(`recall`) or finds handles by words (`search_history`). A chunk's text is its tokens decoded, chat markup
included, so the chunks of one compaction, joined in order, are exactly the span it summarised.

A handle names the text alone (a hash of it): the same chunk compacted again gets the same handle, and a
handle says nothing of whose it is (the store keeps each tenant's apart).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from compaction.tokenizer import ChatTokenizer

HANDLE = re.compile(r"^arc-[0-9a-f]{24}$")
MARKER = re.compile(r" ?\[archived: arc-[0-9a-f]{24}\]")


class ArchivedChunk(BaseModel):
    """One summarised chunk, verbatim."""

    model_config = ConfigDict(frozen=True)
    handle: str = Field(description="arc- and 24 hex digits of the text's SHA-256.")
    chunk: int = Field(description="The chunk's index in its compaction; -1 for a cleared tool output or input.")
    tokens: int = Field(description="The chunk's tokens.")
    text: str = Field(description="The chunk's tokens decoded, chat markup included.")


def handle_of(text: str) -> str:
    return "arc-" + hashlib.sha256(text.encode()).hexdigest()[:24]


def marker(handle: str) -> str:
    """What the summary carries after a chunk's summary: the handle the agent recalls it by."""
    return f" [archived: {handle}]"


def archived_chunks(
    token_ids: Sequence[int], borders: Sequence[tuple[int, int]], tokenizer: ChatTokenizer
) -> list[ArchivedChunk]:
    """Each chunk's text (history tokens [start, end)), in chunk order."""
    out = []
    for index, (start, end) in enumerate(borders):
        text = tokenizer.decode(token_ids[start:end])
        out.append(ArchivedChunk(handle=handle_of(text), chunk=index, tokens=end - start, text=text))
    return out


def without_markers(text: str) -> str:
    """`text` without the handles the merge wrote (for a compaction whose chunks could not be stored)."""
    return MARKER.sub("", text)
