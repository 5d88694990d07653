"""The ingress's request checks and error table on a bare FastAPI app (pure; the real app is in test_serving_app)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from compaction.errors import BackendError, DeadlineExceeded, InvalidInput, Overloaded, UnknownModel
from serving.errors import engine_refusal, field_path, install_error_handlers, on_engine_error, on_replica_error
from serving.middleware import BodyGuard
from serving.tenants import TenancyConfig, TenantGate
from serving.wire.compact import CompactRequest

GOOD: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def app(max_bytes: int = 4096) -> FastAPI:
    api = FastAPI()
    install_error_handlers(api)
    api.add_middleware(BodyGuard, max_bytes=max_bytes)
    api.add_middleware(TenantGate, config=TenancyConfig(api_key_env="TEST_COMPACTION_KEY", api_keys_env="TEST_KEYS"))

    @api.post("/v1/compact")
    async def compact(body: CompactRequest) -> dict[str, Any]:
        raising = {
            "404": UnknownModel("model", "no"),
            "429": Overloaded("busy", 9),
            "503": BackendError("gone"),
            "504": DeadlineExceeded("too slow", 3),
        }
        if body.model in raising:
            raise raising[body.model]
        return body.job(None).options.model_dump()

    @api.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return api


@pytest.fixture
def client(monkeypatch: pytest.MonkeyPatch) -> TestClient:
    monkeypatch.delenv("TEST_COMPACTION_KEY", raising=False)
    return TestClient(app())


def test_field_paths_read_like_the_request() -> None:
    assert field_path(("body", "messages", 0, "role")) == "messages[0].role"
    assert field_path(("body",)) == "body"
    assert field_path(("query", "x")) == "query.x"


def test_a_good_request_reaches_the_handler_with_its_options(client: TestClient) -> None:
    response = client.post("/v1/compact", json={**GOOD, "chunk_tokens": 64, "layout": "paper"})
    assert response.status_code == 200
    assert response.json()["chunk_tokens"] == 64 and response.json()["layout"] == "paper"
    extractive = client.post("/v1/compact", json={**GOOD, "strategy": "extractive", "grounding_threshold": 0.4})
    assert extractive.status_code == 200
    assert extractive.json()["strategy"] == "extractive" and extractive.json()["grounding_threshold"] == 0.4


@pytest.mark.parametrize(
    ("content", "headers", "status", "needle"),
    [
        (b'{"model": "m", "messages": [}', {"content-type": "application/json"}, 400, "not valid JSON"),
        (b"\xff\xfe{}", {"content-type": "application/json"}, 400, "not UTF-8"),
        (b"  ", {"content-type": "application/json"}, 400, "empty"),
        (b'{"model": "m"}', {"content-type": "text/plain"}, 415, "application/json"),
        (b'{"model": "m"}', {}, 415, "application/json"),
        (b"x" * 5000, {"content-type": "application/json"}, 413, "over the limit"),
    ],
)
def test_bodies_are_checked_before_any_handler(
    client: TestClient, content: bytes, headers: dict[str, str], status: int, needle: str
) -> None:
    response = client.post("/v1/compact", content=content, headers=headers)
    assert response.status_code == status
    assert needle in response.json()["error"]["message"]


def test_an_oversize_body_without_length_is_cut_off(client: TestClient) -> None:
    chunks = iter([b"[" + b"1," * 1500, b"1," * 1500 + b"1]"])
    response = client.post("/v1/compact", content=chunks, headers={"content-type": "application/json"})
    assert response.status_code == 413


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"messages": GOOD["messages"]}, "model"),
        ({**GOOD, "messages": []}, "messages"),
        ({**GOOD, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({**GOOD, "chunk_tokens": -1}, "chunk_tokens"),
        ({**GOOD, "variant": "verbose"}, "variant"),
        ({**GOOD, "placement": "nearest"}, "placement"),
        ({**GOOD, "strategy": "abstractive"}, "strategy"),
        ({**GOOD, "grounding_threshold": 1.5}, "grounding_threshold"),
        ({**GOOD, "grounding_threshold": "high"}, "grounding_threshold"),
        ({**GOOD, "unexpected": 1}, "unexpected"),
        ({**GOOD, "tools": [{"type": "function"}]}, "tools[0].function"),
        ({**GOOD, "tools": [{"type": "web_search", "function": {"name": "f"}}]}, "tools[0].type"),
    ],
)
def test_invalid_fields_get_422_naming_the_field(client: TestClient, body: dict[str, Any], field: str) -> None:
    response = client.post("/v1/compact", json=body)
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["param"] == field and error["message"].startswith(f"{field}: ")


def test_the_error_table_sets_status_and_retry_after(client: TestClient) -> None:
    assert client.post("/v1/compact", json={**GOOD, "model": "404"}).status_code == 404
    busy = client.post("/v1/compact", json={**GOOD, "model": "429"})
    assert busy.status_code == 429 and busy.headers["retry-after"] == "9"
    gone = client.post("/v1/compact", json={**GOOD, "model": "503"})
    assert gone.status_code == 503 and int(gone.headers["retry-after"]) > 0
    late = client.post("/v1/compact", json={**GOOD, "model": "504"})
    assert late.status_code == 504 and late.json()["error"]["type"] == "timeout_error"


def test_a_body_nested_too_deeply_gets_a_400_in_our_shape(client: TestClient) -> None:
    deep = b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    response = TestClient(app(max_bytes=1 << 20)).post(
        "/v1/compact", content=deep, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "body" and "nested too deeply" in error["message"] and error["code"] == 400


def test_framework_http_errors_use_our_shape(client: TestClient) -> None:
    wrong_method = client.get("/v1/compact")
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["message"]
    assert client.get("/nowhere").json()["error"]["code"] == 404


def test_an_oversize_body_is_read_to_its_end_before_the_413() -> None:
    received: list[int] = []
    body = [b"[" + b"1," * 2000, *([b"1," * 2000] * 20), b"1]"]

    async def receive() -> dict[str, Any]:
        part = body[len(received)]
        received.append(len(part))
        return {"type": "http.request", "body": part, "more_body": len(received) < len(body)}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def never(*_: Any) -> None:
        raise AssertionError("the handler must not run")

    guard = BodyGuard(never, max_bytes=4096)
    scope = {"type": "http", "method": "POST", "path": "/v1/compact", "headers": [(b"content-length", b"84003")]}
    asyncio.run(guard(scope, receive, send))  # type: ignore[arg-type]
    assert len(received) == len(body)  # every part read, though the limit was passed after the first two
    assert sent[0]["status"] == 413


def test_invalid_input_raised_inside_names_its_field() -> None:
    api = app()

    @api.post("/raise")
    async def boom() -> None:
        raise InvalidInput("messages[3].content", "content is null and there are no tool_calls")

    response = TestClient(api).post("/raise", json={})
    assert response.status_code == 422 and response.json()["error"]["param"] == "messages[3].content"


def test_the_api_key_guards_everything_but_health(monkeypatch: pytest.MonkeyPatch) -> None:
    key = "s3cret-0123456789ab"
    monkeypatch.setenv("TEST_COMPACTION_KEY", key)
    client = TestClient(app())
    assert client.post("/v1/compact", json=GOOD).status_code == 401
    wrong = client.post("/v1/compact", json=GOOD, headers={"authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.headers["www-authenticate"] == "Bearer"
    assert client.post("/v1/compact", json=GOOD, headers={"authorization": f"Bearer {key}"}).status_code == 200
    assert client.post("/v1/compact", json=GOOD, headers={"x-api-key": key}).status_code == 200  # anthropic's
    assert client.post("/v1/compact", json=GOOD, headers={"x-api-key": "nope"}).status_code == 401
    assert client.get("/healthz").status_code == 200


def test_session_header_is_used_when_the_body_names_none() -> None:
    request = CompactRequest.model_validate(GOOD)
    assert request.job("from-header").session_id == "from-header"
    assert CompactRequest.model_validate({**GOOD, "session_id": "body"}).job("header").session_id == "body"
    assert request.job(None).session_id is None


@pytest.mark.parametrize(
    ("cause", "status", "needle"), [(KeyError("role"), 400, "chat template"), (RuntimeError("CUDA"), 503, "retry")]
)
def test_errors_inside_a_model_replica_never_leak_rays_text(cause: Exception, status: int, needle: str) -> None:
    from ray.exceptions import RayTaskError

    api = app()
    api.add_exception_handler(RayTaskError, on_replica_error)

    @api.post("/v1/chat/completions")
    async def chat() -> None:
        raise RayTaskError(
            "ServeReplica:LLMServer.handle_request", "Traceback: ray::internal", cause
        ).as_instanceof_cause()

    response = TestClient(api).post("/v1/chat/completions", json={})
    assert response.status_code == status and needle in response.json()["error"]["message"]
    assert "ray::" not in response.text and "Traceback" not in response.text


# What ray.serve.llm's replica answers for requests the engine refuses (seen through the real service).
ENGINE_TEXTS = [
    ("Message: Requested sample logprobs of 50, which is greater than max allowed: 20 (parameter=logprobs, value=50) "
     "(Request ID: 65a9), Internal exception: ray.llm._internal.serve.core.configs.openai_api_models."
     "OpenAIHTTPException (Request ID: 65a9), original exception: ",
     "logprobs", "Requested sample logprobs of 50, which is greater than max allowed: 20"),
    ("Message: vllm.exceptions.VLLMValidationError: When using `tool_choice`, `tools` must be set. "
     "(parameter=tool_choice) (Request ID: f2af), Internal exception: vllm.exceptions.VLLMValidationError: When "
     "using `tool_choice`, `tools` must be set. (parameter=tool_choice) (Request ID: f2af), original exception: x",
     "tool_choice", "When using `tool_choice`, `tools` must be set."),
    ("Message: Grammar error: Invalid type: bogus (Request ID: c8bb), Internal exception: ray.llm._internal.serve."
     "core.configs.openai_api_models.OpenAIHTTPException (Request ID: c8bb), original exception: ",
     None, "Grammar error: Invalid type: bogus"),
]  # fmt: skip


@pytest.mark.parametrize(("text", "param", "sentence"), ENGINE_TEXTS)
def test_an_engine_refusal_keeps_its_sentence_and_field_only(text: str, param: str | None, sentence: str) -> None:
    assert engine_refusal(text) == (sentence, param)


@pytest.mark.parametrize(("status", "expected"), [(400, 400), (404, 404), (500, 503)])
def test_an_engine_refusal_is_answered_in_our_shape(status: int, expected: int) -> None:
    from ray.llm._internal.serve.core.configs.openai_api_models import OpenAIHTTPException

    api = app()
    api.add_exception_handler(OpenAIHTTPException, on_engine_error)

    @api.post("/v1/chat/completions")
    async def chat() -> None:
        raise OpenAIHTTPException(status_code=status, message=ENGINE_TEXTS[1][0], type="OpenAIHTTPException")

    response = TestClient(api).post("/v1/chat/completions", json={})
    error = response.json()["error"]
    assert response.status_code == expected and "Internal" not in response.text and "vllm." not in response.text
    assert error["type"] in ("invalid_request_error", "not_found_error", "service_unavailable")
    if expected < 500:
        assert error["param"] == "tool_choice" and error["message"].startswith("tool_choice: When using")


def test_vllms_own_refusal_names_its_parameter_in_our_shape() -> None:
    from vllm.exceptions import VLLMValidationError

    api = app()
    api.add_exception_handler(VLLMValidationError, on_engine_error)

    @api.post("/v1/chat/completions")
    async def chat() -> None:
        raise VLLMValidationError("When using `tool_choice`, `tools` must be set.", parameter="tool_choice")

    response = TestClient(api).post("/v1/chat/completions", json={})
    assert response.status_code == 400 and response.json()["error"] == {
        "message": "tool_choice: When using `tool_choice`, `tools` must be set.",
        "type": "invalid_request_error", "param": "tool_choice", "code": 400,
    }  # fmt: skip
