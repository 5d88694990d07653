"""The chat completions wire format's side of compaction: the turn's outcome as a top-level `compaction` object
beside the chat-completion fields (on the last data event when streamed), its messages sendable back as they are.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import Any

from starlette.responses import JSONResponse, Response, StreamingResponse

from compaction.errors import InvalidInput
from serving.turns import TurnCompaction
from serving.wire.sse import Events

# vLLM's request fields only the service may set: the engine's scheduling priority (a client's would rank its
# turns above every other agent's), its request ids, transfer and extension hooks, a template of its own, raw
# embeddings. A client that sends one is refused, naming it; none reaches an engine.
SERVICE_FIELDS = (
    "priority", "request_id", "kv_transfer_params", "ec_transfer_params", "vllm_xargs", "chat_template",
    "mm_processor_kwargs", "media_io_kwargs", "mm_payload", "routed_experts_prompt_start", "prompt_embeds",
)  # fmt: skip


def refuse_service_fields(body: dict[str, Any]) -> None:
    """Raises InvalidInput naming the first field of SERVICE_FIELDS the client's body carries."""
    for name in SERVICE_FIELDS:
        if name in body:
            raise InvalidInput(name, f"{name} is set by the service, not by a client; drop it from the request")


def compaction_json(outcome: TurnCompaction) -> dict[str, Any]:
    """The `compaction` object of the response: null fields of messages dropped, so they can be sent back as-is."""
    data = outcome.model_dump(mode="json")
    if outcome.messages is not None:
        data["messages"] = [m.model_dump(mode="json", exclude_none=True) for m in outcome.messages]
    return data


def when_sent(response: Response, done: Callable[[dict[str, Any] | None], None]) -> Response:
    """The response, with `done` called once it is sent (now, or after the last event of a stream) with the
    assistant message it answered (None: it answered none, an error)."""
    if not isinstance(response, StreamingResponse):
        reply = Reply()
        if isinstance(response, JSONResponse) and response.status_code == 200:
            with contextlib.suppress(ValueError):  # not JSON: no message to read
                reply.add(json.loads(bytes(response.body)))
        done(reply.message())
        return response

    async def events() -> AsyncIterator[Any]:
        reply, chunks = Reply(), Events()
        try:
            async for event in response.body_iterator:
                yield event
                for chunk in chunks.feed(event):
                    reply.add(chunk)
        finally:
            done(reply.message() if response.status_code == 200 else None)

    return StreamingResponse(events(), status_code=response.status_code, media_type=response.media_type)


class Reply:
    """The assistant message a chat completion answered: its JSON's, or the deltas of its stream's chunks."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.seen = False

    def add(self, chunk: Any) -> None:
        choices = chunk.get("choices") if isinstance(chunk, dict) else None
        part: dict[str, Any] = (
            choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
        )
        said = part.get("delta") or part.get("message")
        if not isinstance(said, dict):
            return
        self.seen = True
        if isinstance(said.get("content"), str):
            self.text.append(said["content"])
        for call in said.get("tool_calls") or []:
            if not isinstance(call, dict):
                continue
            blank = {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
            slot = self.calls.setdefault(call.get("index", len(self.calls)), blank)
            slot["id"] = call.get("id") or slot["id"]
            function = call["function"] if isinstance(call.get("function"), dict) else {}
            for name in ("name", "arguments"):
                slot["function"][name] += function.get(name) or ""

    def message(self) -> dict[str, Any] | None:
        if not self.seen:
            return None
        text = "".join(self.text)
        if not self.calls:
            return {"role": "assistant", "content": text}
        return {"role": "assistant", "content": text or None, "tool_calls": [self.calls[k] for k in sorted(self.calls)]}


def with_compaction(response: Response, outcome: TurnCompaction) -> Response:
    """The model's response with `compaction` beside the chat-completion fields (on the last chunk if streaming)."""
    extra = compaction_json(outcome)
    if isinstance(response, StreamingResponse):
        stream = _on_last_event(response.body_iterator, extra)
        return StreamingResponse(stream, status_code=response.status_code, media_type=response.media_type)
    if isinstance(response, JSONResponse) and response.status_code == 200:
        payload = json.loads(bytes(response.body))
        if isinstance(payload, dict):
            return JSONResponse({**payload, "compaction": extra}, status_code=response.status_code)
    return response


async def _on_last_event(events: AsyncIterable[Any], extra: dict[str, Any]) -> AsyncIterator[str]:
    """Server-sent events passed through, the last data event before `[DONE]` carrying `compaction`."""
    held: str | None = None
    pending = ""
    async for packet in events:
        pending += bytes(packet).decode() if isinstance(packet, bytes | bytearray | memoryview) else str(packet)
        *complete, pending = pending.split("\n\n")
        for event in (e for e in complete if e.strip()):
            if event.strip() == "data: [DONE]":
                if held is not None:
                    yield _carrying(held, extra)
                    held = None
                yield event + "\n\n"
                continue
            if held is not None:
                yield held + "\n\n"
            held = event
    if held is not None:
        yield _carrying(held, extra)
    if pending.strip():
        yield pending


def _carrying(event: str, extra: dict[str, Any]) -> str:
    prefix = "data: "
    try:
        payload = json.loads(event.strip()[len(prefix) :]) if event.strip().startswith(prefix) else None
    except json.JSONDecodeError:
        payload = None
    if not isinstance(payload, dict):
        return f"{event}\n\n{prefix}{json.dumps({'compaction': extra})}\n\n"
    return f"{prefix}{json.dumps({**payload, 'compaction': extra})}\n\n"
