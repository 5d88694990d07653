"""What the real agent CLIs send, replayed through the service's handlers (pure: fake model and replicas).

tests/fixtures/clients/ holds requests recorded from Codex CLI 0.171.0, Claude Code 2.1.197 and OpenCode 1.18.33
against a recording server (long texts shortened, fields and shapes as sent). The compaction items and blocks in
them came from that recorder, not from this service: each is swapped for one this service issued, as the client
would carry it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from anthropic.types.beta import BetaMessage
from openai.types.responses import Response as OpenAIResponse

from compaction.context_edits import CLEARED, ClearToolUses, clear_tool_uses
from compaction.errors import InvalidInput, PromptTooLong
from compaction.history import parse_messages
from compaction.tokenizer import ChatTokenizer
from serving.turns import fit
from serving.wire.codec import encode
from serving.wire.messages import MessagesRequest
from serving.wire.messages import to_chat as messages_to_chat
from serving.wire.responses import ResponsesRequest
from serving.wire.responses import to_chat as responses_to_chat
from tests.fakes import ChatMLTokenizer
from tests.test_wire_ingress import MODEL, Ingress, Model, http, payload
from tests.test_wire_ingress import model as model  # the fake model fixture

FIXTURES = Path(__file__).with_name("fixtures") / "clients"
OUR_ITEM = encode(parse_messages([{"role": "user", "content": "Summary of the earlier conversation (compacted):\nA."}]))


@pytest.fixture(scope="module")
def tokenizer(chat_tokenizer: ChatMLTokenizer) -> ChatMLTokenizer:
    return chat_tokenizer


def recorded(name: str) -> dict[str, Any]:
    body: dict[str, Any] = json.loads((FIXTURES / name).read_text())["body"]
    return {**body, "model": MODEL}


def ours(body: dict[str, Any]) -> dict[str, Any]:
    """The recorded request with the recorder's compaction items and blocks replaced by one this service issued."""
    text = json.dumps(body)
    for foreign in {v for v in _values(body, "encrypted_content") if isinstance(v, str)}:
        text = text.replace(json.dumps(foreign), json.dumps(OUR_ITEM))
    return dict(json.loads(text))


def _values(node: Any, key: str) -> list[Any]:
    if isinstance(node, dict):
        return ([node[key]] if key in node else []) + [v for child in node.values() for v in _values(child, key)]
    return [v for child in node for v in _values(child, key)] if isinstance(node, list) else []


@pytest.mark.parametrize(
    "name", ["codex-tool-turn.json", "codex-compaction-trigger.json", "codex-mid-turn-trigger.json"]
)
def test_codex_requests_are_accepted_as_sent(name: str) -> None:
    body = ours(recorded(name))
    call = responses_to_chat(ResponsesRequest.model_validate(body), None)
    parse_messages(call.body["messages"])  # every item became a valid chat message
    names = {t["function"]["name"] for t in call.body["tools"]}
    assert "exec_command" in names and "web_search" not in names  # a hosted tool is left out of the prompt
    namespaced = [t for t in body["tools"] if t["type"] == "namespace"]
    assert namespaced and all(t["name"] in names for ns in namespaced for t in ns["tools"])  # flattened
    assert call.session == body["prompt_cache_key"]
    assert call.compact_now == (body["input"][-1].get("type") == "compaction_trigger")


def test_a_namespaced_call_comes_back_with_its_namespace() -> None:
    body = recorded("codex-tool-turn.json")
    namespace = next(t for t in body["tools"] if t["type"] == "namespace")
    call = responses_to_chat(ResponsesRequest.model_validate(body), None)
    assert call.namespaces[namespace["tools"][0]["name"]] == namespace["name"]


async def test_codex_compacts_in_band_and_goes_on_from_the_item(tokenizer: ChatTokenizer, model: Model) -> None:
    """A compaction_trigger is answered by exactly one compaction item, without asking the model; the next request
    (Codex's order: re-injected context, the item, the new message) is answered from what the item carries."""
    ingress = Ingress(tokenizer)
    trigger = ResponsesRequest.model_validate({**recorded("codex-compaction-trigger.json"), "stream": False})
    out = OpenAIResponse.model_validate(payload(await ingress.responses(trigger, http("/v1/responses"))))
    assert [item.type for item in out.output] == ["compaction"] and not model.sent
    streamed = await ingress.responses(trigger.model_copy(update={"stream": True}), http("/v1/responses"))
    events = [json.loads(line[6:]) for line in "".join([str(e) async for e in streamed.body_iterator]).splitlines()
              if line.startswith("data: ")]  # fmt: skip
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [i["type"] for i in done] == ["compaction"] and events[-1]["type"] == "response.completed"
    after = ours(recorded("codex-after-compaction.json"))
    item = next(i for i in after["input"] if i.get("type") == "compaction")
    item["encrypted_content"] = done[0]["encrypted_content"]  # what Codex keeps and sends back
    answer = await ingress.responses(ResponsesRequest.model_validate({**after, "stream": False}), http("/v1/responses"))
    assert OpenAIResponse.model_validate(payload(answer)).output_text == "Done."
    sent = model.sent[-1][0].messages
    assert sent[-1]["content"] == after["input"][-1]["content"][0]["text"]  # the new message, after the carried ones


@pytest.mark.parametrize("name", ["claude-tool-turn.json", "claude-custom-model.json", "claude-after-block.json"])
def test_claude_code_requests_are_accepted_as_sent(name: str) -> None:
    body = ours(recorded(name))
    call = messages_to_chat(MessagesRequest.model_validate(body), None)
    messages = parse_messages(call.body["messages"])
    assert call.session == json.loads(body["metadata"]["user_id"])["session_id"]  # Claude Code's JSON user id
    assert call.body["max_tokens"] == body["max_tokens"]  # cut to the room left only where the window is known
    if name == "claude-custom-model.json":  # its system messages mid-conversation are served as system turns
        assert [m.role for m in messages][:3] == ["system", "user", "system"]
    if name == "claude-after-block.json":  # everything before the block is dropped; the block's messages stand
        assert messages[1].text().startswith("Summary of the earlier conversation")


async def test_claude_codes_turn_is_answered_within_the_window(tokenizer: ChatTokenizer, model: Model) -> None:
    """max_tokens of 32,000 on an 8,192-token window: the reply budget is cut to the room left, not refused."""
    ingress = Ingress(tokenizer)
    recording = recorded("claude-tool-turn.json")  # slimmed as the README says: one tool (--tools Bash)
    body = MessagesRequest.model_validate({**recording, "tools": recording["tools"][:1], "stream": False})
    out = BetaMessage.model_validate(payload(await ingress.messages(body, http("/v1/messages"))))
    assert out.content[-1].type == "text"
    sent = model.sent[-1][0]
    assert sent.max_tokens is not None and sent.max_tokens < 8192 < body.max_tokens
    assert out.context_management is not None and out.context_management.applied_edits == []  # nothing to clear


def test_a_prompt_past_the_window_is_refused_in_the_words_agents_compact_on(tokenizer: ChatTokenizer) -> None:
    messages = [{"role": "user", "content": "word " * 3000}]
    with pytest.raises(PromptTooLong) as caught:
        fit({"model": MODEL, "messages": messages, "max_tokens": 10}, tokenizer, 1024)
    assert caught.value.message.startswith(f"prompt is too long: {caught.value.tokens} tokens > 1024 maximum")


def test_old_tool_results_are_cleared_as_anthropic_documents(tokenizer: ChatTokenizer) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Fix the bug."}]
    for i in range(6):
        call = {"id": f"t{i}", "type": "function", "function": {"name": "Read" if i else "Bash", "arguments": "{}"}}
        messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": f"t{i}", "content": f"file {i}: " + "x " * 200}]  # fmt: skip

    def count(msgs: list[dict[str, Any]]) -> int:
        return len(tokenizer.encode(json.dumps(msgs)))

    edit = ClearToolUses.model_validate(
        {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 100},
         "keep": {"type": "tool_uses", "value": 2}, "exclude_tools": ["Bash"], "clear_tool_inputs": True}
    )  # fmt: skip
    cleared, report = clear_tool_uses(messages, edit, count)
    assert report is not None and report["cleared_tool_uses"] == 3 and report["cleared_input_tokens"] > 0
    results = [m["content"] for m in cleared if m["role"] == "tool"]
    assert results[0].startswith("file 0") and results[1:4] == [CLEARED] * 3 and results[4].startswith("file 4")
    assert messages[4]["content"].startswith("file 1")  # the caller's messages are untouched
    marked = [*messages[:4], {**messages[4], "keep": True}, *messages[5:]]  # a result marked to keep stays
    kept, report = clear_tool_uses(marked, edit, count)
    assert report is not None and report["cleared_tool_uses"] == 2 and kept[4]["content"].startswith("file 1")
    untouched, none = clear_tool_uses(messages, edit.model_copy(update={"trigger": edit.trigger.model_copy(
        update={"value": 10**6})}), count)  # fmt: skip
    assert untouched is messages and none is None
    with pytest.raises(InvalidInput):
        responses_to_chat(ResponsesRequest.model_validate({"model": MODEL, "input": "x", "background": True}), None)
