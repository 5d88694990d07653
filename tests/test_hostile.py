"""Hostile input (pure): fields only the service sets, JSON nested without end, compaction items that inflate
without end or hold too many messages, credentials kept in the ingress."""

from __future__ import annotations

import base64
import json
import zlib

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from compaction.errors import InvalidInput
from compaction.history import MAX_MESSAGES, parse_messages
from serving.api import _for_replica
from serving.middleware import MAX_DEPTH, BodyGuard, json_depth
from serving.wire.chat import SERVICE_FIELDS, refuse_service_fields
from serving.wire.codec import MAX_DECODED_BYTES, PREFIX, decode


def packed(text: bytes) -> str:
    return PREFIX + base64.urlsafe_b64encode(zlib.compress(text, 9)).decode().rstrip("=")


def test_json_depth_skips_strings_and_escapes() -> None:
    assert json_depth(b'{"a": "[[[{{{\\"[[", "b": [[1], [2, {"c": "]]"}]]}') == 4
    assert json_depth(b'"just [a] string"') == 0 and json_depth(b"[" * 100_000 + b"]" * 100_000) == 100_000


def test_the_body_guard_refuses_json_nested_past_the_limit() -> None:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, int]:
        return {"bytes": len(await request.body())}

    client = TestClient(BodyGuard(app, max_bytes=1 << 20))
    ok = {"a": json.loads("[" * (MAX_DEPTH - 2) + "]" * (MAX_DEPTH - 2))}
    assert client.post("/echo", json=ok).status_code == 200
    deep = '{"messages": [{"role": "user", "content": "x", "extra": ' + "[" * 300 + "]" * 300 + "}]}"
    refused = client.post("/echo", content=deep, headers={"content-type": "application/json"})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "body" and "(303 levels" in refused.json()["error"]["message"]


def test_a_compaction_item_that_inflates_past_the_cap_is_refused_naming_it() -> None:
    bomb = packed(b'[{"role": "user", "content": "' + b"a" * (MAX_DECODED_BYTES + 1) + b'"}]')
    assert len(bomb) < 64 << 10  # a small body
    with pytest.raises(InvalidInput) as refused:
        decode(bomb, "input[3].encrypted_content")
    assert refused.value.field == "input[3].encrypted_content" and "inflating past" in refused.value.message


def test_a_compaction_item_nested_deep_is_a_4xx_not_a_recursion_error() -> None:
    with pytest.raises(InvalidInput, match="nested deeper"):
        decode(packed(b"[" * 100_000 + b"]" * 100_000), "input[0].encrypted_content")


def test_a_history_of_too_many_messages_is_refused_before_it_is_parsed() -> None:
    with pytest.raises(InvalidInput, match=f"over the limit of {MAX_MESSAGES}") as refused:
        decode(packed(json.dumps([{"role": "user", "content": ""}] * (MAX_MESSAGES + 1)).encode()), "item")
    assert refused.value.field == "item"
    assert len(parse_messages([{"role": "user", "content": "hi"}] * 10)) == 10


@pytest.mark.parametrize("name", SERVICE_FIELDS)
def test_fields_only_the_service_sets_are_refused_naming_them(name: str) -> None:
    with pytest.raises(InvalidInput) as refused:
        refuse_service_fields({"model": "m", "messages": [], name: -1})
    assert refused.value.field == name and "set by the service" in refused.value.message
    refuse_service_fields({"model": "m", "messages": [], "temperature": 0, "user": "u"})  # the API's own fields pass


def test_the_model_replica_never_sees_the_callers_key() -> None:
    scope = {
        "type": "http", "method": "POST", "path": "/v1/chat/completions", "query_string": b"",
        "headers": [(b"authorization", b"Bearer sk-secret"), (b"x-api-key", b"sk-secret"), (b"x-session-id", b"old"),
                    (b"user-agent", b"codex")],
    }  # fmt: skip
    seen = _for_replica(Request(scope), "s1").headers
    assert "authorization" not in seen and "x-api-key" not in seen
    assert seen.getlist("x-session-id") == ["s1"] and seen["user-agent"] == "codex"
    assert _for_replica(Request(scope)).headers.getlist("x-session-id") == ["old"]


def test_the_responses_websocket_is_refused_at_once_with_426() -> None:
    from starlette.testclient import WebSocketDenialResponse

    from serving.wire.responses_answer import refuse_websocket

    app = FastAPI()
    app.add_api_websocket_route("/v1/responses", refuse_websocket)
    upgrade = {"upgrade": "websocket", "connection": "Upgrade", "sec-websocket-version": "13",
               "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ=="}  # fmt: skip
    with (
        TestClient(app) as client,
        pytest.raises(WebSocketDenialResponse) as denied,
        client.websocket_connect("/v1/responses", headers=upgrade),
    ):
        pass
    assert denied.value.status_code == 426 and "POST /v1/responses" in denied.value.text
