"""The grounding check inside a compaction: retry, pruning, extractive fallback, stats (pure; fake backend)."""

from __future__ import annotations

import pytest

from compaction.backend import GenerationRequest
from compaction.checks.grounding import salient_tokens
from compaction.compactor import Compactor
from compaction.tokenizer import ChatTokenizer
from tests.fakes import PLAIN, ChatMLTokenizer, FakeBackend
from tests.test_compactor import history

INVENTED = "The GolfBridge project is funded by the NSF."


@pytest.fixture(scope="module")
def tokenizer(chat_tokenizer: ChatMLTokenizer) -> ChatMLTokenizer:
    return chat_tokenizer


def script(request: GenerationRequest) -> tuple[str, str]:
    """Chunk 0 invents twice; chunk 1 invents, then its retry is grounded; chunk 2 invents one sentence of three."""
    _, chunk, attempt = request.request_id.split("-")
    if chunk == "0" or (chunk == "1" and attempt == "first"):
        return INVENTED, "stop"
    if chunk == "1":
        return "Trip 1 was booked with code C0001.", "stop"
    if chunk == "2":
        return "Codes C0000, C0001 and C0002 were confirmed. The NSF paid. Booked trip 2.", "stop"
    return "A short summary.", "stop"


async def test_nothing_invented_reaches_the_output(tokenizer: ChatTokenizer) -> None:
    backend = FakeBackend(script=script)
    compactor = Compactor(tokenizer, backend, context_window=8192, block_size=16)
    result = await compactor.compact(history(), {"chunk_tokens": 128, **PLAIN})
    stats = result.stats
    chunks = stats.per_chunk
    assert [c.status for c in chunks[:4]] == ["extractive_fallback", "retried", "ok", "ok"]
    assert [c.first_grounding for c in chunks[:4]] == [0.0, 0.0, 0.75, 1.0]
    assert chunks[0].first_ungrounded == ["golfbridge", "nsf"] and chunks[2].first_ungrounded == ["nsf"]
    assert chunks[2].dropped_sentences == 1
    assert stats.ungrounded_chunks == [0, 1] and stats.extractive_fallback_chunks == [0]
    assert stats.grounding_threshold == 0.7 and stats.retries == 2
    assert all(c.ungrounded == [] and c.grounding == 1.0 for c in chunks)
    assert "GolfBridge" not in result.summary and "NSF" not in result.summary
    parts = result.summary.split("\n\n")
    assert parts[1] == "Trip 1 was booked with code C0001."
    assert parts[2] == "Codes C0000, C0001 and C0002 were confirmed. Booked trip 2."
    # chunk 0's fallback: its own lines, verbatim
    plan = compactor.plan(history(), {"chunk_tokens": 128})
    chunk_text = tokenizer.decode(plan.history.token_ids[plan.chunks[0].start : plan.chunks[0].end])
    assert all(line.split(": ", 1)[1] in chunk_text for line in parts[0].splitlines())
    # the retry asked for grounded text
    retry = next(r for r in backend.requests if r.request_id == "chunk-1-retry")
    assert "add nothing that is not there" in tokenizer.decode(retry.prompt_token_ids)


async def test_threshold_zero_keeps_the_model_text_and_still_scores_it(tokenizer: ChatTokenizer) -> None:
    backend = FakeBackend(script=script)
    compactor = Compactor(tokenizer, backend, context_window=8192, block_size=16)
    result = await compactor.compact(history(), {"chunk_tokens": 128, "grounding_threshold": 0, **PLAIN})
    chunks = result.stats.per_chunk
    assert len(backend.requests) == len(chunks)  # no retries for grounding
    assert chunks[0].status == "ok" and chunks[0].first_grounding == 0.0 and chunks[0].grounding == 0.0
    assert chunks[0].ungrounded == ["golfbridge", "nsf"]
    assert result.stats.ungrounded_chunks == [] and INVENTED in result.summary


async def test_a_sequential_summary_falls_back_to_the_extractive_span(tokenizer: ChatTokenizer) -> None:
    backend = FakeBackend(script=lambda request: (INVENTED, "stop"))
    compactor = Compactor(tokenizer, backend, context_window=8192, block_size=16)
    result = await compactor.compact(history(), {"strategy": "sequential", "max_chunk_summary_tokens": 64})
    (chunk,) = result.stats.per_chunk
    assert chunk.status == "extractive_fallback" and chunk.retries == 1
    assert 0 < chunk.summary_tokens <= 64 and not set(salient_tokens(result.summary)) & {"golfbridge", "nsf"}


async def test_the_callers_instructions_are_a_source_and_our_tail_text_is_not(tokenizer: ChatTokenizer) -> None:
    """A summary may repeat what the caller's instructions say (here "ZX81"), not our own tail's word budget."""

    def says(request: GenerationRequest) -> tuple[str, str]:
        return "The team used the ZX81 board and at most 24 words.", "stop"

    compactor = Compactor(tokenizer, FakeBackend(script=says), context_window=8192, block_size=16)
    options = {"chunk_tokens": 128, "max_chunk_summary_tokens": 40, "instructions": "Call the board ZX81."}
    chunks = (await compactor.compact(history(), options)).stats.per_chunk
    assert all("zx81" not in c.first_ungrounded for c in chunks)
    assert chunks[0].first_ungrounded == ["24"]  # later chunks' histories hold a 24 of their own
