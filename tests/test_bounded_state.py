"""State kept between requests is bounded in bytes, not only in counts."""

from __future__ import annotations

import pytest

from compaction.chunk_cache import ENTRY_OVERHEAD_BYTES, ChunkCache
from compaction.history import parse_messages
from compaction.partition import Chunk
from compaction.result import ChunkStats
from compaction.tokenizer import ChatTokenizer
from serving.turns import RECORD_BYTES, PromptCounter
from tests.fakes import ChatMLTokenizer


@pytest.fixture(scope="module")
def tokenizer(chat_tokenizer: ChatMLTokenizer) -> ChatMLTokenizer:
    return chat_tokenizer


def test_the_chunk_cache_drops_its_oldest_summaries_past_its_bytes() -> None:
    cache = ChunkCache(max_entries=1000, max_bytes=3 * (ENTRY_OVERHEAD_BYTES + 1000))
    ids = tuple(range(400))
    stats = ChunkStats.model_construct(index=0, first_ungrounded=[], ungrounded=[])  # type: ignore[call-arg]
    for k in range(5):
        chunk = Chunk(k, 80 * k, 80 * (k + 1))
        cache.put("scope", ids, chunk, ids[: chunk.end], "s" * 1000, stats)
    assert len(cache) == 3 and cache.bytes <= cache.max_bytes
    assert cache.get("scope", ids, Chunk(0, 0, 80), ids[:80]) is None  # the oldest went first
    assert cache.get("scope", ids, Chunk(4, 320, 400), ids[:400]) is not None


def test_prompt_counts_are_bounded_in_bytes(tokenizer: ChatTokenizer) -> None:
    counter = PromptCounter(
        tokenizer, tokenizer.special_tokens, max_sessions=10_000, max_bytes=3 * 10 * (RECORD_BYTES + 300)
    )
    messages = parse_messages([{"role": "user", "content": "hello there"}])
    for i in range(50):
        session = f"{i:03d}" + "x" * 297  # long session ids cost their length
        counter.count(messages, session)
        counter.answered(session, 10, 10)
    assert len(counter._known) == 10 and len(counter._answered) == 10
    assert counter.count(messages, "049" + "x" * 297) == counter.count(messages, None)
