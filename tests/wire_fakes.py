"""The chat path with fakes for the wire-format tests: real tokenizer, coordinator and sessions, fake replicas."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from compaction.tokenizer import HFChatTokenizer
from serving.background import SessionCompactions
from serving.turns import PromptCounter, TurnCompaction, Wire, prepare_turn
from serving.wire.codec import ChatCall
from tests.test_coordinator import FakeReplicas, coordinator

WINDOW = 8192


class ChatPath:
    """prepare_turn with the coordinator's real turn logic (fake replicas), as the ingress runs it."""

    def __init__(self, tokenizer: HFChatTokenizer) -> None:
        self.tokenizer = tokenizer
        self.counter = PromptCounter(tokenizer, tokenizer.special_tokens)
        self.sessions = SessionCompactions(coordinator(tokenizer, FakeReplicas()).compact)

    async def ask(self, turn: Any) -> TurnCompaction:
        return await self.sessions.turn(turn, self.tokenizer)

    async def prepare(self, call: ChatCall, wire: Wire) -> tuple[dict[str, Any], TurnCompaction | None]:
        return await prepare_turn(call.body, call.session, self.counter, WINDOW, self.ask, wire)


def completion(
    text: str | None = "Done.", tool_calls: list[dict[str, Any]] | None = None, finish: str = "stop"
) -> dict:
    """A chat completion as ray.serve.llm returns it."""
    message = {"role": "assistant", "content": text, "tool_calls": tool_calls or []}
    usage = {
        "prompt_tokens": 120,
        "completion_tokens": 3,
        "total_tokens": 123,
        "prompt_tokens_details": {"cached_tokens": 96},
    }
    choice = {"index": 0, "message": message, "finish_reason": finish, "stop_reason": None}
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "tiny",
        "choices": [choice],
        "usage": usage,
    }


async def chat_stream(texts: list[str], tool: dict[str, Any] | None = None, finish: str = "stop") -> AsyncIterator[str]:
    """A chat completion stream as ray.serve.llm sends it: SSE text, split anywhere, usage last."""

    def data(delta: dict[str, Any], reason: str | None = None) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": reason}
        return (
            "data: " + json.dumps({"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [choice]}) + "\n\n"
        )

    events = [data({"role": "assistant", "content": ""})] + [data({"content": t}) for t in texts]
    if tool is not None:
        head = {"index": 0, "id": "call_9", "type": "function", "function": {"name": tool["name"], "arguments": ""}}
        events += [
            data({"tool_calls": [head]}),
            data({"tool_calls": [{"index": 0, "function": {"arguments": tool["arguments"]}}]}),
        ]
    events.append(data({}, finish))
    usage = {"prompt_tokens": 120, "completion_tokens": len(texts), "total_tokens": 120 + len(texts)}
    events.append("data: " + json.dumps({"id": "chatcmpl-1", "choices": [], "usage": usage}) + "\n\n")
    text = "".join(events) + "data: [DONE]\n\n"
    for i in range(0, len(text), 97):  # packets that cut events anywhere
        yield text[i : i + 97]
