"""The Anthropic Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) over the chat path.

Request -> chat body:
    system (a string or text blocks)     -> a leading system message (not carried by a compaction block)
    messages: user, assistant and (mid-conversation) system messages; text blocks -> message text;
      image, document and search_result blocks -> a one-line placeholder (this model reads text);
      tool_use -> assistant tool_calls; tool_result -> tool messages (before the user's text); thinking
      blocks and the blocks of Anthropic's server tools are dropped; compaction: everything before the
      last one is ignored, and it expands in place to the messages it carries (see below)
    tools: custom tools (input_schema -> parameters); Anthropic's server and built-in tools are left out;
      tool_choice, max_tokens, stop_sequences -> stop, temperature, top_p, top_k, stream
    output_config.format (json_schema) -> response_format (the engine's grammar follows the schema);
      output_config.effort, thinking, cache_control, service_tier: accepted, not acted on
    context_management.edits: [{"type": "compact_20260112", "trigger": {"type": "input_tokens", "value": N},
      "pause_after_compaction": bool, "instructions": str, ...our options}] -> our compaction entry with
      compact_threshold N (no 50,000-token minimum); `instructions` are appended to our summary prompt;
      clear_tool_uses_20250919 and clear_thinking_20251015 are applied as Anthropic documents them
      (compaction.context_edits) and reported in `context_management.applied_edits`
    session: the x-session-id header, else metadata.user_id (its session_id when it is Claude Code's JSON)
Chat answer -> Message: a compaction block first when one was applied (`content`: the readable summary,
`encrypted_content`: the codec's encoding of everything it replaces; both already in content_block_start,
which is all Claude Code keeps of a streamed block), then text and tool_use blocks; `usage.iterations`
holds the compaction's own entry and the message's. With pause_after_compaction an applied compaction is
answered alone (`stop_reason: "compaction"`); the client sends the block back to get the reply. A block
without `encrypted_content` (another server's) is read as a summary message; a block holding nothing is
refused, naming it.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from compaction.context_edits import CLEAR_THINKING, CLEAR_TOOL_USES, Edit, parse_edit
from compaction.errors import InvalidInput
from compaction.keep import keep_field, keep_flag, wrapped
from compaction.plan import SUMMARY_HEADER
from serving.wire.codec import ChatCall, decode, dumps, session_of

EDIT_TYPE = "compact_20260112"
OTHER_EDITS = frozenset({CLEAR_TOOL_USES, CLEAR_THINKING})
PLACEHOLDER_BLOCKS = {"image": "[an image]", "document": "[a document]", "search_result": "[a search result]"}
# Blocks of Anthropic's server tools: work done on Anthropic's side, nothing this model can be shown.
SERVER_BLOCKS = frozenset({
    "server_tool_use", "web_search_tool_result", "web_fetch_tool_result", "code_execution_tool_result",
    "bash_code_execution_tool_result", "text_editor_code_execution_tool_result", "mcp_tool_use", "mcp_tool_result",
    "container_upload", "tool_search_tool_result",
})  # fmt: skip
Unused = Any  # a field clients send that changes nothing here; accepted so that unmodified clients work


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    input_schema: dict[str, Any] = Field(description="JSON schema of the tool's input.")
    type: Literal["custom"] | None = Field(None, description="Only custom (client) tools are served.")
    cache_control: Unused = None
    strict: Unused = None


class CountTokensRequest(BaseModel):
    """`POST /v1/messages/count_tokens`."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1, max_length=256, description="A hosted model (GET /v1/models).")
    messages: list[Any] = Field(min_length=1, description="User and assistant messages (see docs/wire-formats.md).")
    system: str | list[Any] | None = None
    tools: list[dict[str, Any]] | None = Field(
        None, max_length=1024, description="Custom tools; Anthropic's server and built-in tools are left out."
    )
    tool_choice: dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None
    thinking: Unused = Field(None, description="Accepted, not acted on: this service's models do not think.")
    output_config: dict[str, Any] | None = Field(
        None, description="format (json_schema) is served as a grammar; effort is accepted, not acted on."
    )
    cache_control: Unused = None
    mcp_servers: Unused = Field(None, description="Accepted, not acted on: connect MCP servers in the client.")


class MessagesRequest(CountTokensRequest):
    """`POST /v1/messages`: what is served; unknown fields are refused, a few no-ops are accepted."""

    max_tokens: int = Field(ge=1, le=1_048_576)
    stop_sequences: list[str] | None = Field(None, max_length=16)
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)
    stream: bool = False
    metadata: dict[str, Any] | None = Field(None, description="metadata.user_id: the session id without x-session-id.")
    service_tier: Unused = None


def to_chat(request: CountTokensRequest, header_session: str | None) -> ChatCall:
    """The chat completion body of a Messages (or count_tokens) request. Raises InvalidInput naming the field."""
    system = _system(request.system)
    messages, thinking = chat_messages(request.messages)
    body: dict[str, Any] = {"model": request.model, "messages": system + messages}
    tools = _tools(request.tools or [])
    if tools:
        body["tools"] = [{"type": "function", "function": _function(t)} for t in tools]
    if request.tool_choice is not None:
        choice = _tool_choice(request.tool_choice)
        if tools:  # no custom tool offered (server tools only): nothing to choose
            body["tool_choice"] = choice
    schema = _output_schema(request.output_config)
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    entry, pause, at, edits = _edits(request.context_management)
    if entry is not None:
        body["context_management"] = [entry]
    fields = {"context_management[0].compact_threshold": f"{at}.trigger.value", "context_management[0]": at}
    if not isinstance(request, MessagesRequest):
        return ChatCall(body, system=bool(system), fields=fields, edits=edits, thinking=thinking, wire="messages")
    options = {
        "max_tokens": request.max_tokens,
        "stop": request.stop_sequences,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "stream": request.stream or None,
        "stream_options": {"include_usage": True} if request.stream else None,
    }
    body.update({k: v for k, v in options.items() if v is not None})
    session, field = session_of(
        header_session, _user_session((request.metadata or {}).get("user_id")), "metadata.user_id"
    )
    echo = {"model": request.model, "stop_sequences": request.stop_sequences or []}
    return ChatCall(
        body, session, field, bool(system), echo, pause, fields, edits=edits, thinking=thinking, wire="messages"
    )


def _user_session(user_id: Any) -> Any:
    """metadata.user_id as a session id: Claude Code's JSON ({"device_id", "session_id", ...}) gives its
    session_id; any other value is the id itself."""
    if isinstance(user_id, str) and user_id.startswith("{"):
        try:
            parsed = json.loads(user_id)
        except json.JSONDecodeError:
            return user_id
        if isinstance(parsed, dict) and isinstance(parsed.get("session_id"), str) and parsed["session_id"]:
            return parsed["session_id"]
    return user_id


def _tools(raw: list[dict[str, Any]]) -> list[Tool]:
    """The custom tools (no type, or "custom"); Anthropic's typed server and built-in tools are left out."""
    out = []
    for i, tool in enumerate(raw):
        if tool.get("type") not in (None, "custom"):
            continue
        try:
            out.append(Tool.model_validate(tool))
        except ValidationError as exc:
            first = exc.errors()[0]
            raise InvalidInput(f"tools[{i}].{'.'.join(map(str, first['loc']))}".rstrip("."), first["msg"]) from exc
    return out


def _output_schema(config: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise InvalidInput("output_config.format", 'send {"type": "json_schema", "schema": {...}}')
    return dict(fmt["schema"])


def _system(system: str | list[Any] | None) -> list[dict[str, Any]]:
    if system is None or system == "":
        return []
    text = system if isinstance(system, str) else "\n".join(_texts(system, "system"))
    return [{"role": "system", "content": text}]


def _texts(blocks: list[Any], at: str, placeholders: dict[str, str] | None = None) -> list[str]:
    """The text of text blocks (and `placeholders` for the other kinds they name)."""
    out = []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if placeholders and kind in placeholders:
            out.append(placeholders[kind])
        elif kind != "text" or not isinstance(block.get("text"), str):
            raise InvalidInput(f"{at}[{j}]", "only text blocks are served here")
        else:
            out.append(wrapped(block["text"]) if keep_flag(block, f"{at}[{j}]") else block["text"])
    return out


def _edits(config: dict[str, Any] | None) -> tuple[dict[str, Any] | None, bool, str, tuple[Edit, ...]]:
    """Our compaction entry from the compact edit, whether to pause after it, the edit's field, and the other
    edits (applied by the ingress, compaction.context_edits)."""
    edits = (config or {}).get("edits", [])
    if config and set(config) - {"edits"}:
        raise InvalidInput("context_management", "only edits are served")
    if not isinstance(edits, list):
        raise InvalidInput("context_management.edits", "must be a list of edits")
    found: tuple[dict[str, Any] | None, bool, str] = (None, False, "context_management.edits[0]")
    others: list[Edit] = []
    for i, edit in enumerate(edits):
        at = f"context_management.edits[{i}]"
        kind = edit.get("type") if isinstance(edit, dict) else None
        if kind in OTHER_EDITS:
            assert isinstance(edit, dict)
            others.append(parse_edit(edit, at))
            continue
        if kind != EDIT_TYPE:
            served = ", ".join(sorted({EDIT_TYPE, *OTHER_EDITS}))
            raise InvalidInput(f"{at}.type", f"unsupported edit {kind!r}; the ones served are {served}")
        if found[0] is not None:
            raise InvalidInput(at, "only one compaction edit is allowed")
        assert isinstance(edit, dict)
        trigger = edit.get("trigger") or {"type": "input_tokens", "value": None}
        if not isinstance(trigger, dict) or trigger.get("type") != "input_tokens" or "value" not in trigger:
            raise InvalidInput(f"{at}.trigger", 'send {"type": "input_tokens", "value": N}')
        if trigger["value"] is None:
            raise InvalidInput(f"{at}.trigger.value", "send the token count to compact at (no 150,000 default here)")
        pause = edit.get("pause_after_compaction", False)
        if not isinstance(pause, bool):
            raise InvalidInput(f"{at}.pause_after_compaction", "must be true or false")
        ours = {k: v for k, v in edit.items() if k not in ("type", "trigger", "pause_after_compaction")}
        found = ({**ours, "type": "compaction", "compact_threshold": trigger["value"]}, pause, at)
    return (*found, tuple(others))


def _last_compaction(messages: list[Any]) -> tuple[int, int]:
    """(message, block) of the last compaction block; (0, 0) when there is none."""
    last = (0, 0)
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        for j, block in enumerate(content if isinstance(content, list) else []):
            if isinstance(block, dict) and block.get("type") == "compaction":
                last = (i, j)
    return last


def chat_messages(messages: list[Any]) -> tuple[list[dict[str, Any]], tuple[int, str]]:
    """Chat messages of `messages` (everything before the last compaction block is ignored), and the thinking
    the request carried: (assistant turns with thinking blocks, their text) - dropped here."""
    first, first_block = _last_compaction(messages)
    out: list[dict[str, Any]] = []
    turns, thoughts = 0, []
    for i in range(first, len(messages)):
        message, at = messages[i], f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant", "system"):
            raise InvalidInput(f"{at}.role", "each message is an object with role user, assistant or system")
        content, kept = message.get("content"), keep_field(message, at)
        if isinstance(content, str):
            out.append({"role": message["role"], "content": content, **kept})
            continue
        if not isinstance(content, list):
            raise InvalidInput(f"{at}.content", "must be a string or a list of content blocks")
        start = first_block if i == first else 0
        blocks = list(enumerate(content))[start:]
        thought = [b.get("thinking") for _, b in blocks if isinstance(b, dict) and b.get("type") == "thinking"]
        turns += bool(thought)
        thoughts += [t for t in thought if isinstance(t, str)]
        out = _turn(out, message["role"], blocks, f"{at}.content", kept)
    return out, (turns, "\n".join(thoughts))


def _turn(
    out: list[dict[str, Any]], role: str, blocks: list[tuple[int, Any]], at: str, kept: dict[str, bool]
) -> list[dict[str, Any]]:
    """One message's blocks appended to `out` (a compaction block replaces all of `out`); `kept`: the message's
    own `{"keep": True}`, given to each message it becomes."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in blocks:
        where = f"{at}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "compaction":
            out = _expand(block, where)
        elif kind == "text" and isinstance(block.get("text"), str):
            texts.append(wrapped(block["text"]) if keep_flag(block, where) else block["text"])
        elif kind in PLACEHOLDER_BLOCKS:
            texts.append(PLACEHOLDER_BLOCKS[kind])
        elif kind == "tool_use" and role == "assistant":
            calls.append(_call(block, where))
        elif kind == "tool_result" and role == "user":
            results.append({**_result(block, where), **kept, **keep_field(block, where)})
        elif kind not in ("thinking", "redacted_thinking") and kind not in SERVER_BLOCKS:
            raise InvalidInput(
                f"{where}.type",
                f"unsupported block {kind!r} in a {role} message; send text, image, document, tool_use (assistant), "
                "tool_result (user) or compaction blocks",
            )
    out.extend(results)
    if role == "assistant" and (texts or calls):
        calling = {"tool_calls": calls} if calls else {}
        out.append({"role": "assistant", "content": "\n".join(texts) or None, **calling, **kept})
    elif texts:
        out.append({"role": role, "content": "\n".join(texts), **kept})
    return out


def _expand(block: dict[str, Any], at: str) -> list[dict[str, Any]]:
    """The messages a compaction block stands for: its encoding, or (another server's block) its summary."""
    if block.get("encrypted_content") is not None:
        return dumps(decode(block["encrypted_content"], f"{at}.encrypted_content"))
    summary = block.get("content")
    if not isinstance(summary, str) or not summary.strip():
        raise InvalidInput(
            f"{at}.content",
            "this compaction block holds nothing (no encrypted_content, no summary text); send the block back as "
            "the service sent it (its content_block_start carries both), or drop it and send the messages it replaced",
        )
    if summary.startswith(SUMMARY_HEADER):  # ours: its turns (the request it answered among them) are in the encoding
        raise InvalidInput(
            f"{at}.encrypted_content",
            "this compaction block came from this service without its encrypted_content, which holds the turns it "
            "kept; send the block back as the service sent it, or drop it and send the messages it replaced",
        )
    return [{"role": "user", "content": f"{SUMMARY_HEADER}\n{summary}"}]


def _call(block: dict[str, Any], at: str) -> dict[str, Any]:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        raise InvalidInput(at, "a tool_use block has a string id and name")
    arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
    return {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": arguments}}


def _result(block: dict[str, Any], at: str) -> dict[str, Any]:
    if not isinstance(block.get("tool_use_id"), str):
        raise InvalidInput(f"{at}.tool_use_id", "must be a string: the id of the tool_use it answers")
    content = block.get("content", "")
    text = content if isinstance(content, str) else "\n".join(_texts(content, f"{at}.content", PLACEHOLDER_BLOCKS))
    if block.get("is_error"):
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": text}


def _function(tool: Tool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    if tool.strict is not None:  # strict: the engine constrains a forced call's input to the schema
        function["strict"] = bool(tool.strict)
    return function


def _tool_choice(choice: dict[str, Any]) -> str | dict[str, Any]:
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return str(kind)
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidInput("tool_choice.type", 'use {"type": "auto"}, {"type": "any"}, {"type": "none"} or a named tool')
