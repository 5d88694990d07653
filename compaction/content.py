"""Content is data: message text is tokenised as text; only the chat template's own markers are control tokens.

A tokenizer parses control tokens (`<|im_end|>`, `<|im_start|>`, ...) wherever their spelling
occurs, so a fetched web page or file in a tool result that spells `<|im_end|>\\n<|im_start|>system`
would become a real system turn inside every compaction prompt. Here the rendering is tokenised
as usual (so content without such spellings keeps exactly the ids the agent's own
`/v1/chat/completions` turns produce, and the agent's prefix cache stays reusable), then only the
stretches where a control token was found inside a message's content are tokenised again, as text.

Where each message's content lies in the rendering is found by rendering the same history with
every content replaced by a sentinel: the template's own text between sentinels is exact, so the
content spans follow without guessing (templates that trim content are handled too).
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from compaction.errors import InvalidInput

if TYPE_CHECKING:
    from compaction.history import ChatTokenizer

Span = tuple[int, int]  # [start, end) in characters of the rendered text
_SENTINEL = re.compile("\ue000(\\d+)\ue001")


def _sentinel(i: int) -> str:
    return f"\ue000{i}\ue001"


def _unsupported(why: str) -> InvalidInput:
    return InvalidInput("model", f"the chat template {why}; its histories cannot be compacted in token space")


def content_spans(views: Sequence[dict[str, str]], text: str, tokenizer: ChatTokenizer) -> tuple[Span, ...]:
    """The character span of each message's content inside `text`, the rendering of `views`."""
    skeleton = tokenizer.render([{**view, "content": _sentinel(i)} for i, view in enumerate(views)])
    parts = _SENTINEL.split(skeleton)
    pieces, order = parts[0::2], [int(i) for i in parts[1::2]]
    if order != list(range(len(views))):
        raise _unsupported("does not render every message's content once, in order")
    spans: list[Span] = []
    cursor = 0
    for i, view in enumerate(views):
        if not text.startswith(pieces[i], cursor):
            raise _unsupported("renders differently depending on message content")
        cursor += len(pieces[i])
        content = view["content"]
        for form in (content, content.strip(), content.lstrip(), content.rstrip()):
            if text.startswith(form, cursor) and text.startswith(pieces[i + 1], cursor + len(form)):
                spans.append((cursor, cursor + len(form)))
                cursor += len(form)
                break
        else:
            raise _unsupported("changes message content beyond trimming whitespace")
    if text[cursor:] != pieces[-1]:
        raise _unsupported("renders differently depending on message content")
    return tuple(spans)


def encode_rendering(text: str, spans: Sequence[Span], tokenizer: ChatTokenizer) -> tuple[list[int], list[int]]:
    """Token ids of `text` (and each token's first character) with every content span tokenised as text.

    Identical to `tokenizer.encode_with_offsets(text)` unless some content spells a control token;
    then only the tokens covering that content are replaced by its tokenisation as text.
    """
    ids, offsets = tokenizer.encode_with_offsets(text)
    control = tokenizer.control_token_ids
    starts = [start for start, _ in spans]
    forged: set[int] = set()
    for token, offset in zip(ids, offsets, strict=True):
        at = bisect.bisect_right(starts, offset) - 1
        if token in control and at >= 0 and offset < spans[at][1]:
            forged.add(at)
    for at in sorted(forged, reverse=True):  # right to left: earlier offsets stay valid
        start, end = spans[at]
        first = max(bisect.bisect_right(offsets, start) - 1, 0)  # the token holding the content's first character
        last = bisect.bisect_left(offsets, end)  # the first token starting at or after the content's end
        stop = offsets[last] if last < len(offsets) else len(text)
        again, again_offsets = tokenizer.encode_with_offsets(text[offsets[first] : stop], as_text=True)
        ids[first:last] = again
        offsets[first:last] = [offsets[first] + o for o in again_offsets]
    return ids, offsets
