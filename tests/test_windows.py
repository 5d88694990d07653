"""layout auto / windowed: histories beyond the compaction model's window, on the real tokenizer (pure)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compaction.compactor import Compactor
from compaction.errors import ContextOverflow
from compaction.partition import Chunk, partition
from compaction.tokenizer import ChatTokenizer
from compaction.windows import Window, plan_windows
from jobs.data.traces import coding_trace
from tests.fakes import ChatMLTokenizer, FakeBackend

BLOCK = 16


@pytest.fixture(scope="module")
def tokenizer(chat_tokenizer: ChatMLTokenizer) -> ChatMLTokenizer:
    return chat_tokenizer


def test_groups_share_a_start_and_carry_context() -> None:
    chunks = partition(40, 40 + 10 * 128, 128, BLOCK)  # head_end 40: ten chunks of 128 tokens
    windows = plan_windows(chunks, 40, [600] * 10, BLOCK, min_context=200)
    # the first group starts right after the head and takes what fits: 40 + 4 * 128 <= 600
    assert windows[0] == Window(40, (0, 1, 2, 3))
    # later groups start >= 200 tokens before their first target (two chunks), just before a chunk border,
    # at a position ≡ head_end (mod block) so chunk ends fall on block borders in the prompt
    for w in windows[1:]:
        assert w.overlap(chunks) >= 200 and (w.start - 40) % BLOCK == 0
        assert 40 + chunks[w.chunks[-1]].end - w.start <= 600
    assert [c for w in windows for c in w.chunks] == list(range(10))
    assert windows[1] == Window(chunks[2].start - 8, (4, 5))


def test_a_chunk_that_cannot_fit_names_chunk_tokens() -> None:
    with pytest.raises(ContextOverflow) as err:
        plan_windows((Chunk(0, 40, 600),), 40, [500], BLOCK)
    assert err.value.field == "chunk_tokens" and "at most 460" in err.value.message


def make(tokenizer: ChatTokenizer, window: int) -> Compactor:
    return Compactor(tokenizer, FakeBackend(block_size=BLOCK), context_window=window, block_size=BLOCK)


def test_auto_is_prefix_exact_when_it_fits(tokenizer: ChatTokenizer) -> None:
    messages = coding_trace(2, 2500, tokenizer).messages
    options = {"chunk_tokens": 256, "max_chunk_summary_tokens": 64}
    auto = make(tokenizer, 8192).plan(messages, options)
    exact = make(tokenizer, 8192).plan(messages, {**options, "layout": "prefix_exact"})
    assert auto.options.layout == "prefix_exact" and auto.prompts == exact.prompts and auto.windows == 1
    assert make(tokenizer, 1024).plan(messages, options).options.layout == "windowed"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 50), window=st.sampled_from([768, 1024, 1536]), chunk=st.sampled_from([64, 128, 200]))
def test_windowed_prompts_fit_and_chain_within_groups(
    tokenizer: ChatTokenizer, seed: int, window: int, chunk: int
) -> None:
    messages = coding_trace(seed, 3000).messages
    options = {"chunk_tokens": chunk, "max_chunk_summary_tokens": 64, "clearing": "off"}  # the summaries' layout
    plan = make(tokenizer, window).plan(messages, options)
    ids, head = plan.history.token_ids, plan.span[0]
    assert plan.options.layout == "windowed" and plan.windows > 1
    for prompt in (*plan.prompts, *plan.strict_prompts):
        assert len(prompt) + 64 <= window
        assert prompt.body[:head] == ids[:head]  # the kept head (system prompt) leads every prompt
        assert prompt.body[-prompt.chunk.size :] == ids[prompt.chunk.start : prompt.chunk.end]  # target at the end
        assert prompt.chunk.end == plan.span[1] or len(prompt.body) % BLOCK == 0  # chunk ends on a block border
    for a, b in itertools.pairwise(plan.prompts):
        start_a, start_b = (p.chunk.end - (p.history_tokens - head) for p in (a, b))
        if start_a == start_b:  # same group: prompt a minus its tail is a prefix of prompt b
            assert b.body[: len(a.body)] == a.body
        else:
            assert start_b > start_a
    first = [p for p in plan.prompts if p.body == ids[: p.chunk.end]]
    assert first and first[0].chunk.index == 0  # the first group is prefix_exact (reuses the agent's cache)


async def test_windowed_prefill_reaches_its_floor(tokenizer: ChatTokenizer) -> None:
    messages = coding_trace(7, 6000, tokenizer).messages
    compactor = make(tokenizer, 2048)
    result = await compactor.compact(messages, {"chunk_tokens": 256, "max_chunk_summary_tokens": 64})
    stats = result.stats
    assert stats.layout == "windowed" and stats.windows > 2
    assert stats.prefill_floor_tokens > stats.history_tokens  # the overlaps and tails on top of the history once
    assert stats.computed_prefill_tokens <= stats.prefill_floor_tokens
    assert stats.compacted_tokens < stats.history_tokens


def test_sequential_over_the_window_points_at_parallel(tokenizer: ChatTokenizer) -> None:
    messages = coding_trace(1, 3000).messages
    with pytest.raises(ContextOverflow, match="use strategy=parallel"):
        make(tokenizer, 1024).plan(messages, {"strategy": "sequential", "max_chunk_summary_tokens": 64})
