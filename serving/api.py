"""The HTTP ingress: ray.serve.llm's OpenAI endpoints plus `POST /v1/compact` and `GET /healthz`.

One FastAPI app (ray.serve.llm's, with its middleware) serves both, so an agent's turns and its
compactions enter through the same door. Errors leave through one table (`ERRORS`), as OpenAI-style
bodies `{"error": {"message", "type", "param", "code"}}` naming the offending field:

    body over max_request_bytes            413      body empty / not UTF-8 / not JSON   400
    Content-Type not application/json      415      missing or wrong bearer key     401
    field fails validation                 422      unknown model                   404
    compactions at their limit (Overloaded) 429 + Retry-After
    no replica could finish it (BackendError, Serve back-pressure)  503 + Retry-After
    the core broke its own contract (InvalidOutput: a bug)         500
"""

from __future__ import annotations

import asyncio
import hmac
import os
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ConfigDict, Field
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from ray.serve.llm.ingress import OpenAiIngress, make_fastapi_ingress
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.types import Message as AsgiMessage

from compaction.errors import BackendError, InvalidInput, InvalidOutput, ModelNotAvailable, Overloaded, UnknownModel
from compaction.history import Message
from compaction.options import CompactionOptions
from serving.coordinator import CompactJob, Failure, ServiceResult
from serving.ray_adapter import openai_app, openai_routes
from serving.routing import PlacementMode

SESSION_HEADER = "x-session-id"
OPEN_PATHS = frozenset({"/healthz", "/docs", "/docs/oauth2-redirect", "/openapi.json", "/redoc"})
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})

# (exception, HTTP status, error type, Retry-After seconds or None): the first match wins.
ERRORS: tuple[tuple[type[Exception], int, str, float | None], ...] = (
    (UnknownModel, 404, "not_found_error", None),
    (InvalidInput, 422, "invalid_request_error", None),
    (Overloaded, 429, "rate_limit_error", 5.0),
    (BackendError, 503, "service_unavailable", 5.0),
    (ModelNotAvailable, 503, "service_unavailable", 30.0),
    (BackPressureError, 503, "service_unavailable", 5.0),
    (InvalidOutput, 500, "internal_error", None),
)


class CompactRequest(CompactionOptions):
    """`POST /v1/compact`: the compaction options, plus what to compact and where to run it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    model: str = Field(min_length=1, max_length=256, description="A hosted model (GET /v1/models).")
    messages: list[Message] = Field(
        min_length=1, max_length=100_000, description="The history to compact: OpenAI-style chat messages."
    )
    session_id: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        pattern=r"^[^\x00-\x1f]+$",
        description="The agent's session (the x-session-id of its /v1/chat/completions turns); the header "
        "is used when this is absent. Compactions of a session go to the replica caching its history.",
    )
    placement: PlacementMode = Field(
        "auto",
        description="auto: the cost model decides; pinned: every chunk on the session's replica; spread: "
        "contiguous chunk ranges over replicas; round_robin: no affinity (for comparison).",
    )

    def job(self, header_session: str | None) -> CompactJob:
        options = CompactionOptions.model_validate(self.model_dump(include=set(CompactionOptions.model_fields)))
        return CompactJob(
            model=self.model,
            messages=self.messages,
            options=options,
            session_id=self.session_id or header_session or None,
            placement=self.placement,
        )


def error_response(
    status: int, kind: str, message: str, param: str | None = None, retry: float | None = None
) -> JSONResponse:
    headers = {"Retry-After": str(int(retry))} if retry is not None else None
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


def field_path(loc: tuple[Any, ...] | list[Any]) -> str:
    """("body", "messages", 0, "role") -> "messages[0].role"."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "body"


async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = list(exc.errors())
    first: dict[str, Any] = dict(errors[0]) if errors else {"type": "", "loc": ("body",), "msg": "invalid request"}
    if first["type"] == "json_invalid":
        detail = dict(first.get("ctx") or {}).get("error", "malformed")
        return error_response(400, "invalid_request_error", f"body: not valid JSON ({detail})", "body")
    field = field_path(tuple(first["loc"]))
    return error_response(422, "invalid_request_error", f"{field}: {first['msg']}", field)


async def on_error(request: Request, exc: Exception) -> JSONResponse:
    for kind, status, name, retry in ERRORS:
        if isinstance(exc, kind):
            if isinstance(exc, InvalidInput):
                return error_response(status, name, f"{exc.field}: {exc.message}", exc.field)
            wait = exc.retry_after_s if isinstance(exc, Overloaded) else retry
            return error_response(status, name, str(exc), None, wait)
    raise exc


class BodyGuard:
    """Refuses a body over the size limit (413), not JSON (415) or not UTF-8 (400) before any handler."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        declared = headers.get("content-length", "")
        too_big = f"body: over the limit of {self.max_bytes} bytes; send a shorter history or raise max_request_bytes"
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await error_response(413, "request_too_large", too_big, "body")(scope, receive, send)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await error_response(413, "request_too_large", too_big, "body")(scope, receive, send)
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        problem = self._problem(headers, body)
        if problem is not None:
            return await problem(scope, receive, send)
        await self.app(scope, self._replay(body, receive), send)

    @staticmethod
    def _problem(headers: Headers, body: bytes) -> JSONResponse | None:
        media = headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json":
            message = f"body: Content-Type must be application/json, got {media or 'none'!r}"
            return error_response(415, "invalid_request_error", message, "body")
        if not body.strip():
            return error_response(400, "invalid_request_error", "body: empty; send a JSON object", "body")
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as exc:
            return error_response(400, "invalid_request_error", f"body: not UTF-8 (byte {exc.start})", "body")
        return None

    @staticmethod
    def _replay(body: bytes, receive: Receive) -> Receive:
        done = False

        async def replay() -> AsgiMessage:
            nonlocal done
            if done:
                return await receive()
            done = True
            return {"type": "http.request", "body": body, "more_body": False}

        return replay


class BearerAuth:
    """`Authorization: Bearer <key>` on every path but health and docs, when the key's env var is set."""

    def __init__(self, app: ASGIApp, key_env: str) -> None:
        self.app = app
        self.key_env = key_env

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = os.environ.get(self.key_env)
        if scope["type"] == "http" and key and scope["path"] not in OPEN_PATHS:
            scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
                response = error_response(401, "authentication_error", "send Authorization: Bearer <API key>")
                response.headers["WWW-Authenticate"] = "Bearer"
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


class CompactionIngress(OpenAiIngress):
    """ray.serve.llm's OpenAI ingress plus the compaction endpoint."""

    def __init__(
        self,
        llm_deployments: dict[str, DeploymentHandle],
        model_cards: dict[str, Any],
        *,
        coordinator: DeploymentHandle,
        lora_paths: dict[str, str] | None = None,
    ) -> None:
        super().__init__(llm_deployments, model_cards, lora_paths=lora_paths)
        self._coordinator = coordinator

    async def compact(self, body: CompactRequest, request: Request) -> ServiceResult:
        """Compact a history; the stats show where each chunk ran and what the cache served."""
        outcome = await self._coordinator.compact.remote(body.job(request.headers.get(SESSION_HEADER)))
        if isinstance(outcome, Failure):
            raise outcome.exception()
        assert isinstance(outcome, ServiceResult)
        return outcome

    async def healthz(self) -> dict[str, Any]:
        """Ready when the coordinator answers and every model has a running replica."""
        try:
            replicas = await asyncio.wait_for(self._coordinator.replicas.remote(), timeout=10)
        except Exception as exc:
            raise BackendError(f"the compaction coordinator is not answering: {exc!r}") from exc
        starting = sorted(name for name, count in replicas.items() if count == 0)
        if starting:
            raise BackendError(f"no running replica yet for {starting}; the models are starting or failed")
        return {"status": "ok", "models": sorted(replicas), "replicas": replicas}


def compaction_routes() -> dict[str, Any]:
    return {
        "compact": lambda app: app.post(
            "/v1/compact", response_model=ServiceResult, summary="Compact a conversation history"
        ),
        "healthz": lambda app: app.get("/healthz", summary="Liveness of the ingress and the coordinator"),
    }


def make_ingress(max_request_bytes: int, api_key_env: str) -> type:
    """The ingress class, bound to a FastAPI app with the error table, size limit and auth."""
    app: FastAPI = openai_app(
        "Parallel context compaction",
        "POST /v1/compact compacts an agent's history with parallel chunk summaries; the OpenAI "
        "endpoints serve the agent's own turns on the same replicas.",
    )
    app.add_exception_handler(RequestValidationError, on_validation_error)
    for kind, *_ in ERRORS:
        app.add_exception_handler(kind, on_error)
    app.add_middleware(BodyGuard, max_bytes=max_request_bytes)
    app.add_middleware(BearerAuth, key_env=api_key_env)
    return make_fastapi_ingress(CompactionIngress, endpoint_map={**openai_routes(), **compaction_routes()}, app=app)
