"""Coding-agent histories on the real engine and through the real service (shared `service` fixture).

Lean on purpose: a ~2k-token trace on the engine with the compactor's window narrowed to 1,536
tokens exercises the windowed layout; the ~20k-token run on the 8k window is `python -m jobs.bench.history`.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from compaction.checks.validity import problems
from compaction.compactor import Compactor
from compaction.history import parse_messages
from compaction.tokenizer import HFChatTokenizer
from jobs.data.traces import coding_trace
from tests.support import SERVED_MODEL
from tests.test_validity import openai_valid

NULLABLE = ("name", "tool_calls", "tool_call_id")


@pytest.mark.engine
async def test_windowed_layout_on_the_engine_reaches_its_floor(engine: Any, tokenizer: HFChatTokenizer) -> None:
    messages = coding_trace(11, 2000, tokenizer).messages
    compactor = Compactor(tokenizer, engine, context_window=1536, block_size=engine.block_size)
    await engine.reset_prefix_cache()
    options = {"chunk_tokens": 256, "max_chunk_summary_tokens": 24, "retry_bad_summaries": False}
    result = await compactor.compact(messages, options)
    stats = result.stats
    assert stats.layout == "windowed" and stats.windows >= 2 and stats.chunks >= 6
    assert max(c.prompt_tokens for c in stats.per_chunk) + 24 <= 1536
    assert stats.computed_prefill_tokens <= 1.05 * stats.prefill_floor_tokens
    assert stats.cached_prompt_tokens > 0  # prompts of a group reused each other's history
    assert problems(result.messages) == [] and stats.compacted_tokens < stats.history_tokens


@pytest.mark.ray
@pytest.mark.engine
def test_compacted_coding_history_goes_straight_back_into_chat(
    client: httpx.Client, tokenizer: HFChatTokenizer
) -> None:
    messages = coding_trace(12, 1500, tokenizer).messages
    options = {"chunk_tokens": 512, "max_chunk_summary_tokens": 32, "keep_recent_tokens": 300}
    response = client.post("/v1/compact", json={"model": SERVED_MODEL, "messages": messages, **options})
    assert response.status_code == 200, response.text
    body = response.json()
    compacted: list[dict[str, Any]] = body["messages"]
    assert body["stats"]["layout"] == "prefix_exact" and len(compacted) < len(messages)
    assert not any(key in m and m[key] is None for m in compacted for key in NULLABLE)
    assert any(m.get("tool_calls") for m in compacted) and any(m["role"] == "tool" for m in compacted)
    assert openai_valid(compacted) and problems(parse_messages(compacted)) == []
    chat = client.post(
        "/v1/chat/completions",
        json={"model": SERVED_MODEL, "messages": compacted, "max_tokens": 8, "temperature": 0},
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"] is not None


@pytest.mark.ray
@pytest.mark.engine
def test_a_tool_result_without_its_call_is_a_422_naming_it(client: httpx.Client) -> None:
    messages = [
        {"role": "user", "content": "Fix the test."},
        {"role": "tool", "tool_call_id": "call_1", "content": "1 failed"},
    ]
    response = client.post("/v1/compact", json={"model": SERVED_MODEL, "messages": messages})
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["param"] == "messages[1]" and "assistant tool_calls" in error["message"]
