"""The archive through the real service: a compaction sent with archive: true keeps its chunks verbatim, and the
official MCP client, with the tenant's key, lists /mcp's tools, recalls a dropped line by its handle and finds it
by words; another tenant's key finds nothing of it, and no key gets a 401."""

from __future__ import annotations

import httpx
import pytest

from jobs.bench.common import mcp_calls
from tests.support import SERVED_MODEL, SERVICE_KEY, TENANT_KEYS, auth
from tests.test_chat_service import coding_history

pytestmark = [pytest.mark.ray, pytest.mark.engine]


async def test_a_compactions_dropped_lines_are_recalled_by_their_handle_through_mcp(client: httpx.Client) -> None:
    history = coding_history(12)
    body = {"model": SERVED_MODEL, "messages": history, "chunk_tokens": 128, "max_chunk_summary_tokens": 16,
            "archive": True}  # fmt: skip
    result = client.post("/v1/compact", json=body)
    assert result.status_code == 200, result.text
    stats = result.json()["stats"]
    handles, note = stats["archived_handles"], stats["archive_note"]
    assert note is None and len(handles) == stats["chunks"] >= 2
    assert all(f"[archived: {h}]" in result.json()["summary"] for h in handles)
    url = str(client.base_url).rstrip("/")

    tools, (recalled, found, other) = await mcp_calls(
        url, SERVICE_KEY,
        ("recall", {"handle": handles[0]}),
        ("search_history", {"query": "parse_1 split"}),
        ("recall", {"handle": "arc-" + "0" * 24}),
    )  # fmt: skip
    assert tools == {"recall", "search_history"}
    text = recalled.content[0].text
    assert not recalled.is_error and "module_0.py" in text and "return text.split(',')[0]" in text  # verbatim
    assert not found.is_error and any(h in found.content[0].text for h in handles)
    assert other.is_error and "was not found" in other.content[0].text

    _, (elsewhere,) = await mcp_calls(url, TENANT_KEYS["tenant-a"], ("recall", {"handle": handles[0]}))
    assert elsewhere.is_error and "was not found" in elsewhere.content[0].text  # as a handle that never existed

    initialize = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}}
    headers = {"Accept": "application/json, text/event-stream"}
    assert httpx.post(f"{url}/mcp", json=initialize, headers=headers, timeout=30).status_code == 401
    assert (
        httpx.post(f"{url}/mcp", json=initialize, headers={**headers, **auth("sk-wrong-0123456789")}).status_code == 401
    )


async def test_cleared_tool_output_is_recalled_verbatim_by_its_stubs_handle_and_the_ledger_heads_the_summary(
    client: httpx.Client,
) -> None:
    """The tiers through the real service and engine: the newest turns' tool output cleared to stubs with handles,
    the older turns summarised by the model, the state ledger in the head; a stub's handle recalls the output."""
    from compaction.checks.omission import handles_in
    from compaction.clearing import STUB
    from compaction.history import parse_messages
    from jobs.data.traces import coding_trace

    history = coding_trace(seed=3, target_tokens=2500).messages
    body = {"model": SERVED_MODEL, "messages": history, "chunk_tokens": 512, "max_chunk_summary_tokens": 180,
            "clearing": "auto", "ledger_tokens": 300, "archive": True, "keep_recent_tokens": 200}  # fmt: skip
    answer = client.post("/v1/compact", json=body)
    assert answer.status_code == 200, answer.text
    result = answer.json()
    stats, messages = result["stats"], parse_messages(result["messages"])
    assert stats["chunks"] >= 1 and stats["cleared_tool_outputs"] >= 1  # both tiers ran
    assert messages[result["head_messages"] :] == parse_messages(history)[result["replaces_through"] :]
    head = messages[result["kept_head"]].text()
    assert "State ledger" in head and stats["ledger_entries"] >= 2 and stats["omissions_repaired"] == 0
    stubs = [m for m in messages if m.role == "tool" and m.text().startswith(STUB)]
    assert stubs and set(handles_in(stubs)) <= set(stats["archived_handles"])
    originals = {m.tool_call_id: m.text() for m in parse_messages(history) if m.role == "tool"}
    _, (recalled,) = await mcp_calls(
        str(client.base_url).rstrip("/"), SERVICE_KEY, ("recall", {"handle": handles_in(stubs[:1])[0]})
    )
    assert not recalled.is_error and recalled.content[0].text == originals[stubs[0].tool_call_id]
