"""Grounded and extractive compaction through the real service (the suite's shared `service`)."""

from __future__ import annotations

import httpx
import pytest

from compaction.checks.grounding import Source
from compaction.history import parse_messages, template_view
from compaction.tokenizer import HFChatTokenizer
from jobs.data.facts import coding_history
from tests.support import SERVED_MODEL

pytestmark = [pytest.mark.ray, pytest.mark.engine]


def test_extractive_compacts_a_history_over_the_window_without_a_model(
    client: httpx.Client, tokenizer: HFChatTokenizer
) -> None:
    known = coding_history(1, 12_000, tokenizer)  # over the 8k window of every model-based prompt layout
    body = {"model": SERVED_MODEL, "messages": known.messages, "strategy": "extractive", "chunk_tokens": 2048}
    response = client.post("/v1/compact", json={**body, "max_chunk_summary_tokens": 128})
    assert response.status_code == 200, response.text
    result = response.json()
    stats = result["stats"]
    assert stats["history_tokens"] > 11_000 and stats["layout"] == "extractive" and stats["chunks"] >= 5
    assert stats["prompt_tokens"] == stats["output_tokens"] == 0 and stats["replicas"] == [None] * stats["chunks"]
    assert stats["placement"]["reason"] == "no model prompts (extractive compaction)"
    assert {c["status"] for c in stats["per_chunk"]} == {"extractive"}
    assert all(c["summary_tokens"] <= 128 and c["ungrounded"] == [] for c in stats["per_chunk"])
    assert stats["compacted_tokens"] < stats["history_tokens"] // 5
    failing = next(f.text for f in known.facts if f.kind == "failing_test")
    assert failing in result["summary"]


def test_parallel_summaries_on_the_service_state_nothing_invented(
    client: httpx.Client, tokenizer: HFChatTokenizer
) -> None:
    known = coding_history(2, 2048, tokenizer)
    options = {"chunk_tokens": 512, "max_chunk_summary_tokens": 40}
    response = client.post("/v1/compact", json={"model": SERVED_MODEL, "messages": known.messages, **options})
    assert response.status_code == 200, response.text
    stats = response.json()["stats"]
    chunks = stats["per_chunk"]
    assert stats["grounding_threshold"] == 0.7 and len(chunks) == stats["chunks"] >= 4
    assert all(c["first_grounding"] is not None and c["ungrounded"] == [] for c in chunks)
    assert stats["ungrounded_chunks"] == [c["index"] for c in chunks if c["first_grounding"] < 0.7]
    assert all(c["retries"] == 1 for c in chunks if c["index"] in stats["ungrounded_chunks"])
    # independently of the stats: every salient token of the summary occurs in the history
    history = Source(*(template_view(m)["content"] for m in parse_messages(known.messages)))
    assert history.check(response.json()["summary"]).ungrounded == ()
