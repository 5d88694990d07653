"""Server-sent events: reading the chat completion stream ray.serve.llm sends, writing a format's events."""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any


async def chat_chunks(packets: AsyncIterable[Any]) -> AsyncIterator[dict[str, Any]]:
    """The chat completion chunks of a stream of `data: {...}` events (text or bytes, split anywhere)."""
    pending = ""
    async for packet in packets:
        pending += bytes(packet).decode() if isinstance(packet, bytes | bytearray | memoryview) else str(packet)
        *complete, pending = pending.split("\n\n")
        for event in complete:
            chunk = _data(event)
            if chunk is not None:
                yield chunk
    chunk = _data(pending)
    if chunk is not None:
        yield chunk


def _data(event: str) -> dict[str, Any] | None:
    lines = [line[5:].strip() for line in event.splitlines() if line.startswith("data:")]
    if not lines or lines[-1] == "[DONE]":
        return None
    payload = json.loads("".join(lines))
    return payload if isinstance(payload, dict) else None


def event(name: str, data: dict[str, Any]) -> str:
    """One named event, as both the Responses and the Messages APIs frame them."""
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"
