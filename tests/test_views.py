"""Prompt bodies as views of the history, prefix digests carried incrementally, planning linear in the history."""

from __future__ import annotations

import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compaction.chunk_cache import ChunkCache, digest
from compaction.compactor import Compactor
from compaction.layouts import lay_out
from compaction.options import CompactionOptions
from compaction.partition import partition
from compaction.tokenizer import ChatTokenizer
from compaction.views import PrefixDigests, TokenView
from tests.fakes import ChatMLTokenizer

ids = tuple(range(1000, 1300))


@pytest.fixture(scope="module")
def tokenizer(chat_tokenizer: ChatMLTokenizer) -> ChatMLTokenizer:
    return chat_tokenizer


@settings(deadline=None)
@given(st.lists(st.integers(0, len(ids)), min_size=1, max_size=12))
def test_prefix_digests_equal_the_digest_of_the_prefix_in_any_order(ends: list[int]) -> None:
    prefixes = PrefixDigests(ids)
    for end in ends:
        assert prefixes.digest(end) == digest(ids[:end])


@settings(deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(ids)), st.integers(0, len(ids))), min_size=1, max_size=5))
def test_a_view_reads_digests_and_slices_as_its_tuple(spans: list[tuple[int, int]]) -> None:
    pieces = [range(a, b) if i % 2 == 0 else (7, 8, 9) for i, (a, b) in enumerate(spans)]
    view = TokenView(ids, [range(0, 40), *pieces], prefixes=PrefixDigests(ids)).then((5,), range(10, 20))
    flat = view.ids()
    assert len(view) == len(flat) and list(view) == list(flat) and view == flat and flat == view
    assert view.digest() == digest(flat) and digest(view) == digest(flat)
    assert view[3 : len(view) - 2] == flat[3:-2] and view[-1] == flat[-1] and (*view,) == flat and () + view == flat  # noqa: RUF005


def test_a_prefix_exact_plan_holds_no_copy_of_the_history(tokenizer: ChatTokenizer) -> None:
    """Its bodies and tails are views and short tuples; the retry prompts share the bodies' history."""
    messages = [{"role": "user" if i % 2 else "assistant", "content": f"turn {i} " + "word " * 40} for i in range(60)]
    compactor = Compactor(tokenizer, None, context_window=131_072, block_size=16, cache=ChunkCache())  # type: ignore[arg-type]
    plan = compactor.plan(messages, {"chunk_tokens": 16, "layout": "prefix_exact"})
    assert len(plan.chunks) > 100
    for p, strict in zip(plan.prompts, plan.strict_prompts, strict=True):
        assert isinstance(p.body, TokenView) and p.body.source is plan.history.token_ids
        assert p.body == plan.history.token_ids[: p.chunk.end] and strict.body == p.body


def _planning_peak(tokenizer: ChatTokenizer, turns: int) -> int:
    messages = [{"role": ("user", "assistant")[i % 2], "content": f"turn {i} " + "word " * 60} for i in range(turns)]
    compactor = Compactor(tokenizer, None, context_window=1_048_576, block_size=16, cache=ChunkCache())  # type: ignore[arg-type]
    history_plan = compactor.plan(messages, {"chunk_tokens": 16, "strategy": "extractive"})
    history, span = history_plan.history, history_plan.span
    chunks = partition(*span, 16, 16)
    options = CompactionOptions(chunk_tokens=16, layout="prefix_exact")
    tracemalloc.start()
    laid = lay_out(history, tokenizer, options, chunks, span[1], 1_048_576, 16)
    for p in laid.prompts:
        compactor.cache.get(history_plan.scope, history.token_ids, p.chunk, p.view)  # type: ignore[union-attr]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def test_planning_memory_grows_linearly_with_the_history(tokenizer: ChatTokenizer) -> None:
    """Four times the history at the smallest chunk: about four times the memory (copies: sixteen times)."""
    small, large = _planning_peak(tokenizer, 40), _planning_peak(tokenizer, 160)
    print(f"planning peak: {small / 2**20:.2f} MiB at 40 turns, {large / 2**20:.2f} MiB at 160 turns")
    assert large < 6 * small
