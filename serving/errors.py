"""The one error table: every failure leaves the service as an HTTP status and a body in our shape.

`TABLE` maps each class of the error hierarchy (`compaction.errors`) to its answer: HTTP status,
error type, Retry-After and the compaction metric's outcome; a failure is resolved by the most
specific class in its MRO (as httpx's `map_exceptions` does), so a new subclass answers as its parent
until it gets a row. Every wire format reads it (Anthropic's shape is rewritten from the status,
`serving.wire.errors`), and so does the coordinator's round trip: a `Failure` carries any
`CompactionError` subclass across a Ray call as data and raises it again on the other side.

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
    a request the engine refused (ray.serve.llm's OpenAIHTTPException, vLLM's client errors): its 4xx
    with the engine's own sentence and the field it names, never the replica's internals; else a 503
    the core broke its own contract (InvalidOutput: a bug)  500

Error bodies carry our own message, never an exception's text (that goes to the log); every answer
carries the request's `x-request-id` (Serve's proxy echoes the client's or makes one), which the log
lines name.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from functools import cache
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

from compaction.errors import (
    BackendError,
    CompactionError,
    DeadlineExceeded,
    InvalidInput,
    InvalidOutput,
    ModelNotAvailable,
    Overloaded,
    PromptTooLong,
    UnknownModel,
    located,
)
from serving.metrics import OutcomeKind

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Answer:
    """How one class of failure is answered."""

    status: int  # HTTP status
    type: str  # the error body's type (OpenAI-style)
    outcome: OutcomeKind  # the compaction metric's outcome
    retry_after_s: float | None = None  # Retry-After; an Overloaded error's own value wins
    code: str | None = None  # the error body's code, when clients read one (else the status)


TABLE: dict[type[Exception], Answer] = {
    CompactionError: Answer(500, "internal_error", "failed"),
    InvalidInput: Answer(422, "invalid_request_error", "invalid"),
    UnknownModel: Answer(404, "not_found_error", "invalid"),
    PromptTooLong: Answer(400, "invalid_request_error", "invalid", code="context_length_exceeded"),
    InvalidOutput: Answer(500, "internal_error", "failed"),  # the core broke its own contract: a bug
    BackendError: Answer(503, "service_unavailable", "failed", 5.0),
    Overloaded: Answer(429, "rate_limit_error", "overloaded", 5.0),
    DeadlineExceeded: Answer(504, "timeout_error", "timeout"),
    ModelNotAvailable: Answer(503, "service_unavailable", "failed", 30.0),
}
BACK_PRESSURE = Answer(503, "service_unavailable", "overloaded", 5.0)  # Serve refused: every replica is full


def answer_of(exc: BaseException) -> Answer | None:
    """The table's row for `exc`: its most specific class that has one (None: not ours)."""
    return next((TABLE[cls] for cls in type(exc).__mro__ if cls in TABLE), None)


def outcome_of(exc: CompactionError) -> OutcomeKind:
    """The compaction metric's outcome of a failed compaction."""
    answer = answer_of(exc)
    return answer.outcome if answer is not None else "failed"


@cache
def _error_classes() -> dict[str, type[CompactionError]]:
    """Every CompactionError class by name (the hierarchy is defined once, in compaction.errors)."""
    found, todo = {CompactionError.__name__: CompactionError}, [CompactionError]
    while todo:
        for sub in todo.pop().__subclasses__():
            found[sub.__name__] = sub
            todo.append(sub)
    return found


class Failure(BaseModel):
    """A CompactionError as plain data, so it crosses a Ray call with its class, field and hints intact."""

    model_config = ConfigDict(frozen=True)
    kind: str  # the error's class name
    message: str
    field: str | None = None
    retry_after_s: float | None = None
    timeout_s: float | None = None

    @classmethod
    def of(cls, exc: CompactionError) -> Failure:
        kind = type(exc).__name__ if type(exc).__name__ in _error_classes() else CompactionError.__name__
        if isinstance(exc, InvalidInput):
            return cls(kind=kind, message=exc.message, field=exc.field)
        if isinstance(exc, DeadlineExceeded):
            return cls(kind=kind, message=str(exc), timeout_s=exc.timeout_s)
        retry = exc.retry_after_s if isinstance(exc, Overloaded) else None
        return cls(kind=kind, message=str(exc), retry_after_s=retry)

    def exception(self) -> CompactionError:
        kind = _error_classes().get(self.kind, CompactionError)
        if issubclass(kind, InvalidInput):
            return kind(self.field or "request", self.message)
        if issubclass(kind, Overloaded):
            return kind(self.message, self.retry_after_s or 1.0)
        if issubclass(kind, DeadlineExceeded):
            return kind(self.message, self.timeout_s or 0.0)
        return kind(self.message)


def error_response(
    status: int,
    kind: str,
    message: str,
    param: str | None = None,
    retry: float | None = None,
    code: str | None = None,
) -> JSONResponse:
    headers = {"Retry-After": str(int(retry))} if retry is not None else None
    body = {"error": {"message": message, "type": kind, "param": param, "code": code or status}}
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
    loc, message = located(errors) if errors else (("body",), "invalid request")
    field = field_path(loc)
    return error_response(422, "invalid_request_error", f"{field}: {message}", field)


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
    """An exception raised inside a model replica (a RayTaskError), without Ray's internals in the answer."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, KeyError | ValueError | TypeError):
        detail = f"{type(cause).__name__}: {str(cause)[:200]}"
        message = f"messages: the model's chat template could not render them ({detail}); send OpenAI-style messages"
        return error_response(400, "invalid_request_error", message, "messages")
    logger.error("a model replica failed on %s (request %s): %r", request.url.path, _request_id(request), exc)
    return error_response(
        503, "service_unavailable", "the model replica failed on this request; retry shortly", None, 5
    )


# ray.serve.llm wraps the engine's refusal as "Message: <sentence> (Request ID: ...), Internal exception: ...";
# vLLM's sentence may start with its exception's qualified name and end with "(parameter=<field>, value=...)".
_ENGINE_SENTENCE = re.compile(r"^Message: (?P<sentence>.*?) \(Request ID: [^)]*\)", re.DOTALL)
_QUALIFIED = re.compile(r"^(?:[A-Za-z_]\w*\.)+[A-Za-z_]\w*: ")
_PARAMETER = re.compile(r"\s*\(parameter=(?P<param>[\w.\[\]]+)(?:, value=[^)]*)?\)")
ENGINE_SENTENCE_CHARS = 300


def engine_refusal(text: str) -> tuple[str, str | None]:
    """The engine's own sentence and the field it names, from the text ray.serve.llm wrapped it in."""
    found = _ENGINE_SENTENCE.match(text)
    sentence = _QUALIFIED.sub("", found["sentence"] if found else text.split(", Internal exception", 1)[0])
    parameter = _PARAMETER.search(sentence)
    sentence = _PARAMETER.sub("", sentence).strip()[:ENGINE_SENTENCE_CHARS]
    return sentence or "the model refused this request", parameter["param"] if parameter else None


async def on_engine_error(request: Request, exc: Exception) -> JSONResponse:
    """A request the model's engine refused (ray.serve.llm's OpenAIHTTPException from a replica, or vLLM's own
    client error raised where the request is read), answered in our shape; the engine's whole text goes to the
    log."""
    from vllm.exceptions import VLLMClientError, VLLMNotFoundError

    if isinstance(exc, VLLMClientError):
        status = 404 if isinstance(exc, VLLMNotFoundError) else 400
        text, named = str(exc.args[0] if exc.args else exc), getattr(exc, "parameter", None)
    else:
        status, text, named = int(getattr(exc, "status_code", 500)), str(getattr(exc, "message", "")), None
    if not 400 <= status < 500:
        logger.warning("engine error %d on %s (request %s): %s", status, request.url.path, _request_id(request), text)
        return error_response(503, "service_unavailable", "the model failed on this request; retry shortly", None, 5)
    logger.info("the engine refused a request on %s (request %s): %s", request.url.path, _request_id(request), text)
    sentence, param = engine_refusal(text)
    param = named if isinstance(named, str) else param
    kind = "not_found_error" if status == 404 else "invalid_request_error"
    return error_response(status, kind, f"{param}: {sentence}" if param else sentence, param)


async def on_error(request: Request, exc: Exception) -> JSONResponse:
    """A failure of the hierarchy, answered by its row of the table."""
    answer = answer_of(exc)
    if answer is None:
        raise exc
    if isinstance(exc, PromptTooLong):  # clients match this wording as it is (agents compact on it)
        return error_response(answer.status, answer.type, exc.message, exc.field, code=answer.code)
    if isinstance(exc, InvalidInput):
        return error_response(answer.status, answer.type, f"{exc.field}: {exc.message}", exc.field)
    wait = exc.retry_after_s if isinstance(exc, Overloaded) else answer.retry_after_s
    if answer.status >= 500:
        logger.warning("%s on %s (request %s): %s", answer.type, request.url.path, _request_id(request), exc)
    return error_response(answer.status, answer.type, str(exc), None, wait)


async def on_back_pressure(request: Request, exc: Exception) -> JSONResponse:
    """Serve's own refusal when every replica of a deployment is at its limit."""
    message = "every replica is busy right now; retry after the Retry-After seconds"
    return error_response(BACK_PRESSURE.status, BACK_PRESSURE.type, message, None, BACK_PRESSURE.retry_after_s)


def _request_id(request: Request) -> str | None:
    """The x-request-id every answer carries (the client's, or Serve's), for the log lines of a failure."""
    return request.headers.get("x-request-id")


def install_error_handlers(app: FastAPI) -> None:
    """Every failure of `app` answered through the table above."""
    from ray.exceptions import RayTaskError
    from ray.llm._internal.serve.core.configs.openai_api_models import OpenAIHTTPException
    from ray.serve.exceptions import BackPressureError
    from vllm.exceptions import VLLMError

    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(RayTaskError, on_replica_error)
    app.add_exception_handler(BackPressureError, on_back_pressure)
    app.add_exception_handler(OpenAIHTTPException, on_engine_error)
    app.add_exception_handler(VLLMError, on_engine_error)
    for kind in TABLE:
        app.add_exception_handler(kind, on_error)
