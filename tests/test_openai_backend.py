"""The OpenAI-compatible HTTP backend, against the suite's real service (ray.serve.llm's OpenAI endpoints)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from compaction.backend import GenerationRequest
from compaction.compactor import Compactor
from compaction.errors import BackendError
from compaction.tokenizer import HFChatTokenizer
from serving.backends import OpenAIBackend, parse_completion
from tests.support import SERVED_MODEL, auth, free_port


def test_parse_completion_reads_cached_tokens() -> None:
    body = {
        "choices": [{"text": "a summary", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 300, "completion_tokens": 9, "prompt_tokens_details": {"cached_tokens": 256}},
    }
    gen = parse_completion(body, 300, 0.5)
    assert (gen.text, gen.output_tokens) == ("a summary", 9)
    assert (gen.cached_prompt_tokens, gen.computed_prefill_tokens) == (256, 44)
    assert gen.finish_reason == "length"


def test_malformed_response_is_a_backend_error() -> None:
    with pytest.raises(BackendError, match="malformed"):
        parse_completion({"choices": []}, 10, 0.1)


async def test_unreachable_endpoint_is_a_backend_error() -> None:
    backend = OpenAIBackend(f"http://127.0.0.1:{free_port()}", "m", timeout_s=2)
    with pytest.raises(BackendError, match="unreachable"):
        await backend.generate(GenerationRequest((1, 2, 3), max_tokens=1))
    await backend.aclose()


@pytest.mark.engine
@pytest.mark.ray
async def test_compaction_over_http_reports_engine_cache(
    service: Any, tokenizer: HFChatTokenizer, locomo: list[dict[str, Any]]
) -> None:
    from jobs.data.conversations import locomo_messages, truncate_history

    history = truncate_history(locomo_messages(locomo[1]), tokenizer, 1500)
    # One session: every prompt goes to the same model replica, whose prefix cache the stats report.
    http = httpx.AsyncClient(
        base_url=service.url, headers={"x-session-id": "openai-backend-test", **auth()}, timeout=600
    )
    backend = OpenAIBackend(service.url, SERVED_MODEL, client=http)
    compactor = Compactor(tokenizer, backend, context_window=4096, block_size=128)
    try:
        first = await compactor.compact(history, {"chunk_tokens": 512, "max_chunk_summary_tokens": 24})
        again = await compactor.compact(history, {"chunk_tokens": 512, "max_chunk_summary_tokens": 24})
    finally:
        await http.aclose()
    assert first.stats.chunks == 3 and first.summary.strip()
    assert first.stats.cached_prompt_tokens > 0  # prompts 2..N reuse prompt 1's history
    assert first.stats.computed_prefill_tokens <= 1.05 * first.stats.prefill_floor_tokens
    # a repeat finds every full history block cached
    assert again.stats.computed_prefill_tokens < 0.3 * first.stats.computed_prefill_tokens
