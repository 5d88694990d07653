"""Errors in each format's own shape. The service's errors are OpenAI-style (`serving.errors.error_response`),
which the Responses API shares; on the Anthropic routes the answer is rewritten to
`{"type": "error", "error": {"type", "message"}}`, the type following the status:

    400 413 415 422 -> invalid_request_error   401 authentication_error   403 permission_error
    404 not_found_error   429 rate_limit_error   500 api_error   503 overloaded_error   504 timeout_error
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.types import Message as AsgiMessage

ERROR_KINDS = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 429: "rate_limit_error",
               500: "api_error", 503: "overloaded_error", 504: "timeout_error"}  # fmt: skip


def error_body(body: bytes, status: int) -> bytes:
    """An error answer (our OpenAI-style body, or any other) in Anthropic's shape; the type follows the status."""
    try:
        parsed = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        parsed = None
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if isinstance(error, dict) and error.get("message"):
        message = str(error["message"])
    elif isinstance(error, str):
        message = error
    else:
        message = body.decode(errors="replace")[:2000] or f"HTTP {status}"
    kind = ERROR_KINDS.get(status, "invalid_request_error" if status < 500 else "api_error")
    return json.dumps({"type": "error", "error": {"type": kind, "message": message}}).encode()


class AnthropicErrors:
    """Error answers on the Anthropic routes (/v1/messages...) in Anthropic's shape, whoever produced them
    (the ingress's handlers, its body and auth guards, ray.serve.llm's own handlers): one place, by route."""

    def __init__(self, app: ASGIApp, prefix: str = "/v1/messages") -> None:
        self.app = app
        self.prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.prefix):
            return await self.app(scope, receive, send)
        start: AsgiMessage | None = None
        body = b""

        async def reshaped(message: AsgiMessage) -> None:
            nonlocal start, body
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message
                return
            if start is None or message["type"] != "http.response.body":
                return await send(message)
            body += message.get("body", b"")
            if message.get("more_body"):
                return
            new = error_body(body, start["status"])
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            await send({**start, "headers": [*headers, (b"content-length", str(len(new)).encode())]})
            await send({"type": "http.response.body", "body": new})

        await self.app(scope, receive, reshaped)
