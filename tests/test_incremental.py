"""Incremental compaction (pure; real tokenizer, fake backend): carried summaries and the chunk-summary cache."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from compaction.backend import GenerationRequest
from compaction.chunk_cache import ChunkCache
from compaction.compactor import Compactor
from compaction.history import parse_messages
from compaction.partition import Chunk, partition
from compaction.plan import SUMMARY_HEADER, is_summary
from compaction.result import ChunkStats
from compaction.tokenizer import ChatTokenizer
from tests.fakes import PLAIN, ChatMLTokenizer, FakeBackend


@pytest.fixture(scope="module")
def tokenizer(chat_tokenizer: ChatMLTokenizer) -> ChatMLTokenizer:
    return chat_tokenizer


def turns(first: int, last: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i in range(first, last):
        out.append({"role": "user", "content": f"Turn {i}: please book trip number {i} to city {i} on day {i}."})
        out.append({"role": "assistant", "content": f"Booked trip {i}; confirmation code C{i:04d}."})
    return out


SYSTEM = [{"role": "system", "content": "You are a travel agent."}]


def numbered(request: GenerationRequest) -> tuple[str, str]:
    return f"Summary {len(request.prompt_token_ids)}.", "stop"  # states a number: checked with grounding off


def make(tokenizer: ChatTokenizer, cache: ChunkCache | None = None) -> tuple[Compactor, FakeBackend]:
    backend = FakeBackend(block_size=16, script=numbered)
    return Compactor(tokenizer, backend, context_window=8192, block_size=16, cache=cache), backend


# the model summaries alone: pinned lines are chosen over each compaction's whole span, so they may move
OPTIONS = {"chunk_tokens": 128, "grounding_threshold": 0, **PLAIN}


def test_fixed_borders_stay_borders() -> None:
    chunks = partition(0, 1000, 300, 16, fixed=[100, 700, 5000])  # 5000 lies outside: ignored
    assert [c.end for c in chunks] == [100, 400, 700, 1000]  # [100, 700) is cut on its own: 300 + 300
    assert chunks[0] == Chunk(0, 0, 100) and [c.index for c in chunks] == list(range(4))
    assert [c.end for c in partition(5, 1000, 300, 16, fixed=[333])] == [304, 333, 624, 928, 1000]


async def test_a_grown_history_summarises_only_its_new_chunks(tokenizer: ChatTokenizer) -> None:
    cache = ChunkCache()
    compactor, backend = make(tokenizer, cache)
    options = OPTIONS
    first = await compactor.compact(SYSTEM + turns(0, 30), options)
    old = first.stats.chunks
    assert first.stats.reused_chunks == 0 and len(backend.requests) == old > 3 and len(cache) == old
    grown = await compactor.compact(SYSTEM + turns(0, 40), options)
    assert grown.stats.reused_chunks == old
    assert len(backend.requests) == old + grown.stats.chunks - old  # only the new chunks were sent
    assert grown.summary.startswith(first.summary)  # the old chunks' summaries, unchanged, in order
    reused = [c for c in grown.stats.per_chunk if c.reused]
    assert [c.index for c in reused] == list(range(old)) and all(c.prompt_tokens == 0 for c in reused)
    assert grown.stats.prompt_tokens == sum(len(r.prompt_token_ids) for r in backend.requests[old:])


async def test_other_options_or_an_edited_history_are_not_reused(tokenizer: ChatTokenizer) -> None:
    compactor, _ = make(tokenizer, ChunkCache())
    await compactor.compact(SYSTEM + turns(0, 30), OPTIONS)
    concise = await compactor.compact(SYSTEM + turns(0, 30), {**OPTIONS, "variant": "concise"})
    assert concise.stats.reused_chunks == 0
    edited = SYSTEM + turns(0, 30)
    edited[3] = {"role": "user", "content": "Turn 1: actually, cancel trip 1."}
    again = await compactor.compact(edited, OPTIONS)
    assert again.stats.reused_chunks == 0  # every chunk's prompt holds the edited message or follows it


async def test_reuse_chunks_false_summarises_every_chunk_afresh(tokenizer: ChatTokenizer) -> None:
    compactor, backend = make(tokenizer, ChunkCache())
    first = await compactor.compact(SYSTEM + turns(0, 30), OPTIONS)
    sent = len(backend.requests)
    cold = await compactor.compact(SYSTEM + turns(0, 30), {**OPTIONS, "reuse_chunks": False})
    assert cold.stats.reused_chunks == 0 and len(backend.requests) == 2 * sent
    warm = await compactor.compact(SYSTEM + turns(0, 30), OPTIONS)  # the cache is still there, and still used
    assert warm.stats.reused_chunks == first.stats.chunks and len(backend.requests) == 2 * sent


def test_the_cache_is_bounded() -> None:
    cache = ChunkCache(max_entries=3)
    ids = list(range(100))
    stats = ChunkStats.model_validate(
        {
            "index": 0, "start": 0, "end": 10, "prompt_tokens": 1, "cached_prompt_tokens": 0,
            "computed_prefill_tokens": 1, "output_tokens": 1, "summary_tokens": 1, "latency_s": 0.0,
            "retries": 0, "failovers": 0, "status": "ok",
        }
    )  # fmt: skip
    for k in range(5):
        cache.put("s", ids, Chunk(k, 10 * k, 10 * k + 10), ids[: 10 * k + 10], f"t{k}", stats)
    assert len(cache) == 3
    assert cache.get("s", ids, Chunk(0, 0, 10), ids[:10]) is None
    hit = cache.get("s", ids, Chunk(4, 40, 50), ids[:50])
    assert hit is not None and hit.text == "t4"
    assert cache.borders(ids, 0, 100, "s") == []  # the chain from 0 was evicted
    assert cache.borders(ids, 20, 100, "s") == [30, 40, 50]


async def test_an_earlier_summary_is_carried_verbatim(tokenizer: ChatTokenizer) -> None:
    compactor, backend = make(tokenizer)
    first = await compactor.compact(SYSTEM + turns(0, 30), OPTIONS)
    assert is_summary(first.messages[1]) and first.kept_head == 1
    history = [m.model_dump(exclude_none=True) for m in first.messages] + turns(30, 45)
    sent = len(backend.requests)
    second = await compactor.compact(history, OPTIONS)
    assert second.messages[1] == parse_messages([history[1]])[0]  # carried as it was, word for word
    assert is_summary(second.messages[2]) and second.messages[2].text().startswith(SUMMARY_HEADER)
    assert second.kept_head == 2 and second.stats.carried_summary_tokens > 0
    rendered = compactor.plan(history, OPTIONS).history
    after_summary = rendered.message_starts[2]
    assert all(c.start >= after_summary for c in second.stats.per_chunk)  # never summarised again
    assert len(backend.requests) - sent == second.stats.chunks


async def test_summaries_past_the_carry_limit_are_summarised_again_on_their_own(tokenizer: ChatTokenizer) -> None:
    compactor, _ = make(tokenizer)
    first = await compactor.compact(SYSTEM + turns(0, 30), OPTIONS)
    history = [m.model_dump(exclude_none=True) for m in first.messages] + turns(30, 45)
    plan = compactor.plan(history, {**OPTIONS, "carry_summary_tokens": 8})
    starts = plan.history.message_starts
    assert plan.kept_head == 1 and plan.carried_tokens == 0
    assert plan.span[0] == starts[1] and starts[2] in [c.end for c in plan.chunks]  # a border after the summary
    second = await compactor.compact(history, {**OPTIONS, "carry_summary_tokens": 8})
    assert sum(is_summary(m) for m in second.messages) == 1


async def test_a_cancelled_compaction_leaves_its_finished_chunks_reusable(tokenizer: ChatTokenizer) -> None:
    """Each chunk's summary enters the cache the moment it is done: a run cancelled while one chunk still
    decodes (its deadline, a client gone, an escalation) leaves the others for the next compaction."""
    cache = ChunkCache()
    compactor, backend = make(tokenizer, cache)
    history = SYSTEM + turns(0, 30)
    chunks = len(compactor.plan(history, OPTIONS).prompts)
    stuck = asyncio.Event()
    answer = backend.generate

    async def last_never_ends(request: GenerationRequest) -> Any:
        if len(backend.requests) == chunks - 1:  # the last chunk sent
            backend.requests.append(request)
            stuck.set()
            await asyncio.Event().wait()
        return await answer(request)

    backend.generate = last_never_ends  # type: ignore[method-assign]
    run = asyncio.create_task(compactor.compact(history, OPTIONS))
    await stuck.wait()
    while len(cache) < chunks - 1:
        await asyncio.sleep(0)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    again, backend2 = make(tokenizer, cache)
    result = await again.compact(history, OPTIONS)
    assert result.stats.reused_chunks == chunks - 1 and len(backend2.requests) == 1


def test_borders_kept_from_an_earlier_plan_of_the_span_cut_it_as_if_it_were_whole() -> None:
    whole = partition(11, 1284, 256, 16)
    kept = [c.end for c in whole[:3]]  # the whole chunks of an earlier, shorter plan of the same span
    assert partition(11, 1284, 256, 16, fixed=kept) == whole
    assert [c.end for c in whole] == [256, 512, 768, 1024, 1284]


async def test_a_chunk_another_run_finished_after_this_one_looked_is_reused_not_sent(
    tokenizer: ChatTokenizer,
) -> None:
    """A run looks in the chunk cache, then starts its chunks' tasks; a chunk another run ended in between (so neither
    in flight nor seen cached) is taken from the cache when its task starts, not sent again (before, it was: the
    escalated-fallback test of tests/test_sessions.py saw such a chunk asked twice in about one run in four)."""
    compactor, backend = make(tokenizer, ChunkCache(64))
    history = turns(0, 40)
    options = {"chunk_tokens": 128, **PLAIN}
    late = compactor.plan(history, options)
    first = await compactor.compact(history, options)  # the other run, ended
    sent = len(backend.requests)
    stats, text = await compactor._summarise_and_keep(backend, late, 0, None, True, False)  # the task, starting
    assert len(backend.requests) == sent and stats.reused and text == first.summary.split("\n\n")[0]
