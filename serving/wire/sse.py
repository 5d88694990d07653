"""Server-sent events: reading the chat completion stream ray.serve.llm sends, writing a format's events."""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any


async def chat_chunks(packets: AsyncIterable[Any]) -> AsyncIterator[dict[str, Any]]:
    """The chat completion chunks of a stream of `data: {...}` events (text or bytes, split anywhere)."""
    events = Events()
    async for packet in packets:
        for chunk in events.feed(packet):
            yield chunk
    for chunk in events.end():
        yield chunk


class Events:
    """The chat completion chunks of `data: {...}` events, fed the packets they arrive in (split anywhere)."""

    def __init__(self) -> None:
        self.pending = ""

    def feed(self, packet: Any) -> list[dict[str, Any]]:
        self.pending += bytes(packet).decode() if isinstance(packet, bytes | bytearray | memoryview) else str(packet)
        *complete, self.pending = self.pending.split("\n\n")
        return [chunk for event in complete if (chunk := _data(event)) is not None]

    def end(self) -> list[dict[str, Any]]:
        chunk, self.pending = _data(self.pending), ""
        return [chunk] if chunk is not None else []


def _data(event: str) -> dict[str, Any] | None:
    lines = [line[5:].strip() for line in event.splitlines() if line.startswith("data:")]
    if not lines or lines[-1] == "[DONE]":
        return None
    try:
        payload = json.loads("".join(lines))
    except ValueError:  # not a chunk (a comment, a keep-alive): nothing to read
        return None
    return payload if isinstance(payload, dict) else None


def event(name: str, data: dict[str, Any]) -> str:
    """One named event, as both the Responses and the Messages APIs frame them."""
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"
