"""The compaction flow on the real tokenizer with a fake backend (pure; no engine)."""

from __future__ import annotations

import asyncio
import copy

import pytest

from compaction.backend import GenerationRequest
from compaction.chunk_cache import ChunkCache
from compaction.compactor import FALLBACKS, Compactor
from compaction.errors import BackendError, ContextOverflow, InvalidInput
from compaction.pacing import BACKGROUND, Escalation
from compaction.plan import SUMMARY_HEADER
from compaction.tokenizer import ChatTokenizer
from tests.fakes import PLAIN, ChatMLTokenizer, FakeBackend, HoldingBackend


@pytest.fixture(scope="module")
def tokenizer(chat_tokenizer: ChatMLTokenizer) -> ChatMLTokenizer:
    return chat_tokenizer


def history(turns: int = 40) -> list[dict]:
    out = [{"role": "system", "content": "You are a travel agent."}]
    for i in range(turns):
        out.append({"role": "user", "content": f"Turn {i}: please book trip number {i} to city {i} on day {i}."})
        out.append({"role": "assistant", "content": f"Booked trip {i}; confirmation code C{i:04d}."})
    return out


def make(tokenizer: ChatTokenizer, **kw) -> tuple[Compactor, FakeBackend]:
    backend = FakeBackend(**kw)
    return Compactor(tokenizer, backend, context_window=8192, block_size=16), backend


async def test_parallel_merges_in_chunk_order_and_keeps_system(tokenizer: ChatTokenizer) -> None:
    def by_chunk(request: GenerationRequest) -> tuple[str, str]:
        return f"S{request.request_id.split('-')[1]}.", "stop"

    compactor, backend = make(tokenizer, script=by_chunk)
    # the check off: the fake's labels S0, S1, ... occur nowhere in the history
    result = await compactor.compact(history(), {"chunk_tokens": 128, "grounding_threshold": 0, **PLAIN})
    n = result.stats.chunks
    assert n == len(backend.requests) > 3
    assert result.summary == "\n\n".join(f"S{k}." for k in range(n))
    assert result.messages[0].content == "You are a travel agent."
    assert result.messages[1].content == f"{SUMMARY_HEADER}\n{result.summary}"
    assert len(result.messages) == 2
    assert result.stats.compacted_tokens < result.stats.history_tokens


async def test_prefix_exact_reaches_the_floor_and_paper_does_not(tokenizer: ChatTokenizer) -> None:
    figures = {}
    for layout in ("prefix_exact", "paper"):
        compactor, _ = make(tokenizer)
        stats = (await compactor.compact(history(60), {"chunk_tokens": 256, "layout": layout})).stats
        figures[layout] = stats.computed_prefill_tokens / stats.prefill_floor_tokens
    assert figures["prefix_exact"] <= 1.0
    assert figures["paper"] > 1.5


async def test_budgets_reach_the_backend(tokenizer: ChatTokenizer) -> None:
    compactor, backend = make(tokenizer)
    await compactor.compact(history(), {"chunk_tokens": 256, "max_chunk_summary_tokens": 33, **PLAIN})
    assert {r.max_tokens for r in backend.requests} == {33} and {r.min_tokens for r in backend.requests} == {0}
    compactor, backend = make(tokenizer)  # the default pinned_share leaves the model a quarter of the budget
    await compactor.compact(history(), {"chunk_tokens": 256, "max_chunk_summary_tokens": 40})
    assert {r.max_tokens for r in backend.requests} == {10}
    compactor, backend = make(tokenizer)
    await compactor.compact(
        history(), {"strategy": "sequential", "max_chunk_summary_tokens": 99, "fixed_output_tokens": True, **PLAIN}
    )
    assert [(r.max_tokens, r.min_tokens) for r in backend.requests] == [(99, 99)]


async def test_keep_recent_tokens_keeps_whole_newest_messages(tokenizer: ChatTokenizer) -> None:
    compactor, _ = make(tokenizer)
    source = history()
    result = await compactor.compact(source, {"chunk_tokens": 256, "keep_recent_tokens": 70, **PLAIN})
    kept = result.messages[2:]
    assert kept and [m.model_dump(exclude_none=True) for m in kept] == source[-len(kept) :]
    assert result.stats.input_tokens < result.stats.history_tokens - 60


async def test_runaway_is_retried_then_trimmed_and_empty_is_kept_verbatim(tokenizer: ChatTokenizer) -> None:
    loop = "The user booked a trip. " * 40

    def script(request: GenerationRequest) -> tuple[str, str]:
        chunk = request.request_id.split("-")[1]
        if chunk == "0":
            return loop, "length"
        if chunk == "1":
            return "   ", "stop"
        if request.request_id == "chunk-2-first":
            return loop, "length"
        return "fine.", "stop"

    compactor, backend = make(tokenizer, script=script)
    result = await compactor.compact(history(), {"chunk_tokens": 128, **PLAIN})
    status = [c.status for c in result.stats.per_chunk]
    assert status[:4] == ["runaway_trimmed", "kept_verbatim", "retried", "ok"]
    assert result.stats.empty_or_runaway_chunks == [0, 1, 2]
    assert result.stats.retries == 3
    retry = next(r for r in backend.requests if r.request_id == "chunk-0-retry")
    assert retry.repetition_penalty > 1.0
    assert "never repeat a sentence" in tokenizer.decode(retry.prompt_token_ids)
    parts = result.summary.split("\n\n")
    assert parts[0] == "The user booked a trip."
    plan = compactor.plan(history(), {"chunk_tokens": 128})
    chunk = plan.prompts[1].chunk
    assert parts[1] == tokenizer.decode(plan.history.token_ids[chunk.start : chunk.end]).strip()
    assert parts[1] in tokenizer.decode(plan.history.token_ids)  # the chunk, verbatim


async def test_failed_chunk_fails_the_compaction_and_history_is_untouched(tokenizer: ChatTokenizer) -> None:
    compactor, _ = make(tokenizer, fail_on={2})
    source = history()
    before = copy.deepcopy(source)
    with pytest.raises(BackendError):
        await compactor.compact(source, {"chunk_tokens": 128})
    assert source == before


@pytest.mark.parametrize(
    ("messages", "options", "field"),
    [
        ([], {}, "messages"),
        ([{"role": "system", "content": "x"}], {}, "messages"),
        (history(3), {"chunk_tokens": 8}, "chunk_tokens"),
        (history(3), {"layout": "spiral"}, "layout"),
        (history(3), {"variant": "poetic"}, "variant"),
        (history(3), {"strategy": "both"}, "strategy"),
        (history(3), {"max_chunk_summary_tokens": 0}, "max_chunk_summary_tokens"),
        (history(3), {"keep_recent_tokens": 100000}, "keep_recent_tokens"),
        (history(3), {"chunk_instructions": {9: "x"}}, "chunk_instructions"),
        (history(3), {"colour": "red"}, "colour"),
    ],
)
def test_bad_input_raises_one_error_type(tokenizer: ChatTokenizer, messages, options, field) -> None:
    compactor, backend = make(tokenizer)
    before = copy.deepcopy(messages)
    with pytest.raises(InvalidInput) as err:
        compactor.plan(messages, options)
    assert err.value.field == field and err.value.message
    assert messages == before and not backend.requests


def test_history_over_the_window_for_sequential(tokenizer: ChatTokenizer) -> None:
    compactor = Compactor(tokenizer, FakeBackend(), context_window=512, block_size=16)
    with pytest.raises(ContextOverflow, match="use strategy=parallel"):
        compactor.plan(history(30), {"strategy": "sequential"})
    with pytest.raises(ContextOverflow, match="use layout=auto"):
        compactor.plan(history(30), {"layout": "prefix_exact", "chunk_tokens": 128, "max_chunk_summary_tokens": 64})
    for layout in ("independent", "auto"):
        plan = compactor.plan(history(30), {"layout": layout, "chunk_tokens": 128, "max_chunk_summary_tokens": 64})
        assert max(len(p) for p in plan.strict_prompts) + 64 <= 512


async def test_a_background_chunk_asked_again_after_it_fell_back_keeps_that_fallback_once_a_turn_waits(
    tokenizer: ChatTokenizer,
) -> None:
    """A background run asks a chunk that fell back (its prompt, then its strict prompt, both empty) again, both at
    once. A turn raises the run while that second asking is in flight: it is given up on the backend, and the chunk
    keeps the fallback it has (what a compaction at the agent's priority makes of two empty answers), in the chunk
    cache too; the turn waits for no second asking, and the next compaction asks nothing."""

    def second_asking(request: GenerationRequest, before: list[GenerationRequest]) -> bool:
        return any(r.request_id == request.request_id for r in before)

    backend = HoldingBackend(second_asking, script=lambda request: ("", "stop"))
    escalation = Escalation(backend, BACKGROUND)
    compactor = Compactor(tokenizer, escalation, context_window=8192, block_size=16, cache=ChunkCache())
    options = {"chunk_tokens": 256, **PLAIN}
    plan = compactor.plan(history(), options)
    chunks = len(plan.chunks)
    backend.expect = 2 * chunks  # both prompts of every chunk
    run = asyncio.create_task(compactor.summarise(plan, range(chunks), ask_fallbacks_again=True))
    await backend.all_held.wait()  # every chunk asked, retried, fallen back, and asked again (both prompts in flight)
    escalation.hurry()  # a turn waits for the run now
    kept = await run
    assert chunks > 1 and len(backend.given_up) == 2 * chunks
    assert len(kept) == chunks and all(stats.status in FALLBACKS and stats.given_up for stats, _ in kept.values())
    sent = len(backend.requests)
    again = await compactor.run(compactor.plan(history(), options))
    assert again.stats.reused_chunks == chunks and len(backend.requests) == sent
    assert again.stats.given_up_chunks == list(range(chunks))  # what the rolled chunks kept, said at the threshold
