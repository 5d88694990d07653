"""Bounded work per request, through the real service: over-cap requests get a 422 that says what to change,
and a maximal legal request does not freeze /healthz or small compactions beside it."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest

from compaction.tokenizer import HFChatTokenizer
from jobs.data.conversations import locomo_messages, truncate_history
from tests.support import SERVED_MODEL, SERVICE_MAX_BYTES
from tests.test_production import cheap

pytestmark = [pytest.mark.ray, pytest.mark.engine]

# The CPU default's caps (compaction.partition): one engine batch of chunks, sixteen 8,192-token windows.
MAX_CHUNKS, MAX_HISTORY_TOKENS = 128, 16 * 8192


def history(tokenizer: HFChatTokenizer, tokens: int, locomo: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """LoCoMo turns repeated to about `tokens` tokens (whole turns)."""
    turns: list[dict[str, Any]] = list(locomo_messages(locomo[0]))
    messages: list[dict[str, Any]] = []
    while len(messages) * 60 < tokens * 1.2:
        messages += turns
    return truncate_history(messages, tokenizer, tokens)


def test_requests_over_the_caps_get_a_422_saying_what_to_change(
    client: httpx.Client, tokenizer: HFChatTokenizer, locomo: list[dict[str, Any]]
) -> None:
    messages = history(tokenizer, 24_000, locomo)
    many = client.post("/v1/compact", json={"model": SERVED_MODEL, "messages": messages, "chunk_tokens": 128})
    assert many.status_code == 422, many.text
    error = many.json()["error"]
    assert error["param"] == "chunk_tokens" and f"max_chunks of {MAX_CHUNKS}" in error["message"]
    least = int(error["message"].rsplit(">= ", 1)[1].split()[0])
    assert 129 <= least <= 256, error["message"]  # the span over max_chunks, rounded up
    huge = history(tokenizer, MAX_HISTORY_TOKENS + 4000, locomo)
    assert len(json.dumps(huge)) < SERVICE_MAX_BYTES
    over = client.post("/v1/compact", json={"model": SERVED_MODEL, "messages": huge, "chunk_tokens": 4096})
    assert over.status_code == 422, over.text
    assert over.json()["error"]["param"] == "messages" and "max_history_tokens" in over.json()["error"]["message"]


async def test_a_maximal_request_leaves_healthz_and_small_compactions_answering(
    client: httpx.Client, tokenizer: HFChatTokenizer, locomo: list[dict[str, Any]]
) -> None:
    """The largest history at the smallest chunk the caps allow, run in the background priority with a deadline:
    meanwhile /healthz and small compactions answer within seconds (planning is off the coordinator's loop)."""
    messages = history(tokenizer, MAX_HISTORY_TOKENS - 2000, locomo)
    big = {
        "model": SERVED_MODEL, "messages": messages, "chunk_tokens": -(-MAX_HISTORY_TOKENS // MAX_CHUNKS),
        "max_chunk_summary_tokens": 16, "reuse_chunks": False, "timeout_s": 10, "priority": "background",
    }  # fmt: skip
    small = {"model": SERVED_MODEL, "strategy": "sequential", "max_chunk_summary_tokens": 6, "reuse_chunks": False}
    health: list[float] = []
    compactions: list[tuple[int, float]] = []
    async with httpx.AsyncClient(base_url=client.base_url, headers=client.headers, timeout=120) as http:
        began = time.perf_counter()
        running = asyncio.create_task(http.post("/v1/compact", json=big))
        await asyncio.sleep(1.0)
        i = 0
        while not running.done() and time.perf_counter() - began < 15:
            t = time.perf_counter()
            assert (await http.get("/healthz")).status_code == 200
            health.append(time.perf_counter() - t)
            if i % 4 == 0:
                t = time.perf_counter()
                text = f"Remember locker {i} holds the blue bag (note {i})."
                body = {**small, "messages": cheap(text)["messages"], "session_id": f"small-{i}"}
                compactions.append(((await http.post("/v1/compact", json=body)).status_code, time.perf_counter() - t))
            i += 1
            await asyncio.sleep(0.5)
        response = await running
    print(
        f"maximal request: {len(messages)} messages, {response.status_code} after {time.perf_counter() - began:.1f} s;"
        f" /healthz x{len(health)} max {max(health):.2f} s; small compactions {compactions}"
    )
    assert response.status_code in (200, 504), response.text
    assert health and max(health) < 5.0
    assert compactions and all(status == 200 and seconds < 15.0 for status, seconds in compactions)
