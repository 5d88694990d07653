"""The one error table: every failure leaves the service as an HTTP status and a body in our shape.

Errors leave as OpenAI-style bodies `{"error": {"message", "type", "param", "code"}}` naming the
offending field (Anthropic's shape on its routes, `serving.wire.errors`):

    body over max_request_bytes            413      body empty / not UTF-8 / not JSON   400
    Content-Type not application/json      415      missing or wrong bearer key     401
    field fails validation                 422      unknown model                   404
    compaction queue full (Overloaded), or the tenant past its concurrency / rate limit  429 + Retry-After
    past the request's timeout_s (DeadlineExceeded)  504
    no replica or coordinator could finish it (BackendError, Serve back-pressure)  503 + Retry-After
    any other HTTP error FastAPI raises (e.g. a body nested too deeply to parse)  its status, same shape
    an exception inside a model replica (ray.serve.llm's OpenAI endpoints): 400 when the model could
    not read the messages (KeyError/ValueError/TypeError from its chat template), else 503; never Ray's text
    the core broke its own contract (InvalidOutput: a bug)  500

Error bodies carry our own message, never an exception's text (that goes to the log); every answer
carries the request's `x-request-id` (Serve's proxy echoes the client's or makes one), which the log
lines name.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from ray.exceptions import RayTaskError
from ray.serve.exceptions import BackPressureError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

from compaction.errors import (
    BackendError,
    DeadlineExceeded,
    InvalidInput,
    InvalidOutput,
    ModelNotAvailable,
    Overloaded,
    UnknownModel,
)

logger = logging.getLogger(__name__)


# (exception, HTTP status, error type, Retry-After seconds or None): the first match wins.
ERRORS: tuple[tuple[type[Exception], int, str, float | None], ...] = (
    (UnknownModel, 404, "not_found_error", None),
    (InvalidInput, 422, "invalid_request_error", None),
    (Overloaded, 429, "rate_limit_error", 5.0),
    (DeadlineExceeded, 504, "timeout_error", None),
    (BackendError, 503, "service_unavailable", 5.0),
    (ModelNotAvailable, 503, "service_unavailable", 30.0),
    (BackPressureError, 503, "service_unavailable", 5.0),
    (InvalidOutput, 500, "internal_error", None),
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


async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
    """FastAPI's own HTTP errors (a body it cannot parse, an unknown path, a wrong method) in our shape."""
    assert isinstance(exc, HTTPException)
    if isinstance(exc.__cause__, RecursionError):
        message = "body: JSON nested too deeply to parse; send a flatter document"
    else:
        message = f"body: {exc.detail}" if exc.status_code == 400 else str(exc.detail)
    param = "body" if exc.status_code == 400 else None
    response = error_response(exc.status_code, "invalid_request_error", message, param)
    response.headers.update(exc.headers or {})
    return response


async def on_replica_error(request: Request, exc: Exception) -> JSONResponse:
    """An exception raised inside a model replica, without Ray's internals in the answer."""
    assert isinstance(exc, RayTaskError)
    cause = exc.cause
    if isinstance(cause, KeyError | ValueError | TypeError):
        detail = f"{type(cause).__name__}: {str(cause)[:200]}"
        message = f"messages: the model's chat template could not render them ({detail}); send OpenAI-style messages"
        return error_response(400, "invalid_request_error", message, "messages")
    logger.error("a model replica failed on %s (request %s): %r", request.url.path, _request_id(request), exc)
    return error_response(
        503, "service_unavailable", "the model replica failed on this request; retry shortly", None, 5
    )


async def on_error(request: Request, exc: Exception) -> JSONResponse:
    for kind, status, name, retry in ERRORS:
        if isinstance(exc, kind):
            if isinstance(exc, InvalidInput):
                return error_response(status, name, f"{exc.field}: {exc.message}", exc.field)
            wait = exc.retry_after_s if isinstance(exc, Overloaded) else retry
            if status >= 500:
                logger.warning("%s on %s (request %s): %s", name, request.url.path, _request_id(request), exc)
            return error_response(status, name, str(exc), None, wait)
    raise exc


def _request_id(request: Request) -> str | None:
    """The x-request-id every answer carries (the client's, or Serve's), for the log lines of a failure."""
    return request.headers.get("x-request-id")


def install_error_handlers(app: FastAPI) -> None:
    """Every failure of `app` answered through the table above."""
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(RayTaskError, on_replica_error)
    for kind, *_ in ERRORS:
        app.add_exception_handler(kind, on_error)
