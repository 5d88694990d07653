"""The ingress's body guard: a body over the size limit (413), not JSON (415), not UTF-8 or nested deeper than
MAX_DEPTH (400) is refused before any handler reads it.

A body over the limit is read to its end (up to `DRAIN_LIMIT`) before the 413 goes out, so a
client still sending it reads the answer instead of a connection reset.
"""

from __future__ import annotations

import asyncio
import re

import numpy as np
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.types import Message as AsgiMessage

from serving.errors import error_response

BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
DRAIN_LIMIT = 1 << 30  # an oversize body is read (and dropped) up to this size so the client can read its 413
MAX_DEPTH = 64  # JSON nesting a body may have (tool schemas nest about 10 deep; Python's decoders fail near 1,000)
THREAD_ABOVE = 1 << 18  # a body this large is scanned off the event loop (16 MiB take about half a second)
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NESTING = np.zeros(256, dtype=np.int8)
_NESTING[list(b"[{")] = 1
_NESTING[list(b"]}")] = -1


def json_depth(body: bytes) -> int:
    """How deep a JSON text nests (strings skipped), in a few vectorised passes: no recursion, no parse."""
    steps = _NESTING[np.frombuffer(_STRING.sub(b"0", body), dtype=np.uint8)]
    return int(np.cumsum(steps, dtype=np.int64).max(initial=0))


class _ClientLeft(Exception):
    """The client disconnected while sending its body."""


class BodyGuard:
    """Refuses a body over the size limit (413), not JSON (415), not UTF-8 or too deep (400) before any handler."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        declared = headers.get("content-length", "")
        too_big = f"body: over the limit of {self.max_bytes} bytes; send a shorter history or raise max_request_bytes"
        try:
            body = await self._read(receive, keep=not (declared.isdigit() and int(declared) > self.max_bytes))
        except _ClientLeft:
            return None
        if body is None:
            return await error_response(413, "request_too_large", too_big, "body")(scope, receive, send)
        problem = self._problem(headers, body)
        if problem is not None:
            return await problem(scope, receive, send)
        depth = json_depth(body) if len(body) < THREAD_ABOVE else await asyncio.to_thread(json_depth, body)
        if depth > MAX_DEPTH:
            message = f"body: JSON nested too deeply ({depth} levels, the limit is {MAX_DEPTH}); send flatter JSON"
            return await error_response(400, "invalid_request_error", message, "body")(scope, receive, send)
        await self.app(scope, self._replay(body, receive), send)

    async def _read(self, receive: Receive, *, keep: bool) -> bytes | None:
        """The whole body, or None when it passes the limit: then it is read to its end (up to DRAIN_LIMIT)
        and dropped, so the client finishes sending and reads the 413. Raises _ClientLeft on a disconnect."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientLeft
            part = message.get("body", b"")
            size += len(part)
            keep = keep and size <= self.max_bytes
            if keep:
                chunks.append(part)
            if not message.get("more_body") or size > DRAIN_LIMIT:
                return b"".join(chunks) if keep else None

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
