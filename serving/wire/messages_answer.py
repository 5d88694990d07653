"""The Anthropic Messages API's answers (serving.wire.messages has its requests): a chat completion as a Message or
its stream of events, the compaction block first and whole in its content_block_start, the applied context edits
reported.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Iterator
from typing import Any

from compaction.history import Message
from serving.turns import TurnCompaction
from serving.wire.codec import ChatCall, encode, outcome_json
from serving.wire.sse import event

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def compaction_block(outcome: TurnCompaction | None, call: ChatCall, forwarded: list[dict[str, Any]]) -> dict | None:
    """The compaction block of an applied compaction: the summary as text, everything it replaces encoded."""
    if outcome is None or outcome.status != "applied" or outcome.messages is None:
        return None
    summary = "\n\n".join(m.text() for m in outcome.messages if m.role != "system")
    return block_of(summary, call.carried(forwarded))


def block_of(summary: str, messages: list[Message]) -> dict[str, Any]:
    return {"type": "compaction", "content": summary, "encrypted_content": encode(messages)}


def _iterations(outcome: TurnCompaction | None, message: dict[str, Any] | None) -> list[dict[str, Any]] | None:
    """usage.iterations: the compaction's own entry (its prompts and summaries), then the message's."""
    stats = outcome.stats if outcome is not None and outcome.status == "applied" else None
    if stats is None:
        return None
    compaction = {"type": "compaction", "input_tokens": stats.prompt_tokens, "output_tokens": stats.output_tokens,
                  "cache_read_input_tokens": stats.cached_prompt_tokens, "cache_creation_input_tokens": 0}  # fmt: skip
    return [compaction, *([{"type": "message", **message}] if message is not None else [])]


def usage(chat: dict[str, Any] | None, outcome: TurnCompaction | None, answered: bool = True) -> dict[str, Any]:
    chat = chat or {}
    message = {
        "input_tokens": int(chat.get("prompt_tokens") or 0),
        "output_tokens": int(chat.get("completion_tokens") or 0),
        "cache_read_input_tokens": int((chat.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
        "cache_creation_input_tokens": 0,
    }
    iterations = _iterations(outcome, message if answered else None)
    return {**message, **({"iterations": iterations} if iterations else {})}


def stop_reason(choice: dict[str, Any], call: ChatCall, called: bool = False) -> tuple[str, str | None]:
    """The Messages stop_reason (and stop_sequence) of a chat choice; `called`: it made a tool call (a forced
    call ends with finish_reason "stop", and Anthropic's clients run tools on "tool_use" only)."""
    matched = choice.get("stop_reason")
    if isinstance(matched, str) and matched in call.echo.get("stop_sequences", []):
        return "stop_sequence", matched
    finish = choice.get("finish_reason") or "stop"
    return ("tool_use" if called and finish == "stop" else STOP_REASONS.get(finish, "end_turn")), None


def _envelope(call: ChatCall, content: list[dict[str, Any]], reason: str | None, stop: str | None) -> dict[str, Any]:
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": call.echo["model"],
            "content": content, "stop_reason": reason, "stop_sequence": stop, **_edits_report(call)}  # fmt: skip


def _edits_report(call: ChatCall) -> dict[str, Any]:
    """`context_management.applied_edits` when the request asked for context edits (Anthropic's report)."""
    return {"context_management": {"applied_edits": list(call.applied_edits)}} if call.edits else {}


def paused(call: ChatCall, outcome: TurnCompaction, forwarded: list[dict[str, Any]]) -> dict[str, Any]:
    """pause_after_compaction: the compaction block alone, no reply generated."""
    block = compaction_block(outcome, call, forwarded)
    assert block is not None
    answer = {**_envelope(call, [block], "compaction", None), "usage": usage(None, outcome, answered=False)}
    return {**answer, "compaction": outcome_json(outcome)}


def message(
    completion: dict[str, Any], call: ChatCall, outcome: TurnCompaction | None, forwarded: list[dict[str, Any]]
) -> dict[str, Any]:
    """A chat completion as a Message."""
    choice = (completion.get("choices") or [{}])[0]
    chat = choice.get("message") or {}
    block = compaction_block(outcome, call, forwarded)
    content = [block] if block else []
    if chat.get("content"):
        content.append({"type": "text", "text": chat["content"]})
    content += [_tool_use(c.get("id"), c.get("function") or {}) for c in chat.get("tool_calls") or []]
    reason, stop = stop_reason(choice, call, bool(chat.get("tool_calls")))
    answer = {**_envelope(call, content, reason, stop), "usage": usage(completion.get("usage"), outcome)}
    return {**answer, "compaction": outcome_json(outcome)}


def _tool_use(call_id: str | None, function: dict[str, Any]) -> dict[str, Any]:
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except json.JSONDecodeError:
        arguments = {"arguments": function.get("arguments")}
    arguments = arguments if isinstance(arguments, dict) else {"value": arguments}
    return {"type": "tool_use", "id": call_id or f"toolu_{uuid.uuid4().hex[:24]}", "name": function.get("name", ""),
            "input": arguments}  # fmt: skip


class _Stream:
    """The Messages events of one streamed answer: one content block open at a time."""

    def __init__(self) -> None:
        self.index = -1  # the open block's index; -1 before the first
        self.key: str | int | None = None  # "text", or the chat tool call index the open block streams
        self.called = False  # a tool_use block was streamed

    def block(self, key: str | int | None, start: dict[str, Any]) -> Iterator[str]:
        yield from self.close()
        self.index, self.key = self.index + 1, key
        yield event("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": start})

    def delta(self, delta: dict[str, Any]) -> str:
        return event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def close(self) -> Iterator[str]:
        if self.key is not None:
            yield event("content_block_stop", {"type": "content_block_stop", "index": self.index})
        self.key = None


async def stream(
    chunks: AsyncIterable[dict[str, Any]] | None,
    call: ChatCall,
    outcome: TurnCompaction | None,
    forwarded: list[dict[str, Any]],
) -> AsyncIterator[str]:
    """A chat completion stream as Messages events, the compaction block first (`compaction_delta`).
    `chunks` None: paused after the compaction (stop_reason "compaction", no reply)."""
    start = {**_envelope(call, [], None, None), "usage": {"input_tokens": 0, "output_tokens": 0}}
    yield event("message_start", {"type": "message_start", "message": start})
    out = _Stream()
    block = compaction_block(outcome, call, forwarded)
    if block is not None:
        for text in out.block("compaction", block):  # whole: a client may keep only what the start event carried
            yield text
        yield out.delta({"type": "compaction_delta", **{k: block[k] for k in ("content", "encrypted_content")}})
    if chunks is None:
        for text in out.close():
            yield text
        delta = {"stop_reason": "compaction", "stop_sequence": None}
        final = {"delta": delta, "usage": usage(None, outcome, False), "compaction": outcome_json(outcome)}
        yield event("message_delta", {"type": "message_delta", **final})
        yield event("message_stop", {"type": "message_stop"})
        return
    chat_usage, last = None, dict[str, Any]()
    async for chunk in chunks:
        if "error" in chunk:
            error = chunk["error"] if isinstance(chunk["error"], dict) else {"message": str(chunk["error"])}
            yield event(
                "error", {"type": "error", "error": {"type": "api_error", "message": str(error.get("message"))}}
            )
            return
        chat_usage = chunk.get("usage") or chat_usage
        for choice in chunk.get("choices") or []:
            last = choice if choice.get("finish_reason") else last
            for text in _deltas(out, choice.get("delta") or {}):
                yield text
    for text in out.close():
        yield text
    reason, stop = stop_reason(last, call, out.called)
    delta = {"stop_reason": reason, "stop_sequence": stop}
    final = {
        "delta": delta,
        "usage": usage(chat_usage, outcome),
        "compaction": outcome_json(outcome),
        **_edits_report(call),
    }
    yield event("message_delta", {"type": "message_delta", **final})
    yield event("message_stop", {"type": "message_stop"})


def _deltas(out: _Stream, delta: dict[str, Any]) -> Iterator[str]:
    if delta.get("content"):
        if out.key != "text":
            yield from out.block("text", {"type": "text", "text": ""})
        yield out.delta({"type": "text_delta", "text": delta["content"]})
    for call in delta.get("tool_calls") or []:
        index, function = call.get("index", 0), call.get("function") or {}
        out.called = True
        if out.key != index:
            yield from out.block(index, _tool_use(call.get("id"), {"name": function.get("name") or ""}))
        if function.get("arguments"):
            yield out.delta({"type": "input_json_delta", "partial_json": function["arguments"]})
