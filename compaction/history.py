"""The conversation model and its one-time rendering into token ids.

A history is a list of OpenAI-style chat messages. It is rendered ONCE with the model's chat
template and tokenised once; every later stage (partition, layouts) works on those token ids,
so chunk borders never re-tokenise and prompts share exact token prefixes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from compaction.content import Span, content_spans, encode_rendering
from compaction.errors import InvalidInput

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


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)
    type: Literal["text"] = "text"
    text: str


def _unset(value: object) -> bool:
    return value is None


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

    def text(self) -> str:
        """The message content as one string (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


def parse_messages(raw: Sequence[Any], field: str = "messages") -> list[Message]:
    """Validate caller data into new Message objects (the caller's objects are never kept or changed)."""
    if not raw:
        raise InvalidInput(field, "the history is empty; send at least one message")
    out: list[Message] = []
    for i, item in enumerate(raw):
        try:
            message = item if isinstance(item, Message) else Message.model_validate(item)
        except ValidationError as exc:
            first = exc.errors()[0]
            loc = ".".join(str(p) for p in first["loc"])
            raise InvalidInput(f"{field}[{i}].{loc}".rstrip("."), first["msg"]) from exc
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


class ChatTokenizer(Protocol):
    """What the core needs from a model's tokenizer and chat template."""

    def render(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = False) -> str:
        """The chat template applied to the messages (by default without a generation prompt)."""
        ...

    def encode_with_offsets(self, text: str, as_text: bool = False) -> tuple[list[int], list[int]]:
        """Token ids of `text` (no special tokens added) and each token's start character.

        `as_text`: control tokens spelled in `text` are tokenised as plain text, not parsed.
        """
        ...

    @property
    def control_token_ids(self) -> frozenset[int]:
        """Ids the tokenizer parses out of text by their spelling (the template's markers among them)."""
        ...

    def preamble(self, first_role: str) -> str:
        """Text the template writes before the first message's own turn when it has this role."""
        ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def user_turn(self, content: str) -> str:
        """Text that appends a user turn holding `content`, then the assistant generation prompt."""
        ...

    @property
    def end_of_turn(self) -> str:
        """Text the template writes after a message's content to close its turn."""
        ...


@dataclass(frozen=True)
class RenderedHistory:
    """A history rendered once: the token ids and where each message starts among them."""

    messages: tuple[Message, ...]  # validated copies; the source of the verbatim parts of the output
    token_ids: tuple[int, ...]  # the whole history through the chat template, no generation prompt
    message_starts: tuple[int, ...]  # token where message i's turn begins (the template's preamble precedes 0)


def _prefix_end(views: Sequence[dict[str, str]], i: int, text: str, tokenizer: ChatTokenizer) -> int:
    """Characters of `text` before message i's turn: the exact, O(i) way."""
    prefix = tokenizer.render(views[:i]) if i else tokenizer.preamble(views[0]["role"])
    if not text.startswith(prefix):
        raise InvalidInput(
            "messages",
            "the model's chat template does not render a history as a prefix of its continuation; "
            "this model cannot be compacted in token space",
        )
    return len(prefix)


def _located_starts(
    views: Sequence[dict[str, str]], text: str, spans: Sequence[Span], tokenizer: ChatTokenizer
) -> list[int] | None:
    """Each message's first character: the preamble's end, then the turn end after each content.

    Linear in the history, where rendering every prefix is quadratic (a 250k-token history took
    48 s). None when the template does not close every turn right after its content.
    """
    starts = [len(tokenizer.preamble(views[0]["role"]))]
    end_of_turn = tokenizer.end_of_turn
    for _, end in spans[:-1]:
        if not text.startswith(end_of_turn, end):
            return None
        starts.append(end + len(end_of_turn))
    return starts


def render_history(messages: Sequence[Message], tokenizer: ChatTokenizer) -> RenderedHistory:
    """Render and tokenise the history once, recording each message's first token.

    Message text is tokenised as text (`compaction.content`). Tokens before the first message's
    turn (a default system prompt the template inserts) belong to no message. Message borders are
    located in the rendered text and spot-checked against an exact prefix rendering; if the check
    fails, every border is computed the exact way.
    """
    views = [template_view(m) for m in messages]
    text = tokenizer.render(views)
    spans = content_spans(views, text, tokenizer)
    ids, offsets = encode_rendering(text, spans, tokenizer)
    chars = _located_starts(views, text, spans, tokenizer)
    checks = {len(views) // 2, len(views) - 1}
    if chars is None or any(chars[i] != _prefix_end(views, i, text, tokenizer) for i in checks):
        chars = [_prefix_end(views, i, text, tokenizer) for i in range(len(views))]
    message_starts, token = [], 0
    for char in chars:
        while token < len(offsets) and offsets[token] < char:
            token += 1
        message_starts.append(token)
    return RenderedHistory(tuple(messages), tuple(ids), tuple(message_starts))
