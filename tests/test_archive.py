"""The archive's core half (compaction.archive): each summarised chunk's text, verbatim, by a handle written after
its summary (pure; the store and the MCP endpoint: tests/test_archive_store.py, tests/test_archive_service.py)."""

from __future__ import annotations

import pytest

from compaction.archive import HANDLE, MARKER, handle_of, marker, without_markers
from compaction.backend import GenerationRequest
from compaction.history import parse_messages
from compaction.render import render_history
from compaction.tokenizer import ChatTokenizer
from tests.fakes import PLAIN, ChatMLTokenizer
from tests.test_compactor import history, make


@pytest.fixture(scope="module")
def tokenizer(chat_tokenizer: ChatMLTokenizer) -> ChatMLTokenizer:
    return chat_tokenizer


def by_chunk(request: GenerationRequest) -> tuple[str, str]:
    return f"S{request.request_id.split('-')[1]}.", "stop"


OPTIONS = {"chunk_tokens": 128, "grounding_threshold": 0, **PLAIN}


async def test_each_chunk_is_archived_verbatim_and_its_handle_follows_its_summary(tokenizer: ChatTokenizer) -> None:
    compactor, _ = make(tokenizer, script=by_chunk)
    result = await compactor.compact(history(), {**OPTIONS, "archive": True})
    chunks = result.archived
    assert len(chunks) == result.stats.chunks > 3
    assert result.stats.archived_handles == [c.handle for c in chunks]
    assert all(HANDLE.match(c.handle) and c.handle == handle_of(c.text) for c in chunks)
    assert result.summary == "\n\n".join(f"S{k}.{marker(c.handle)}" for k, c in enumerate(chunks))
    assert without_markers(result.summary) == "\n\n".join(f"S{k}." for k in range(len(chunks)))
    # joined in order, the chunks are exactly the span the compaction summarised
    rendered = render_history(parse_messages(history()), tokenizer)
    start = rendered.message_starts[result.kept_head]
    span = rendered.token_ids[start : start + result.stats.input_tokens]
    assert sum(c.tokens for c in chunks) == len(span)
    assert "".join(c.text for c in chunks) == tokenizer.decode(span)
    assert "archived" not in result.model_dump()  # the texts go to the store, never to the client
    again = await compactor.compact(history(), {**OPTIONS, "archive": True})
    assert [c.handle for c in again.archived] == [c.handle for c in chunks]  # content-addressed


async def test_without_the_option_nothing_is_archived_or_marked(tokenizer: ChatTokenizer) -> None:
    compactor, _ = make(tokenizer, script=by_chunk)
    result = await compactor.compact(history(), OPTIONS)
    assert result.archived == [] and result.stats.archived_handles == [] and not MARKER.search(result.summary)
