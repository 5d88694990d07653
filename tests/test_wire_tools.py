"""A tool list in the form vLLM's chat endpoint renders it: the compaction's prompts start with the agent's tokens."""

from __future__ import annotations

import json
from typing import Any

from serving.wire.tools import MAX_TOOLS, engine_tools

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "a"}},
    {"function": {"parameters": {"type": "object", "properties": {"x": {}}}, "description": "d", "name": "b"}},
    {"type": "function", "function": {"name": "c", "strict": True, "extra": 1}, "defer_loading": True},
    {"type": "function", "function": {"name": "d", "description": None, "defer_loading": False}},
]


def test_tools_take_the_form_vllm_hands_the_template() -> None:
    """Field order and nulls are tokens once a template writes the list as JSON: compared as text."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam

    expected = [ChatCompletionToolsParam.model_validate(tool).model_dump() for tool in TOOLS]
    assert json.dumps(engine_tools(TOOLS)) == json.dumps(expected)


def test_a_list_the_engine_refuses_is_not_rendered() -> None:
    for tools in (None, [], "tools", [{"type": "function"}], [{"type": "web_search", "function": {"name": "f"}}]):
        assert engine_tools(tools) is None
    assert engine_tools([TOOLS[0]] * (MAX_TOOLS + 1)) is None
