"""The OpenAI Responses API (`POST /v1/responses`, `POST /v1/responses/compact`) over the chat path.

Request -> chat body:
    instructions                         -> a leading system message (not carried by a compaction item)
    input: str                           -> one user message
    input items: message (text parts; an image or file part becomes a one-line placeholder; developer ->
      system; extra keys such as id, status or a client's metadata are ignored), function_call (merged
      into the assistant message before it; a namespaced call keeps its plain name), function_call_output
      (-> tool message; text parts joined), custom_tool_call / local_shell_call and their outputs (as
      function calls), reasoning and hosted tools' call items (ignored), compaction (everything before the
      last one is ignored; it expands in place to its messages), compaction_trigger (only last: compact
      now, answered by exactly one compaction item, as Codex's remote compaction expects)
    tools: function tools, and the function tools of a `namespace` tool flattened (a call comes back with
      its namespace); hosted tools (web_search, file_search, ...) are left out: the model cannot run them
    tool_choice, max_output_tokens -> max_tokens, temperature, top_p, stream
    context_management: [{"type": "compaction", "compact_threshold": N, ...our options}] -> the same entry
    session: the x-session-id header, else prompt_cache_key
    accepted and not acted on: store, include, reasoning, metadata, client_metadata, parallel_tool_calls,
      truncation, user, safety_identifier, service_tier, prompt_cache_retention, stream_options,
      top_logprobs, max_tool_calls (docs/wire-formats.md lists each)
Chat answer -> Response: [compaction item when one was applied, message, function_call...], usage, status;
streamed as response.created ... response.completed (the compaction item first).
Responses are not stored: `previous_response_id`, `conversation` and `background` are refused (send the
input items instead).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from compaction.errors import InvalidInput
from compaction.keep import keep_field, keep_flag, wrapped
from compaction.options import CompactionOptions
from serving.wire.codec import ChatCall, decode, dumps, session_of

TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
PLACEHOLDER_PARTS = {"input_image": "[an image]", "input_file": "[a file]", "input_audio": "[audio]"}
# Hosted tools run on OpenAI's servers; here the model cannot call them, so they are left out of the prompt.
HOSTED_TOOLS = frozenset({
    "web_search", "web_search_preview", "web_search_preview_2025_03_11", "file_search", "code_interpreter",
    "computer_use_preview", "computer_use", "image_generation", "mcp", "local_shell", "custom", "apply_patch",
})  # fmt: skip
# Input items of hosted tools' calls: a record of work done elsewhere, nothing the model can be shown as a turn.
HOSTED_ITEMS = frozenset({
    "web_search_call", "file_search_call", "image_generation_call", "code_interpreter_call", "computer_call",
    "computer_call_output", "mcp_call", "mcp_list_tools", "mcp_approval_request", "mcp_approval_response",
})  # fmt: skip
TRIGGER = "compaction_trigger"
Unused = Any  # a field clients send that changes nothing here; accepted so that unmodified clients work


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = Field(description="Only function tools are served.")
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="JSON schema of the arguments.")
    strict: bool | None = None


class ResponsesRequest(BaseModel):
    """`POST /v1/responses`: what is served; unknown fields are refused, a few no-ops are accepted."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1, max_length=256, description="A hosted model (GET /v1/models).")
    input: str | list[Any] = Field(description="A user message, or input items (see docs/wire-formats.md).")
    instructions: str | None = Field(None, description="A system message before the input, sent on every request.")
    tools: list[dict[str, Any]] | None = Field(
        None, max_length=1024, description="Function tools, namespaces of them; hosted tools are left out."
    )
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=1_048_576)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    context_management: list[Any] | None = Field(
        None, description='[{"type": "compaction", "compact_threshold": N, ...compaction options}]'
    )
    previous_response_id: str | None = Field(None, description="Refused: responses are not stored.")
    prompt_cache_key: str | None = Field(None, description="The session id when no x-session-id header is sent.")
    text: dict[str, Any] | None = Field(
        None, description="format: text, json_object, or json_schema (the engine's grammar follows the schema)."
    )
    store: Unused = None
    metadata: Unused = None
    include: Unused = None
    parallel_tool_calls: Unused = None
    truncation: Unused = None
    user: Unused = None
    safety_identifier: Unused = None
    service_tier: Unused = None
    reasoning: Unused = None
    prompt_cache_retention: Unused = None
    stream_options: Unused = None
    client_metadata: Unused = None
    top_logprobs: Unused = None
    max_tool_calls: Unused = None
    background: bool | None = Field(None, description="Refused when true: responses are not stored.")
    conversation: Unused = Field(None, description="Refused: conversations are not stored.")
    prompt: Unused = Field(None, description="Refused: stored prompt templates are not served.")


class CompactResponsesRequest(CompactionOptions):
    """`POST /v1/responses/compact`: OpenAI's fields plus every /v1/compact option."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    model: str = Field(min_length=1, max_length=256, description="A hosted model (GET /v1/models).")
    input: str | list[Any] = Field(description="The conversation to compact, as input items.")
    instructions: str | None = Field(None, description="The system message the conversation runs under.")
    prompt_cache_key: str | None = Field(None, description="The session id when no x-session-id header is sent.")
    keep_current_turn: bool = Field(True, description="The last user message and everything after it stay verbatim.")


INPUT = {"messages": "input"}  # the chat messages come from `input` (an index into them names no item)


def to_chat(request: ResponsesRequest, header_session: str | None) -> ChatCall:
    """The chat completion body of a Responses request. Raises InvalidInput naming the field."""
    stored = {"previous_response_id": request.previous_response_id, "conversation": request.conversation}
    for name, value in stored.items():
        if value is not None:
            raise InvalidInput(
                name,
                "responses are not stored here; send the whole conversation as input items (a compaction item "
                "stands for everything before it)",
            )
    if request.background:
        raise InvalidInput("background", "background responses are not served (nothing is stored); send stream")
    if request.prompt is not None:
        raise InvalidInput("prompt", "stored prompt templates are not served; send instructions and input")
    system = [{"role": "system", "content": request.instructions}] if request.instructions else []
    messages, compact_now = input_messages(request.input, trigger_allowed=True)
    body: dict[str, Any] = {"model": request.model, "messages": system + messages, "stream": request.stream}
    options = {
        "max_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "context_management": request.context_management,
    }
    body.update({k: v for k, v in options.items() if v is not None})
    if request.stream:
        body["stream_options"] = {"include_usage": True}
    response_format = _response_format((request.text or {}).get("format"))
    if response_format is not None:
        body["response_format"] = response_format
    functions, namespaces = _tools(request.tools or [])
    if functions:
        body["tools"] = [{"type": "function", "function": _function(t)} for t in functions]
    choice = _tool_choice(request.tool_choice) if request.tool_choice is not None else None
    if choice is not None and functions:  # no function tool offered (hosted ones only): nothing to choose
        body["tool_choice"] = choice
    session, field = session_of(header_session, request.prompt_cache_key, "prompt_cache_key")
    echo = request.model_dump(include={"model", "instructions", "temperature", "top_p", "max_output_tokens"})
    echo |= {
        "tools": request.tools or [],
        "tool_choice": request.tool_choice or "auto",
        "prompt_cache_key": request.prompt_cache_key,
    }
    return ChatCall(
        body, session, field, bool(system), echo, fields=INPUT, namespaces=namespaces, compact_now=compact_now,
        wire="responses",
    )  # fmt: skip


def _tools(raw: list[dict[str, Any]]) -> tuple[list[FunctionTool], dict[str, str]]:
    """The function tools to offer the model (a namespace's flattened) and each namespaced tool's namespace."""
    functions: list[FunctionTool] = []
    namespaces: dict[str, str] = {}
    for i, tool in enumerate(raw):
        kind = tool.get("type")
        if kind == "function":
            functions.append(_function_tool(tool, f"tools[{i}]"))
        elif kind == "namespace":
            inner = tool.get("tools")
            if not isinstance(tool.get("name"), str) or not isinstance(inner, list):
                raise InvalidInput(f"tools[{i}]", "a namespace tool has a string name and a list of tools")
            for j, member in enumerate(inner):
                if isinstance(member, dict) and member.get("type", "function") == "function":
                    functions.append(_function_tool({**member, "type": "function"}, f"tools[{i}].tools[{j}]"))
                    namespaces[functions[-1].name] = tool["name"]
        elif kind not in HOSTED_TOOLS:
            raise InvalidInput(f"tools[{i}].type", f"unknown tool type {kind!r}; send function or namespace tools")
    return functions, namespaces


def _function_tool(tool: dict[str, Any], at: str) -> FunctionTool:
    try:
        return FunctionTool.model_validate({k: v for k, v in tool.items() if k in FunctionTool.model_fields})
    except ValidationError as exc:
        first = exc.errors()[0]
        raise InvalidInput(f"{at}.{'.'.join(map(str, first['loc']))}".rstrip("."), first["msg"]) from exc


def compact_call(request: CompactResponsesRequest, header_session: str | None) -> ChatCall:
    """The messages of a /v1/responses/compact request, as a ChatCall (its body holds only them)."""
    system = [{"role": "system", "content": request.instructions}] if request.instructions else []
    session, field = session_of(header_session, request.prompt_cache_key, "prompt_cache_key")
    body = {"model": request.model, "messages": system + input_messages(request.input)[0]}
    return ChatCall(body, session, field, bool(system), {"model": request.model}, fields=INPUT, wire="responses")


def input_messages(items: str | list[Any], trigger_allowed: bool = False) -> tuple[list[dict[str, Any]], bool]:
    """Chat messages of `input` (everything before the last compaction item is ignored), and whether it ends
    with a compaction_trigger (only where `trigger_allowed`)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}], False
    if not items:
        raise InvalidInput("input", "send at least one input item")
    kinds = [item.get("type", "message") if isinstance(item, dict) else None for item in items]
    start = max((i for i, kind in enumerate(kinds) if kind == "compaction"), default=0)
    triggered = bool(kinds) and kinds[-1] == TRIGGER
    for i, kind in enumerate(kinds):
        if kind == TRIGGER and (i != len(kinds) - 1 or not trigger_allowed):
            where = "only as the last input item" if trigger_allowed else "only on /v1/responses"
            raise InvalidInput(f"input[{i}]", f"a compaction_trigger item is served {where}")
    out: list[dict[str, Any]] = []
    for i in range(start, len(items) - (1 if triggered else 0)):
        item, kind, at = items[i], kinds[i], f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidInput(at, "an input item is a JSON object")
        if kind == "compaction":
            out = dumps(decode(item.get("encrypted_content"), f"{at}.encrypted_content"))
        elif kind == "message":
            out.append(_message(item, at))
        elif kind in ("function_call", "custom_tool_call", "local_shell_call"):
            _append_call(out, _call_of(item, kind, at), at)
        elif kind in ("function_call_output", "custom_tool_call_output", "local_shell_call_output"):
            result = {"role": "tool", "tool_call_id": _text(item, "call_id", at), "content": _output(item, at)}
            out.append({**result, **keep_field(item, at)})
        elif kind != "reasoning" and kind not in HOSTED_ITEMS:
            raise InvalidInput(
                f"{at}.type",
                f"unsupported input item {kind!r}; send message, function_call, function_call_output, compaction "
                "or reasoning (ignored) items",
            )
    return out, triggered


def _call_of(item: dict[str, Any], kind: str, at: str) -> dict[str, Any]:
    """A function call item of any client-run tool kind, as a function call (name, call_id, arguments)."""
    if kind == "custom_tool_call":
        return {
            "call_id": _text(item, "call_id", at),
            "name": _text(item, "name", at),
            "arguments": _text(item, "input", at),
        }
    if kind == "local_shell_call":
        action = json.dumps(item.get("action") or {}, ensure_ascii=False)
        return {"call_id": _text(item, "call_id", at), "name": "local_shell", "arguments": action}
    return item


def _text(item: dict[str, Any], key: str, at: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidInput(f"{at}.{key}", "must be a string")
    return value


def _parts_text(parts: Any, at: str) -> str:
    """The text of a content value: a string, or a list of parts joined by newlines (an image or a file part
    stands as a one-line placeholder: this model reads text only)."""
    if isinstance(parts, str):
        return parts
    if not isinstance(parts, list):
        raise InvalidInput(at, "must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(wrapped(part["text"]) if keep_flag(part, f"{at}[{j}]") else part["text"])
        elif kind in PLACEHOLDER_PARTS:
            texts.append(PLACEHOLDER_PARTS[kind])
        else:
            raise InvalidInput(f"{at}[{j}]", f"unsupported content part {kind!r}; send text, image or file parts")
    return "\n".join(texts)


def _message(item: dict[str, Any], at: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise InvalidInput(f"{at}.role", f"unknown role {role!r}; use user, assistant, system or developer")
    content = _parts_text(item.get("content"), f"{at}.content")
    return {"role": "system" if role == "developer" else role, "content": content, **keep_field(item, at)}


def _append_call(out: list[dict[str, Any]], item: dict[str, Any], at: str) -> None:
    """A function call joins the assistant message right before it (one chat turn), else starts one."""
    call = {
        "id": _text(item, "call_id", at),
        "type": "function",
        "function": {"name": _text(item, "name", at), "arguments": _text(item, "arguments", at)},
    }
    if out and out[-1]["role"] == "assistant":
        out[-1] = {**out[-1], "tool_calls": [*out[-1].get("tool_calls", []), call]}
    else:
        out.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _output(item: dict[str, Any], at: str) -> str:
    return _parts_text(item.get("output"), f"{at}.output")


def _function(tool: FunctionTool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.parameters or {"type": "object"}}
    if tool.description is not None:
        function["description"] = tool.description
    if tool.strict is not None:  # strict: the engine constrains a forced call's arguments to the schema
        function["strict"] = tool.strict
    return function


def _response_format(fmt: Any) -> dict[str, Any] | None:
    """text.format as the chat request's response_format: a JSON schema (the engine's grammar follows it) or JSON."""
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
        name = fmt.get("name") if isinstance(fmt.get("name"), str) and fmt.get("name") else "output"
        return {"type": "json_schema", "json_schema": {"name": name, "schema": fmt["schema"], "strict": True}}
    raise InvalidInput(
        "text.format", 'send {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "schema": {...}}'
    )


def _tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidInput("tool_choice", 'use "auto", "none", "required" or {"type": "function", "name": ...}')
