"""Caps on one compaction's work: chunks per compaction and history tokens, refused with what to change."""

from __future__ import annotations

import re

import pytest

from compaction.chunk_cache import ChunkCache
from compaction.compactor import Compactor
from compaction.errors import OverLimit
from compaction.partition import PlanLimits
from compaction.tokenizer import ChatTokenizer
from serving.models import load_catalogue
from tests.fakes import ChatMLTokenizer

TURNS = [
    {"role": ("user", "assistant")[i % 2], "content": f"step {i}: " + "read the file again " * 12} for i in range(20)
]
MESSAGES = [{"role": "system", "content": "You are a coding agent."}, *TURNS]


@pytest.fixture(scope="module")
def tokenizer(chat_tokenizer: ChatMLTokenizer) -> ChatMLTokenizer:
    return chat_tokenizer


def compactor(tokenizer: ChatTokenizer, limits: PlanLimits) -> Compactor:
    return Compactor(tokenizer, None, context_window=8192, block_size=16, cache=ChunkCache(), limits=limits)  # type: ignore[arg-type]


def test_too_many_chunks_names_the_chunk_tokens_that_fit(tokenizer: ChatTokenizer) -> None:
    capped = compactor(tokenizer, PlanLimits(max_chunks=8, max_history_tokens=100_000))
    with pytest.raises(OverLimit) as refused:
        capped.plan(MESSAGES, {"chunk_tokens": 16})
    assert refused.value.field == "chunk_tokens" and "max_chunks of 8" in refused.value.message
    least = int(re.search(r"chunk_tokens >= (\d+)", refused.value.message).group(1))  # type: ignore[union-attr]
    assert len(capped.plan(MESSAGES, {"chunk_tokens": least}).chunks) <= 8
    with pytest.raises(OverLimit):
        capped.plan(MESSAGES, {"chunk_tokens": least - 1})


def test_a_history_over_the_cap_is_refused_before_it_is_laid_out(tokenizer: ChatTokenizer) -> None:
    capped = compactor(tokenizer, PlanLimits(max_chunks=1024, max_history_tokens=600))
    with pytest.raises(OverLimit, match="max_history_tokens of 600; compact a shorter history") as refused:
        capped.plan(MESSAGES, {"chunk_tokens": 256})
    assert refused.value.field == "messages"
    assert compactor(tokenizer, PlanLimits(1024, 100_000)).plan(MESSAGES, {"chunk_tokens": 256}).chunks


def test_the_default_caps_follow_the_window_and_the_engine_batch() -> None:
    catalogue = load_catalogue()
    cpu, h100 = catalogue.get("smollm2-135m-instruct"), catalogue.get("llama-3.1-8b-instruct")
    assert cpu.plan_limits() == PlanLimits(max_chunks=128, max_history_tokens=16 * 8192)
    assert h100.plan_limits() == PlanLimits(max_chunks=1024, max_history_tokens=16 * 131_072)
    own = cpu.model_copy(update={"max_chunks": 32, "max_history_tokens": 50_000})
    assert own.plan_limits() == PlanLimits(32, 50_000)
