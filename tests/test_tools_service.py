"""Tool calling through the real service on every route: a tool call the client forces (a named tool choice, a
strict schema: the engine's grammar writes the arguments, so any numeric path gives a valid call) is written by
the model and comes back as each format's tool call, through the official SDKs; and the agent CLIs' own
recorded tool turns (their tool-call and tool-result items and blocks, as sent) are answered, streamed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import SERVED_MODEL, auth
from tests.test_clients import _values
from tests.test_wire_service import anthropic_client, openai_client

pytestmark = [pytest.mark.ray, pytest.mark.engine]

FIXTURES = Path(__file__).with_name("fixtures") / "clients"
ASK = "Step 3 of the build failed with a parse error. Record the verdict."
VERDICTS = {"ok", "fail"}
SCHEMA = {"type": "object", "properties": {"verdict": {"type": "string", "enum": sorted(VERDICTS)}},
          "required": ["verdict"], "additionalProperties": False}  # fmt: skip
DESCRIPTION = "Record the step's verdict."


def forced_chat(url: str) -> tuple[str, dict[str, Any]]:
    function = {"name": "record", "description": DESCRIPTION, "parameters": SCHEMA, "strict": True}
    tool = {"type": "function", "function": function}
    reply = openai_client(url).chat.completions.create(
        model=SERVED_MODEL, messages=[{"role": "user", "content": ASK}], tools=[tool], max_tokens=48,
        tool_choice={"type": "function", "function": {"name": "record"}}, temperature=0,
    )  # fmt: skip
    call = reply.choices[0].message.tool_calls[0]
    return call.function.name, json.loads(call.function.arguments)


def forced_responses(url: str) -> tuple[str, dict[str, Any]]:
    tool = {"type": "function", "name": "record", "description": DESCRIPTION, "parameters": SCHEMA, "strict": True}
    reply = openai_client(url).responses.create(
        model=SERVED_MODEL, input=ASK, tools=[tool], tool_choice={"type": "function", "name": "record"},
        max_output_tokens=48, temperature=0,
    )  # fmt: skip
    call = next(item for item in reply.output if item.type == "function_call")
    return call.name, json.loads(call.arguments)


def forced_messages(url: str) -> tuple[str, dict[str, Any]]:
    tool = {"name": "record", "description": DESCRIPTION, "input_schema": SCHEMA, "strict": True}
    reply = anthropic_client(url).messages.create(
        model=SERVED_MODEL, messages=[{"role": "user", "content": ASK}], tools=[tool], max_tokens=48,
        tool_choice={"type": "tool", "name": "record"},
    )  # fmt: skip
    assert reply.stop_reason == "tool_use", reply
    block = next(b for b in reply.content if b.type == "tool_use")
    return block.name, dict(block.input)


@pytest.mark.parametrize("route", [forced_chat, forced_responses, forced_messages], ids=lambda r: r.__name__[7:])
def test_a_forced_tool_call_comes_back_as_a_tool_call(service: Any, route: Any) -> None:
    name, arguments = route(service.url)
    assert name == "record" and arguments.get("verdict") in VERDICTS, arguments


# The recorded CLI turns, with their tool lists cut to the tools their histories use (as docs/agents.md slims
# them for the CPU default's 8k window); the histories, with their tool calls and results, stay as sent.
REPLAYS = {
    "codex-tool-turn.json": "event: response.completed",
    "claude-tool-turn.json": "event: message_stop",
    "opencode-tool-turn.json": "data: [DONE]",
}


def slimmed(body: dict[str, Any]) -> dict[str, Any]:
    used = {name for name in _values(body.get("input") or body.get("messages"), "name") if isinstance(name, str)}
    tools = [t for t in body.get("tools", []) if (t.get("name") or t.get("function", {}).get("name")) in used]
    if "system" in body:
        body["system"] = [{"type": "text", "text": "You are a terse coding assistant."}]
    budget = {"max_tokens": 48} if "max_tokens" in body else {}  # Codex sends none: the catalogue's default
    return {**body, "model": SERVED_MODEL, "tools": tools, **budget}


@pytest.mark.parametrize("name", sorted(REPLAYS))
def test_a_recorded_cli_tool_turn_is_answered_streamed(service: Any, name: str) -> None:
    recorded = json.loads((FIXTURES / name).read_text())
    body = slimmed(recorded["body"])
    headers = {k: v for k, v in recorded["headers"].items() if k.startswith(("anthropic-", "x-codex", "x-claude"))}
    with httpx.Client(base_url=service.url, timeout=600) as http:
        answer = http.post(recorded["path"], params=recorded["query"] or None, json=body,
                           headers={**headers, **auth()})  # fmt: skip
    assert answer.status_code == 200, answer.text[:2000]
    assert REPLAYS[name] in answer.text and "event: error" not in answer.text, answer.text[-2000:]
