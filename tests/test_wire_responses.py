"""The OpenAI Responses API over the chat path (pure): requests, answers and streams, checked with the openai SDK."""

from __future__ import annotations

import asyncio
import base64
import json
import zlib
from typing import Any

import httpx
import pytest
from openai import OpenAI
from openai.types.responses import Response, ResponseCompactionItem, ResponseStreamEvent, ResponseUsage
from pydantic import TypeAdapter

from compaction.errors import InvalidInput
from compaction.history import parse_messages
from compaction.tokenizer import HFChatTokenizer
from serving.coordinator import CompactJob
from serving.turns import WIRE_FIELD
from serving.wire.codec import ChatCall, decode, dumps, encode
from serving.wire.responses import CompactResponsesRequest, ResponsesRequest, compact_call, input_messages, to_chat
from serving.wire.responses_answer import compacted, response, stream
from serving.wire.sse import chat_chunks
from tests.test_coordinator import MODEL, FakeReplicas, coordinator
from tests.wire_fakes import ChatPath, chat_stream, completion

INSTRUCTIONS = "You are a coding agent. Answer in one short sentence."
ENTRY = {"type": "compaction", "compact_threshold": 600, "chunk_tokens": 256, "max_chunk_summary_tokens": 16}
EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


def coding_items(steps: int) -> list[dict[str, Any]]:
    """A coding agent's input items: tasks, function calls, their outputs, short answers."""
    out: list[dict[str, Any]] = []
    for i in range(steps):
        out.append({"role": "user", "content": f"Step {i}: check module_{i}.py for the parser bug and report."})
        out.append({"type": "function_call", "call_id": f"call_{i}", "name": "read_file", "arguments": f'{{"i": {i}}}'})
        output = f"def parse_{i}(text):\n    return text.split(',')[{i}]  # line {10 + i}\n"
        out.append({"type": "function_call_output", "call_id": f"call_{i}", "output": output})
        part = {"type": "output_text", "text": f"module_{i}.py splits on commas at index {i}.", "annotations": []}
        out.append({"type": "message", "role": "assistant", "content": [part], "id": f"msg_{i}", "status": "completed"})
    return out


def request(items: list[dict[str, Any]] | str, **fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": MODEL, "input": items, "instructions": INSTRUCTIONS, **fields})


def test_input_items_become_one_chat_conversation() -> None:
    tools = [{"type": "function", "name": "read_file", "parameters": {"type": "object"}, "strict": True}]
    items = [
        {"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
        *coding_items(1),
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"role": "user", "content": "And now?"},
    ]
    call = to_chat(request(items, tools=tools, max_output_tokens=12, tool_choice="auto", temperature=0), None)
    assert call.system and call.session is None
    body = call.body
    assert body["max_tokens"] == 12 and body["temperature"] == 0 and body["tool_choice"] == "auto"
    function = {"name": "read_file", "parameters": {"type": "object"}, "strict": True}
    assert body["tools"] == [{"type": "function", "function": function}]
    assert [m["role"] for m in body["messages"]] == [
        "system",
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
        "user",
    ]
    assert body["messages"][0]["content"] == INSTRUCTIONS and body["messages"][1]["content"] == "Be brief."
    assistant = body["messages"][3]  # the call and the answer after its output are separate turns
    assert assistant["content"] is None and assistant["tool_calls"][0]["function"]["name"] == "read_file"
    assert body["messages"][4] == {"role": "tool", "tool_call_id": "call_0", "content": coding_items(1)[2]["output"]}
    parse_messages(body["messages"])  # valid chat messages
    text = "module_0.py splits on commas at index 0."
    merged, _ = input_messages([{"role": "assistant", "content": text}, coding_items(1)[1]])
    assert merged == [{"role": "assistant", "content": text, "tool_calls": [assistant["tool_calls"][0]]}]


def test_items_and_parts_marked_keep_reach_the_compaction_marked() -> None:
    """An item's `keep` marks its chat message (a function_call_output's too); a text part's wraps its text in
    `<keep>` markers (compaction.keep)."""
    items = coding_items(1)
    items[0] = {"role": "user", "content": [{"type": "input_text", "text": "Fix it.", "keep": True}]}
    items[2] = {**items[2], "keep": True}
    messages, _ = input_messages([*items, {"role": "user", "content": "Go on.", "keep": True}])
    assert messages[0]["content"] == "<keep>Fix it.</keep>" and "keep" not in messages[0]
    assert [m.get("keep") for m in messages[1:]] == [None, True, None, True]
    parse_messages(messages)


def test_the_session_is_the_header_else_prompt_cache_key() -> None:
    assert to_chat(request("hi", prompt_cache_key="k1"), None).session == "k1"
    header = to_chat(request("hi", prompt_cache_key="k1"), "h1")
    assert (header.session, header.session_field) == ("h1", "x-session-id")
    assert to_chat(request("hi", prompt_cache_key="k1"), None).wire_field(WIRE_FIELD) == "prompt_cache_key"


def test_a_json_schema_text_format_becomes_the_engines_grammar() -> None:
    schema = {"type": "object", "properties": {"verdict": {"enum": ["ok", "fail"]}}, "required": ["verdict"]}
    call = to_chat(request("hi", text={"format": {"type": "json_schema", "name": "v", "schema": schema}}), None)
    grammar = {"name": "v", "schema": schema, "strict": True}
    assert call.body["response_format"] == {"type": "json_schema", "json_schema": grammar}
    assert "response_format" not in to_chat(request("hi", text={"format": {"type": "text"}}), None).body


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),  # no schema
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_video", "url": "x"}]}]}, "input[0].content[0]"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"background": True}, "background"),
        ({"tools": [{"type": "spreadsheet"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "parameters": {}}]}, "tools[0].name"),
        ({"input": [{"type": "compaction_trigger"}, {"role": "user", "content": "x"}]}, "input[0]"),
        ({"input": [{"role": "critic", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
        ({"input": []}, "input"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"input": ["text"]}, "input[0]"),
        ({"input": [{"role": "user", "content": "x", "keep": 1}]}, "input[0].keep"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": "x", "keep": "y"}]}]},
            "input[0].content[0].keep",
        ),
    ],
)
def test_what_is_not_served_is_refused_naming_the_field(fields: dict[str, Any], field: str) -> None:
    fields = {"input": "hi", **fields}
    with pytest.raises(InvalidInput) as caught:
        to_chat(request(fields.pop("input"), **fields), None)
    assert caught.value.field == field


def foreign(payload: bytes) -> str:
    return "pc1." + base64.urlsafe_b64encode(payload).decode().rstrip("=")


@pytest.mark.parametrize(
    "encoding",
    [
        "gAAAAABoSomethingFromOpenAI",
        "pc1.###",
        foreign(b"not zlib"),
        foreign(zlib.compress(b'{"role": "user"}')),
        foreign(zlib.compress(b'[{"role": "robot", "content": "x"}]')),
        foreign(zlib.compress(b"[]")),
        foreign(zlib.compress(b"[" + b" " * (80 << 20) + b"]")[:-4]),
    ],
)
def test_a_malformed_or_foreign_compaction_item_is_refused_naming_it(encoding: str) -> None:
    items = [*coding_items(1), {"type": "compaction", "encrypted_content": encoding}, {"role": "user", "content": "x"}]
    with pytest.raises(InvalidInput) as caught:
        input_messages(items)  # raises
    assert caught.value.field == "input[4].encrypted_content"


def test_everything_before_the_last_compaction_item_is_ignored() -> None:
    carried = parse_messages([{"role": "user", "content": "Summary of the earlier conversation (compacted):\nA."}])
    item = {"type": "compaction", "id": "cmp_1", "encrypted_content": encode(carried), "messages": ["ignored"]}
    old = {"type": "compaction", "encrypted_content": "garbage, never read"}
    items = [old, *coding_items(2), item, {"role": "user", "content": "Next?"}]
    assert input_messages(items)[0] == [
        {"role": "user", "content": "Summary of the earlier conversation (compacted):\nA."},
        {"role": "user", "content": "Next?"},
    ]
    assert decode(encode(carried), "x") == carried  # stateless: any process decodes what any process wrote


async def compacted_turn(tokenizer: HFChatTokenizer) -> tuple[ChatCall, dict[str, Any], Any]:
    items = [*coding_items(10), {"role": "user", "content": "Which module has the bug?"}]
    call = to_chat(request(items, context_management=[ENTRY], max_output_tokens=12), "s1")
    forward, outcome = await ChatPath(tokenizer).prepare(call, "responses")
    assert outcome is not None and outcome.status == "applied"
    return call, forward, outcome


async def test_a_compacted_turn_answers_with_the_item_first_and_the_next_turn_continues_from_it(
    tokenizer: HFChatTokenizer,
) -> None:
    call, forward, outcome = await compacted_turn(tokenizer)
    out = response(completion("module_3.py."), call, outcome, forward["messages"])
    parsed = Response.model_validate(out)
    assert parsed.status == "completed" and parsed.output_text == "module_3.py."
    assert [item.type for item in parsed.output] == ["compaction", "message"]
    item = ResponseCompactionItem.model_validate(out["output"][0])
    carried = decode(item.encrypted_content, "item")
    sent = dumps(parse_messages(forward["messages"]))
    assert dumps(carried) == sent[1:]  # everything the model was sent but the instructions
    assert out["output"][0]["messages"] == sent[1:]  # the readable copy
    assert parsed.usage == ResponseUsage.model_validate(out["usage"]) and parsed.usage.input_tokens == 120
    assert out["compaction"]["status"] == "applied" and "messages" not in out["compaction"]
    following = [*(i.model_dump() for i in parsed.output), {"role": "user", "content": "And the fix?"}]
    again = to_chat(request(following), "s1")
    assert again.body["messages"][1:-2] == sent[1:]
    assert again.body["messages"][-2:] == [
        {"role": "assistant", "content": "module_3.py."},
        {"role": "user", "content": "And the fix?"},
    ]


async def test_the_stream_is_responses_events_the_sdk_reads(tokenizer: HFChatTokenizer) -> None:
    call, forward, outcome = await compacted_turn(tokenizer)
    tool = {"name": "read_file", "arguments": '{"path": "module_3.py"}'}
    chunks = chat_chunks(chat_stream(["modu", "le_3", ".py"], tool=tool))
    text = "".join([e async for e in stream(chunks, call, outcome, forward["messages"])])
    events = [EVENTS.validate_python(json.loads(e.split("data: ", 1)[1])) for e in text.strip().split("\n\n")]
    kinds = [e.type for e in events]
    opening = ["response.created", "response.in_progress", "response.output_item.added", "response.output_item.done"]
    assert kinds[:4] == opening
    assert events[2].item.type == "compaction" and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "module_3.py"
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == tool["arguments"]
    final = events[-1].response
    assert [i.type for i in final.output] == ["compaction", "message", "function_call"]
    assert final.output_text == "module_3.py" and final.usage is not None and final.usage.output_tokens == 3


def test_the_openai_client_sends_our_options_and_reads_the_answer(tokenizer: HFChatTokenizer) -> None:
    """Unmodified openai client against the translators: its context_management entry carries our options."""
    path, seen = ChatPath(tokenizer), []

    def serve(http: httpx.Request) -> httpx.Response:
        seen.append(json.loads(http.content))
        call = to_chat(ResponsesRequest.model_validate(seen[-1]), http.headers.get("x-session-id"))
        forward, outcome = asyncio.run(path.prepare(call, "responses"))
        return httpx.Response(200, json=response(completion(), call, outcome, forward["messages"]))

    client = OpenAI(
        base_url="http://test/v1", api_key="k", http_client=httpx.Client(transport=httpx.MockTransport(serve))
    )
    items = [*coding_items(10), {"role": "user", "content": "Which module?"}]
    entry = {**ENTRY, "background_threshold": 400, "strategy": "parallel"}
    first = client.responses.create(model=MODEL, input=items, instructions=INSTRUCTIONS, context_management=[entry])
    assert seen[0]["context_management"] == [entry]
    assert first.output[0].type == "compaction" and first.output_text == "Done."
    items = [*first.output, {"role": "user", "content": "And the fix?"}]
    second = client.responses.create(model=MODEL, input=items, instructions=INSTRUCTIONS, context_management=[entry])
    assert second.output_text == "Done." and seen[1]["input"][0]["type"] == "compaction"


async def test_compact_returns_the_kept_user_messages_and_one_item_standing_for_everything(
    tokenizer: HFChatTokenizer,
) -> None:
    items = [*coding_items(10), {"role": "user", "content": "Which module has the bug?"}]
    body = {"model": MODEL, "input": items, "instructions": INSTRUCTIONS, "chunk_tokens": 256}
    req = CompactResponsesRequest.model_validate({**body, "max_chunk_summary_tokens": 16})
    call = compact_call(req, None)
    job = CompactJob(model=MODEL, messages=parse_messages(call.body["messages"]), options=req.options())
    result = await coordinator(tokenizer, FakeReplicas()).compact(job)
    out = compacted(result, call)
    assert out["object"] == "response.compaction" and out["output"][-1]["type"] == "compaction"
    assert out["output"][:-1] == [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Which module has the bug?"}]}
    ]
    ResponseCompactionItem.model_validate(out["output"][-1])
    assert ResponseUsage.model_validate(out["usage"]).input_tokens == result.stats.prompt_tokens > 0
    following, _ = input_messages([*out["output"], {"role": "user", "content": "Go on."}])
    assert following[-2:] == [
        {"role": "user", "content": "Which module has the bug?"},
        {"role": "user", "content": "Go on."},
    ]
    assert following[0]["content"].startswith("Summary of the earlier conversation")
