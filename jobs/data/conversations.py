"""Turning benchmark data into agent histories (OpenAI-style messages) of a chosen size."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from compaction.checks.validity import turn_start
from compaction.errors import InvalidInput
from compaction.history import parse_messages
from compaction.render import render_history
from compaction.tokenizer import ChatTokenizer

# The shared data folder beside the checkout (`../shared/data`), or $COMPACTION_DATA.
SHARED_DATA = Path(os.environ.get("COMPACTION_DATA") or Path(__file__).resolve().parents[3] / "shared" / "data")
LOCOMO_PATH = SHARED_DATA / "locomo10.json"


def locomo_session_numbers(conversation: dict[str, Any]) -> list[int]:
    """Session numbers present in a LoCoMo conversation, in order."""
    numbers = [int(k.split("_")[1]) for k in conversation if k.startswith("session_") and k.count("_") == 1]
    return sorted(n for n in numbers if conversation.get(f"session_{n}"))


def locomo_turn_text(turn: dict[str, Any]) -> str:
    text = f"{turn['speaker']}: {turn['text']}"
    if turn.get("blip_caption"):
        text += f" [shares a photo: {turn['blip_caption']}]"
    return text


def locomo_session_messages(conversation: dict[str, Any], number: int) -> list[dict[str, str]]:
    """One LoCoMo session as chat messages: speaker A is the user, speaker B the assistant."""
    speaker_a = conversation["speaker_a"]
    header = f"[Session {number}, {conversation.get(f'session_{number}_date_time', 'date unknown')}]\n"
    messages = []
    for i, turn in enumerate(conversation[f"session_{number}"]):
        role = "user" if turn["speaker"] == speaker_a else "assistant"
        messages.append({"role": role, "content": (header if i == 0 else "") + locomo_turn_text(turn)})
    return messages


def locomo_messages(sample: dict[str, Any]) -> list[dict[str, str]]:
    """A whole LoCoMo conversation as one chat history."""
    conversation = sample["conversation"]
    out: list[dict[str, str]] = []
    for number in locomo_session_numbers(conversation):
        out += locomo_session_messages(conversation, number)
    return out


def load_conversation(path: str | Path, sample_id: str | None = None) -> list[dict[str, Any]]:
    """A history from a file: LoCoMo JSON (first sample, or `sample_id`), or a JSON list of messages."""
    file = Path(path)
    if not file.exists():
        raise InvalidInput("conversation", f"{file} does not exist; point CONVERSATION= at a JSON file")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidInput("conversation", f"{file} is not valid UTF-8 JSON: {exc}") from exc
    if isinstance(data, list) and data and isinstance(data[0], dict) and "conversation" in data[0]:
        samples = {s.get("sample_id"): s for s in data}
        if sample_id is not None and sample_id not in samples:
            raise InvalidInput("sample_id", f"{sample_id!r} not in {file}; it has {sorted(map(str, samples))}")
        return locomo_messages(samples[sample_id] if sample_id else data[0])
    if isinstance(data, dict) and "messages" in data:
        data = data["messages"]
    if isinstance(data, list) and all(isinstance(m, dict) and "role" in m for m in data):
        return [dict(m) for m in data]
    raise InvalidInput("conversation", f"{file} is neither LoCoMo JSON nor a list of chat messages")


def truncate_history(messages: list[dict[str, Any]], tokenizer: ChatTokenizer, max_tokens: int) -> list[dict[str, Any]]:
    """The longest prefix of whole turns (a tool-calling turn with all its results) within `max_tokens`."""
    rendered = render_history(parse_messages(messages), tokenizer)
    ends = (*rendered.message_starts[1:], len(rendered.token_ids))
    keep = turn_start(rendered.messages, sum(1 for end in ends if end <= max_tokens), 0)
    if keep == 0:
        raise InvalidInput("history_tokens", f"{max_tokens} is shorter than the first message")
    return messages[:keep]
