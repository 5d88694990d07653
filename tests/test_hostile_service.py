"""Hostile input through the real service: an engine priority or other engine field from a client, JSON nested
without end, a compaction item that inflates without end, the Responses websocket, and a maximal legal block
counted while the ingress keeps answering others."""

from __future__ import annotations

import asyncio
import base64
import json
import time
import zlib
from typing import Any

import httpx
import pytest

from compaction.history import parse_messages
from serving.wire.codec import MAX_DECODED_BYTES, PREFIX, encode
from tests.support import SERVED_MODEL, auth

pytestmark = [pytest.mark.ray, pytest.mark.engine]

SHORT = [{"role": "user", "content": "Say hi."}]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"model": SERVED_MODEL, "messages": SHORT, "max_tokens": 4, "priority": -1}),
        ("/v1/completions", {"model": SERVED_MODEL, "prompt": "Hi", "max_tokens": 4, "priority": -1}),
        ("/v1/chat/completions", {"model": SERVED_MODEL, "messages": SHORT, "request_id": "someone-elses"}),
    ],
)
def test_a_client_cannot_set_the_engines_priority_or_internals(client: httpx.Client, path: str, body: Any) -> None:
    refused = client.post(path, json=body)
    assert 400 <= refused.status_code < 500, refused.text
    named = next(k for k in ("priority", "request_id") if k in body)
    assert refused.json()["error"]["param"] == named and "set by the service" in refused.text


@pytest.mark.parametrize(
    ("path", "extra", "field"),
    [
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 50}, "logprobs"),
        ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
        ("/v1/chat/completions", {"logit_bias": {"99999999": 5}}, "logit_bias"),
        ("/v1/completions", {"logprobs": 50}, "logprobs"),
    ],
)
def test_a_request_the_engine_refuses_is_answered_in_our_shape_without_its_internals(
    client: httpx.Client, path: str, extra: dict[str, Any], field: str
) -> None:
    """Before, such answers carried "Internal exception: ray.llm._internal...OpenAIHTTPException" and vLLM's class
    names, typed "OpenAIHTTPException"."""
    body = {"model": SERVED_MODEL, "max_tokens": 4, **extra}
    body.update({"messages": SHORT} if path == "/v1/chat/completions" else {"prompt": "Hi"})
    refused = client.post(path, json=body)
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["type"] == "invalid_request_error", refused.text
    assert error["param"] == field and error["message"].startswith(f"{field}: "), refused.text
    assert not any(leak in refused.text for leak in ("Internal", "ray.", "vllm.", "Request ID", "Exception"))
    assert refused.headers.get("x-request-id")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_field_the_engines_checks_cannot_read_is_a_422_not_a_500(client: httpx.Client, path: str) -> None:
    """vLLM's own request checks read `structured_outputs` before its type is checked (found by the fuzz test: an
    AttributeError, a 500 in ray.serve.llm's shape)."""
    body = {"model": SERVED_MODEL, "max_tokens": 4, "structured_outputs": 1.5}
    body.update({"messages": SHORT} if path == "/v1/chat/completions" else {"prompt": "Hi"})
    refused = client.post(path, json=body)
    assert refused.status_code == 422 and refused.json()["error"]["param"] == "body", refused.text
    assert "cannot read" in refused.text and "Internal" not in refused.text


def test_json_nested_deep_is_a_400_naming_the_body(client: httpx.Client) -> None:
    message = {"role": "user", "content": "x", "x": "NEST"}
    deep = json.dumps({"model": SERVED_MODEL, "messages": [message]}).replace('"NEST"', "[" * 300 + "]" * 300)
    refused = client.post("/v1/compact", content=deep, headers={"content-type": "application/json"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "body", refused.text


@pytest.mark.parametrize(
    "text",
    [
        b'[{"role": "user", "content": "' + b"a" * (MAX_DECODED_BYTES + 1) + b'"}]',  # inflates past the cap
        b"[" * 100_000 + b"]" * 100_000,  # nested 100,000 deep once inflated (before: a RecursionError, a 500)
    ],
    ids=["inflating", "nested"],
)
def test_a_compaction_item_that_inflates_without_end_is_refused_naming_it(client: httpx.Client, text: bytes) -> None:
    bomb = PREFIX + base64.urlsafe_b64encode(zlib.compress(text, 9)).decode().rstrip("=")
    items = [{"type": "compaction", "encrypted_content": bomb}, {"role": "user", "content": "Go on."}]
    refused = client.post("/v1/responses", json={"model": SERVED_MODEL, "input": items, "max_output_tokens": 4})
    assert 400 <= refused.status_code < 500, refused.text
    assert refused.json()["error"]["param"] == "input[0].encrypted_content", refused.text


def test_the_responses_websocket_is_refused_at_once_with_426(service: Any) -> None:
    upgrade = {"Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13",
               "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==", **auth()}  # fmt: skip
    refused = httpx.get(f"{service.url}/v1/responses", headers=upgrade, timeout=30)
    assert refused.status_code == 426 and "POST /v1/responses" in refused.text, (refused.status_code, refused.text)


async def test_the_ingress_answers_others_while_it_counts_a_maximal_block(service: Any) -> None:
    """A Messages block carrying 20,000 messages (a body of a few hundred KiB) takes a while to decode, parse and
    count: meanwhile /healthz keeps answering (before, the count ran on the event loop and froze the ingress)."""
    carried = [{"role": ("user", "assistant")[i % 2], "content": f"Step {i} done."} for i in range(20_000)]
    block = {"type": "compaction", "content": "Summary.", "encrypted_content": encode(parse_messages(carried))}
    messages = [*SHORT, {"role": "assistant", "content": [block]}, {"role": "user", "content": "Go on."}]
    async with httpx.AsyncClient(base_url=service.url, headers=auth(), timeout=600) as http:
        began = time.monotonic()
        count = asyncio.create_task(
            http.post("/v1/messages/count_tokens", json={"model": SERVED_MODEL, "messages": messages})
        )
        waits: list[float] = []
        while not count.done():
            asked = time.monotonic()
            assert (await http.get("/healthz")).status_code == 200
            waits.append(time.monotonic() - asked)
        counted, took = await count, time.monotonic() - began
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 20_000, counted.text[:300]
    print(
        f"count_tokens of 20,000 carried messages: {took:.2f} s; /healthz answered {len(waits)} times meanwhile, "
        f"worst {max(waits):.3f} s"
    )
    # Side by side in one run: no /healthz waited for the count (a frozen loop makes one wait nearly all of it).
    assert len(waits) >= 3 and max(waits) < took / 2


CARRIED = [{"role": ("user", "assistant")[i % 2], "content": f"Step {i} done."} for i in range(70_000)]
TRIGGER = {"type": "compact_20260112", "trigger": {"type": "input_tokens", "value": 1024}}


@pytest.mark.parametrize(
    ("path", "field"),
    [("/v1/messages", "messages"), ("/v1/messages/count_tokens", "messages"), ("/v1/responses/compact", "input")],
    ids=["messages turn", "count_tokens", "responses compact"],
)
async def test_a_history_that_cannot_fit_is_refused_before_it_is_rendered(service: Any, path: str, field: str) -> None:
    """70,000 short turns in one compaction block (a 240 KiB body): their turn markers alone pass the model's
    max_history_tokens, so the request is refused from that floor at the ingress, before the tens of seconds
    that rendering and counting them took on the ingress and then on a coordinator (the 422 came only after
    them, and /healthz, which asks a coordinator, went unanswered meanwhile)."""
    block = {"type": "compaction", "content": "Summary.", "encrypted_content": encode(parse_messages(CARRIED))}
    messages = [{"role": "assistant", "content": [block]}, {"role": "user", "content": "Go on."}]
    if path == "/v1/messages":
        turn = {"max_tokens": 4, "context_management": {"edits": [TRIGGER]}}
        body = {"model": SERVED_MODEL, "messages": messages, **turn}
    elif path == "/v1/messages/count_tokens":
        body = {"model": SERVED_MODEL, "messages": messages}
    else:
        body = {"model": SERVED_MODEL, "input": [block, {"role": "user", "content": "Go on."}]}
    async with httpx.AsyncClient(base_url=service.url, headers=auth(), timeout=600) as http:
        sent = asyncio.create_task(http.post(path, json=body))
        waits: list[float] = []
        while not sent.done():
            asked = time.monotonic()
            assert (await http.get("/healthz")).status_code == 200
            waits.append(time.monotonic() - asked)
        refused = await sent
    assert 400 <= refused.status_code < 500, refused.text[:300]
    error = refused.json()["error"]  # OpenAI's shape names the field in `param`, Anthropic's in the message
    assert error.get("param", error["message"].split(":")[0]) == field, error
    assert "renders to at least" in error["message"], error
    assert "max_history_tokens" in error["message"]
    print(f"{path}: {refused.status_code}; /healthz answered {len(waits)} times meanwhile, worst {max(waits):.3f} s")
    assert waits and max(waits) < 5.0


def test_every_hostile_request_of_the_soak_is_refused_naming_its_field(client: httpx.Client) -> None:
    from jobs.bench.hostile import hostile_requests

    named = {"bomb": "input[0].encrypted_content", "deep-json": "body", "priority": "priority",
             "request-id": "request_id", "null-block": "encrypted_content", "engine-refusal": "logprobs"}  # fmt: skip
    for kind, path, request in hostile_requests():
        refused = client.post(path, **request)
        assert 400 <= refused.status_code < 500 and named[kind] in refused.text, (kind, refused.text)
        assert "Internal" not in refused.text and "Exception" not in refused.text, (kind, refused.text)


def test_failing_background_runs_leave_the_coordinators_memory_as_it_was(service: Any) -> None:
    """Eight turns whose background run fails in planning, each carrying about 40 KiB of extra fields inside its
    six content parts: a failed run keeps its failure only, so the coordinators' RSS grows by less than one such
    request held in the coordinator used to (24 of them grew the two coordinators by about 800 MiB)."""
    import ray

    from jobs.bench.hostile import coordinators_rss, failing_runs
    from tests.support import SERVICE_KEY

    node = ray.get_runtime_context().get_node_id()
    asyncio.run(failing_runs(service.url, 2, SERVICE_KEY, tag="warm", parts=6))  # the paths' first allocations
    before = coordinators_rss(node)
    started = asyncio.run(failing_runs(service.url, 8, SERVICE_KEY, tag="padded", parts=6))
    ended = asyncio.run(failing_runs(service.url, 8, SERVICE_KEY, tag="padded", parts=6))  # each run has failed by now
    after = coordinators_rss(node)
    assert started == {"running": 8} and ended == {"none": 8}, (started, ended)
    print(f"coordinators' RSS {before / 2**20:.0f} -> {after / 2**20:.0f} MiB")
    assert before > 0 and after - before < 16 * 2**20


def test_the_coordinators_load_no_torch(service: Any) -> None:
    """A coordinator runs no model: its tokenizer loads without torch (compaction.tokenizer.HFChatTokenizer), so no
    coordinator process of the service has torch's library mapped (about 270 MiB of RSS each, before)."""
    from pathlib import Path

    import ray

    from jobs.bench.processes import service_processes

    node = ray.get_runtime_context().get_node_id()
    pids = [p.pid for p in service_processes() if p.role == "coordinator" and p.node_id == node]
    mapped = {pid: "libtorch" in Path(f"/proc/{pid}/maps").read_text() for pid in pids}
    assert pids and not any(mapped.values()), mapped
