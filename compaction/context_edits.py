"""Context editing without a model: Anthropic's `clear_tool_uses_20250919` and `clear_thinking_20251015` edits.

Pure, over chat messages (OpenAI-style dicts: assistant `tool_calls`, `tool` results). As Anthropic
documents them:

- `clear_tool_uses_20250919`: once the prompt passes `trigger` (input tokens, default 100,000, or a count
  of tool uses), the results of the oldest tool uses are replaced by a placeholder, all but the newest
  `keep` (default 3), those of `exclude_tools` and results marked to keep (`compaction.keep`); with
  `clear_tool_inputs` the calls' inputs are cleared too. With `clear_at_least`, nothing is cleared unless
  that many input tokens would be.
- `clear_thinking_20251015`: thinking blocks are dropped from the prompt. This service never sends a
  model's thinking back to it, so the edit only reports what it dropped.

Each applied edit is reported as Anthropic's `context_management.applied_edits` entries are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from compaction.errors import InvalidInput
from compaction.keep import holds_marked

CLEAR_TOOL_USES = "clear_tool_uses_20250919"
CLEAR_THINKING = "clear_thinking_20251015"
CLEARED = "[tool result cleared to save context]"
Messages = list[dict[str, Any]]


class Threshold(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    type: Literal["input_tokens", "tool_uses"] = Field(description="What `value` counts.")
    value: int = Field(ge=0, le=100_000_000)


class ClearToolUses(BaseModel):
    """The clear_tool_uses_20250919 edit, as Anthropic's API takes it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    type: Literal["clear_tool_uses_20250919"]
    trigger: Threshold = Field(
        Threshold(type="input_tokens", value=100_000), description="Clear once the prompt passes this."
    )
    keep: Threshold = Field(Threshold(type="tool_uses", value=3), description="The newest tool uses kept whole.")
    clear_at_least: Threshold | None = Field(None, description="Clear only if at least this many tokens go.")
    exclude_tools: list[str] = Field(default_factory=list, max_length=1024, description="Tools never cleared.")
    clear_tool_inputs: bool = Field(False, description="Clear the calls' inputs as well as their results.")


class ClearThinking(BaseModel):
    """The clear_thinking_20251015 edit (thinking is never sent to the model here: it reports the drop)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    type: Literal["clear_thinking_20251015"]
    keep: Any = Field("all", description='"all", or {"type": "thinking_turns", "value": N}: accepted as sent.')


Edit = ClearToolUses | ClearThinking


def parse_edit(raw: dict[str, Any], at: str) -> Edit:
    """One edit, validated; InvalidInput names the field."""
    model: type[BaseModel] = ClearToolUses if raw.get("type") == CLEAR_TOOL_USES else ClearThinking
    try:
        return model.model_validate(raw)  # type: ignore[return-value]
    except ValidationError as exc:
        first = exc.errors()[0]
        raise InvalidInput(f"{at}.{'.'.join(str(p) for p in first['loc'])}".rstrip("."), first["msg"]) from exc


def _uses(messages: Sequence[dict[str, Any]]) -> list[tuple[int, int, str, str]]:
    """(message, call, call id, tool name) of every tool call, oldest first."""
    return [
        (i, j, str(call.get("id") or ""), str((call.get("function") or {}).get("name") or ""))
        for i, message in enumerate(messages)
        if message.get("role") == "assistant"
        for j, call in enumerate(message.get("tool_calls") or [])
    ]


def clear_tool_uses(
    messages: Messages, edit: ClearToolUses, count: Callable[[Messages], int]
) -> tuple[Messages, dict[str, Any] | None]:
    """The messages with the oldest tool results cleared (new dicts; the input is not changed), and the applied
    edit's report (None when nothing was cleared). `count(messages)`: the prompt's input tokens."""
    uses = _uses(messages)
    before = count(messages)
    reached = len(uses) if edit.trigger.type == "tool_uses" else before
    if reached <= edit.trigger.value:
        return messages, None
    results = {str(m.get("tool_call_id")): i for i, m in enumerate(messages) if m.get("role") == "tool"}
    keep = edit.keep.value if edit.keep.type == "tool_uses" else 0
    doomed = [u for u in uses[: max(0, len(uses) - keep)] if u[3] not in edit.exclude_tools]
    out = [dict(m) for m in messages]
    cleared = 0
    for i, j, call_id, _ in doomed:
        at = results.get(call_id)
        if at is not None and out[at].get("content") != CLEARED and not holds_marked(out[at]):
            out[at]["content"] = CLEARED
            cleared += 1
        if edit.clear_tool_inputs:
            calls = [dict(c) for c in out[i]["tool_calls"]]
            calls[j] = {**calls[j], "function": {**calls[j].get("function", {}), "arguments": "{}"}}
            out[i]["tool_calls"] = calls
    if not cleared:
        return messages, None
    saved = before - count(out)
    if edit.clear_at_least is not None and saved < edit.clear_at_least.value:
        return messages, None
    return out, {"type": CLEAR_TOOL_USES, "cleared_tool_uses": cleared, "cleared_input_tokens": max(0, saved)}


def apply_edits(
    messages: Messages,
    edits: Sequence[Edit],
    count: Callable[[Messages], int],
    thinking: tuple[int, int] = (0, 0),
) -> tuple[Messages, list[dict[str, Any]]]:
    """Every edit in order; the messages they leave and the applied edits' reports. `thinking`: the assistant
    turns whose thinking blocks the request carried (dropped already) and those blocks' tokens."""
    applied: list[dict[str, Any]] = []
    for edit in edits:
        if isinstance(edit, ClearToolUses):
            messages, report = clear_tool_uses(messages, edit, count)
            if report is not None:
                applied.append(report)
        elif thinking[0]:
            turns, tokens = thinking
            applied.append({"type": CLEAR_THINKING, "cleared_thinking_turns": turns, "cleared_input_tokens": tokens})
    return messages, applied
