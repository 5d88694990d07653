"""The OpenAI Responses API's answers (serving.wire.responses has its requests): a chat completion as a Response
object or its stream of events, the compaction item first; the /v1/responses/compact answer; the answer to
Codex's compaction_trigger (exactly one compaction item); the refusal of its websocket transport.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Iterator
from typing import Any

from fastapi import WebSocket
from starlette.responses import JSONResponse

from compaction.history import Message
from compaction.result import CompactionStats
from serving.coordinator import ServiceResult
from serving.turns import TurnCompaction
from serving.wire.codec import ChatCall, dumps, encode, item_id, outcome_json
from serving.wire.sse import event


def compaction_item(outcome: TurnCompaction | None, call: ChatCall, forwarded: list[dict[str, Any]]) -> dict | None:
    """The compaction output item of an applied compaction: the forwarded context, encoded, and a readable copy."""
    if outcome is None or outcome.status != "applied":
        return None
    return item_of(call.carried(forwarded))


def item_of(messages: list[Message]) -> dict[str, Any]:
    encoding = encode(messages)
    return {"type": "compaction", "id": item_id(encoding), "encrypted_content": encoding, "messages": dumps(messages)}


def usage(chat: dict[str, Any] | None) -> dict[str, Any]:
    chat = chat or {}
    prompt, completion = int(chat.get("prompt_tokens") or 0), int(chat.get("completion_tokens") or 0)
    cached = int((chat.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def _envelope(call: ChatCall, output: list[dict[str, Any]], status: str, **fields: Any) -> dict[str, Any]:
    return {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "output": output,
        "parallel_tool_calls": True,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "error": None,
        **call.echo,
        **fields,
    }


def response(
    completion: dict[str, Any], call: ChatCall, outcome: TurnCompaction | None, forwarded: list[dict[str, Any]]
) -> dict[str, Any]:
    """A chat completion as a Response object."""
    choice = (completion.get("choices") or [{}])[0]
    message, finish = choice.get("message") or {}, choice.get("finish_reason")
    status = _status(finish, call)
    item = compaction_item(outcome, call, forwarded)
    output = [item] if item else []
    if message.get("content"):
        output.append(_message_item(f"msg_{uuid.uuid4().hex}", message["content"], status))
    for tool_call in message.get("tool_calls") or []:
        function = tool_call.get("function") or {}
        name = function.get("name", "")
        output.append(_call_item(tool_call.get("id"), name, function.get("arguments", ""), call.namespaces.get(name)))
    return _envelope(call, output, status, usage=usage(completion.get("usage")), compaction=outcome_json(outcome))


def _status(finish: str | None, call: ChatCall) -> str:
    """incomplete when the reply reached the client's max_output_tokens; a reply the service's own default budget
    ended (the client set none: Codex sets none) is complete, as a reply the model ended."""
    return "incomplete" if finish == "length" and call.echo.get("max_output_tokens") else "completed"


def _message_item(item: str, text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": item, "role": "assistant", "status": status, "content": [part]}


def _call_item(
    call_id: str | None, name: str, arguments: str, namespace: str | None = None, status: str = "completed"
) -> dict[str, Any]:
    call = call_id or f"call_{uuid.uuid4().hex[:24]}"
    item = {"type": "function_call", "id": f"fc_{call}", "call_id": call, "name": name, "arguments": arguments}
    return {**item, **({"namespace": namespace} if namespace else {}), "status": status}


def compacted(result: ServiceResult, call: ChatCall) -> dict[str, Any]:
    """The /v1/responses/compact answer: the user messages kept verbatim, then one item carrying everything
    (those messages too: a client sends the output back whole, and everything before the item is ignored)."""
    kept = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": m.text()}]}
        for m in result.messages[result.kept_head + 1 :]
        if m.role == "user"
    ]
    return {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response.compaction",
        "created_at": int(time.time()),
        "model": call.echo["model"],
        "output": [*kept, item_of(call.carried(dumps(result.messages)))],
        "usage": compaction_usage(result.stats),
    }


def compaction_usage(stats: CompactionStats | None) -> dict[str, Any]:
    """A compaction's prefill and decode as a Responses usage object (zeros when none ran)."""
    prompt = stats.prompt_tokens if stats else 0
    output = stats.output_tokens if stats else 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": stats.cached_prompt_tokens if stats else 0, "cache_write_tokens": 0},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + output,
    }


def triggered(call: ChatCall, outcome: TurnCompaction | None, forwarded: list[dict[str, Any]]) -> dict[str, Any]:
    """The answer to a compaction_trigger: a Response whose output is exactly one compaction item, carrying the
    compacted context (or, when nothing could be compacted, the context as it was)."""
    stats = outcome.stats if outcome is not None else None
    fields = {"usage": compaction_usage(stats), "compaction": outcome_json(outcome)}
    return _envelope(call, [item_of(call.carried(forwarded))], "completed", **fields)


async def stream_triggered(
    call: ChatCall, outcome: TurnCompaction | None, forwarded: list[dict[str, Any]]
) -> AsyncIterator[str]:
    """`triggered` as Responses events: created, in_progress, the item added and done, completed."""
    out = _Stream(call)
    answer = triggered(call, outcome, forwarded)
    yield out.send("response.created", response=out.envelope("in_progress", usage=None))
    yield out.send("response.in_progress", response=out.envelope("in_progress", usage=None))
    for text in out.whole(answer["output"][0]):
        yield text
    final = out.envelope("completed", usage=answer["usage"], compaction=answer["compaction"])
    yield out.send("response.completed", response=final)


class _Stream:
    """The Responses events of one streamed answer: numbered, one output item open at a time."""

    def __init__(self, call: ChatCall) -> None:
        self.call = call
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.key: str | int | None = None  # "text", or the chat tool call index it streams
        self.id = f"resp_{uuid.uuid4().hex}"

    def send(self, kind: str, **data: Any) -> str:
        self.sequence += 1
        return event(kind, {"type": kind, "sequence_number": self.sequence - 1, **data})

    def envelope(self, status: str, **fields: Any) -> dict[str, Any]:
        return {**_envelope(self.call, list(self.output), status, **fields), "id": self.id}

    def whole(self, item: dict[str, Any]) -> Iterator[str]:
        index = len(self.output)
        self.output.append(item)
        yield self.send("response.output_item.added", output_index=index, item=item)
        yield self.send("response.output_item.done", output_index=index, item=item)

    def text(self, delta: str) -> Iterator[str]:
        if self.key != "text" or self.open is None:
            yield from self.close()
            self.key, self.open = "text", _message_item(f"msg_{uuid.uuid4().hex}", "", "in_progress")
            added = {**self.open, "content": []}
            yield self.send("response.output_item.added", output_index=len(self.output), item=added)
            part = dict(self.open["content"][0])
            yield self.send("response.content_part.added", **self._at(), content_index=0, part=part)
        self.open["content"][0]["text"] += delta
        yield self.send("response.output_text.delta", **self._at(), content_index=0, delta=delta, logprobs=[])

    def tool_call(self, delta: dict[str, Any]) -> Iterator[str]:
        index, function = delta.get("index", 0), delta.get("function") or {}
        if self.key != index:
            yield from self.close()
            self.key = index
            name = function.get("name") or ""
            self.open = _call_item(delta.get("id"), name, "", self.call.namespaces.get(name), "in_progress")
            yield self.send("response.output_item.added", output_index=len(self.output), item=dict(self.open))
        if function.get("arguments") and self.open is not None:
            self.open["arguments"] += function["arguments"]
            yield self.send("response.function_call_arguments.delta", **self._at(), delta=function["arguments"])

    def close(self, status: str = "completed") -> Iterator[str]:
        item, self.open, self.key = self.open, None, None
        if item is None:
            return
        at = {"item_id": item["id"], "output_index": len(self.output)}
        if item["type"] == "message":
            part = item["content"][0]
            yield self.send("response.output_text.done", **at, content_index=0, text=part["text"], logprobs=[])
            yield self.send("response.content_part.done", **at, content_index=0, part=part)
        else:
            yield self.send("response.function_call_arguments.done", **at, arguments=item["arguments"])
        item["status"] = status
        self.output.append(item)
        yield self.send("response.output_item.done", output_index=at["output_index"], item=item)

    def _at(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.output)}


async def stream(
    chunks: AsyncIterable[dict[str, Any]],
    call: ChatCall,
    outcome: TurnCompaction | None,
    forwarded: list[dict[str, Any]],
) -> AsyncIterator[str]:
    """A chat completion stream as Responses events, the compaction item first."""
    out = _Stream(call)
    yield out.send("response.created", response=out.envelope("in_progress", usage=None))
    yield out.send("response.in_progress", response=out.envelope("in_progress", usage=None))
    item = compaction_item(outcome, call, forwarded)
    for text in out.whole(item) if item else ():
        yield text
    chat_usage, finish = None, None
    async for chunk in chunks:
        if "error" in chunk:
            error = chunk["error"] if isinstance(chunk["error"], dict) else {"message": str(chunk["error"])}
            yield out.send("error", message=str(error.get("message")), code=None, param=None)
            return
        chat_usage = chunk.get("usage") or chat_usage
        for choice in chunk.get("choices") or []:
            finish = choice.get("finish_reason") or finish
            delta = choice.get("delta") or {}
            for text in out.text(delta["content"]) if delta.get("content") else ():
                yield text
            for tool_call in delta.get("tool_calls") or []:
                for text in out.tool_call(tool_call):
                    yield text
    status = _status(finish, call)
    for text in out.close(status):
        yield text
    final = out.envelope(status, usage=usage(chat_usage), compaction=outcome_json(outcome))
    yield out.send(f"response.{status}", response=final)


async def refuse_websocket(websocket: WebSocket) -> None:
    """The Responses API's websocket transport is not served: 426 at once, on which Codex goes on over HTTP POST
    for the rest of its session (any other answer costs it seven tries, about 6 s, and a 400 fails its turn)."""
    message = "the WebSocket transport is not served; use POST /v1/responses (streamed with stream: true)"
    refusal = {"error": {"message": message, "type": "invalid_request_error", "code": "websocket_not_supported"}}
    try:
        await websocket.send_denial_response(JSONResponse(refusal, status_code=426))
    except RuntimeError:  # a server without the denial-response extension: a plain refusal
        await websocket.close()
