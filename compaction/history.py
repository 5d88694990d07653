"""The conversation model: OpenAI-style chat messages, validated, and the views a chat template reads.

Rendering them into token ids is stage 1 (`compaction.render`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from compaction.errors import InvalidInput, located

Role = Literal["system", "user", "assistant", "tool"]


class ToolFunction(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)
    name: str = Field(min_length=1, description="Name of the called tool.")
    arguments: str = Field(default="", description="JSON-encoded arguments, as the OpenAI API sends them.")


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)
    id: str = Field(default="", description="Call id, echoed by the tool message that answers it.")
    type: Literal["function"] = "function"
    function: ToolFunction


def _unset(value: object) -> bool:
    return value is None


KEEP_FIELD = (
    "true: never summarised away; a compaction writes this text verbatim in its head (as if it were marked "
    "<keep>…</keep>)."
)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)
    type: Literal["text"] = "text"
    text: str
    keep: StrictBool | None = Field(default=None, description=KEEP_FIELD, exclude_if=_unset)


class Message(BaseModel):
    """One OpenAI-style chat message. Frozen: the core never edits the caller's messages."""

    model_config = ConfigDict(extra="allow", frozen=True)
    role: Role = Field(description="Who speaks: system, user, assistant or tool.")
    content: str | list[TextPart] | None = Field(
        default=None, description="Text, or a list of text parts; null only beside tool_calls."
    )
    # Unset optional fields are left out of the dump (the OpenAI schema refuses `null` for them), so a
    # compacted history goes straight back into /v1/chat/completions.
    name: str | None = Field(default=None, description="Optional speaker name.", exclude_if=_unset)
    tool_calls: list[ToolCall] | None = Field(
        default=None, description="Tool calls of an assistant turn.", exclude_if=_unset
    )
    tool_call_id: str | None = Field(default=None, description="The call a tool message answers.", exclude_if=_unset)
    keep: StrictBool | None = Field(default=None, description=KEEP_FIELD, exclude_if=_unset)

    def text(self) -> str:
        """The message content as one string (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


MAX_MESSAGES = 100_000  # messages one history may hold (a history of the largest window holds far fewer)


def parse_messages(raw: Sequence[Any], field: str = "messages") -> list[Message]:
    """Validate caller data into new Message objects (the caller's objects are never kept or changed)."""
    if not raw:
        raise InvalidInput(field, "the history is empty; send at least one message")
    if len(raw) > MAX_MESSAGES:
        raise InvalidInput(field, f"{len(raw)} messages, over the limit of {MAX_MESSAGES}; send a shorter history")
    out: list[Message] = []
    for i, item in enumerate(raw):
        try:
            message = item if isinstance(item, Message) else Message.model_validate(item)
        except ValidationError as exc:
            loc, why = located(exc.errors())
            at = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc)
            raise InvalidInput(f"{field}[{i}]{at}", why) from exc
        if message.content is None and not message.tool_calls:
            raise InvalidInput(f"{field}[{i}].content", "content is null and there are no tool_calls")
        out.append(message)
    return out


def _tag(kind: str, ident: str | None) -> str:
    return f"[{kind} {ident}]" if ident else f"[{kind}]"


def chat_view(message: Message) -> dict[str, Any]:
    """The message as vLLM's chat endpoint hands it to the model's chat template: text content ("" when there is
    none), tool calls with their arguments parsed (as chat templates expect them), the tool call id kept. A prompt
    rendered from these views is token for token the one a chat completion of the same messages prefills."""
    view: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.tool_calls:
        view["tool_calls"] = [
            {
                **call.model_dump(exclude_none=True),
                "function": {"name": call.function.name, "arguments": _args(call)},
            }
            for call in message.tool_calls
        ]
    for key in ("name", "tool_call_id"):
        if getattr(message, key, None):
            view[key] = getattr(message, key)
    return view


def _args(call: Any) -> Any:
    try:
        return json.loads(call.function.arguments)
    except (TypeError, ValueError):
        return call.function.arguments


def template_view(message: Message) -> dict[str, str]:
    """The message as the plain {role, content} pair every chat template understands.

    Chat templates such as ChatML know only role + string content, so tool traffic gets an
    explicit rendering rule: an assistant's tool calls are appended as `[tool call id] name(args)`
    lines, and a tool result becomes a user turn prefixed `[tool result id]`.
    """
    text = message.text()
    if message.role == "tool":
        return {"role": "user", "content": f"{_tag('tool result', message.tool_call_id)} {text}"}
    if message.tool_calls:
        calls = [f"{_tag('tool call', c.id)} {c.function.name}({c.function.arguments})" for c in message.tool_calls]
        text = "\n".join([text, *calls] if text else calls)
    if message.name and message.role in ("user", "assistant"):
        return {"role": message.role, "content": text, "name": message.name}
    return {"role": message.role, "content": text}
