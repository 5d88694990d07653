"""The Anthropic Messages API over the chat path (pure): requests, answers, streams and errors, checked with the
anthropic SDK's own types and client."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx2
import pytest
from anthropic import Anthropic
from anthropic.types.beta import BetaMessage, BetaRawMessageStreamEvent
from anthropic.types.shared import ErrorResponse
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import TypeAdapter

from compaction.errors import InvalidInput
from compaction.history import parse_messages
from compaction.plan import SUMMARY_HEADER
from compaction.tokenizer import ChatTokenizer
from serving.errors import install_error_handlers
from serving.turns import WIRE_FIELD
from serving.wire.codec import ChatCall, decode, dumps, encode
from serving.wire.errors import AnthropicErrors
from serving.wire.messages import CountTokensRequest, MessagesRequest, chat_messages, to_chat
from serving.wire.messages_answer import message, paused, stream
from serving.wire.sse import chat_chunks
from tests.fakes import ChatMLTokenizer
from tests.test_coordinator import MODEL
from tests.wire_fakes import ChatPath, chat_stream, completion

SYSTEM = "You are a coding agent. Answer in one short sentence."
BETA = "compact-2026-01-12"
EVENTS: TypeAdapter[Any] = TypeAdapter(BetaRawMessageStreamEvent)


@pytest.fixture(scope="module")
def tokenizer(chat_tokenizer: ChatMLTokenizer) -> ChatMLTokenizer:
    return chat_tokenizer


def edit(value: int = 600, **fields: Any) -> dict[str, Any]:
    trigger = {"type": "input_tokens", "value": value}
    return {
        "type": "compact_20260112",
        "trigger": trigger,
        "chunk_tokens": 256,
        "max_chunk_summary_tokens": 16,
        **fields,
    }


def coding_messages(steps: int) -> list[dict[str, Any]]:
    """A coding agent's Messages history: tasks, tool_use blocks, tool_result blocks, short answers."""
    out: list[dict[str, Any]] = []
    for i in range(steps):
        out.append({"role": "user", "content": f"Step {i}: check module_{i}.py for the parser bug and report."})
        use = {"type": "tool_use", "id": f"toolu_{i}", "name": "read_file", "input": {"i": i}}
        out.append({"role": "assistant", "content": [{"type": "text", "text": "Reading it."}, use]})
        output = f"def parse_{i}(text):\n    return text.split(',')[{i}]  # line {10 + i}\n"
        result = {"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": output}
        out.append({"role": "user", "content": [result, {"type": "text", "text": "Go on."}]})
        out.append({"role": "assistant", "content": f"module_{i}.py splits on commas at index {i}."})
    return out


def request(messages: list[dict[str, Any]], **fields: Any) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": MODEL, "max_tokens": 12, "messages": messages, "system": SYSTEM,
                                           **fields})  # fmt: skip


def test_blocks_become_one_chat_conversation() -> None:
    tools = [{"name": "read_file", "description": "Read a file.", "input_schema": {"type": "object"}}]
    history = [
        *coding_messages(1),
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"}]},
    ]
    system = [{"type": "text", "text": SYSTEM}]
    body = request(
        history, system=system, tools=tools, tool_choice={"type": "any"}, stop_sequences=["END"]
    ).model_dump()
    call = to_chat(MessagesRequest.model_validate(body), None)
    chat = call.body
    assert call.system and chat["stop"] == ["END"] and chat["max_tokens"] == 12 and chat["tool_choice"] == "required"
    assert chat["tools"][0]["function"] == {"name": "read_file", "parameters": {"type": "object"},
                                            "description": "Read a file."}  # fmt: skip
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant", "tool", "user", "assistant"]
    assert chat["messages"][2]["tool_calls"][0]["function"] == {"name": "read_file", "arguments": '{"i": 0}'}
    assert chat["messages"][3]["tool_call_id"] == "toolu_0" and chat["messages"][4]["content"] == "Go on."
    parse_messages(chat["messages"])


def test_messages_and_blocks_marked_keep_reach_the_compaction_marked() -> None:
    """A message's `keep` marks every chat message it becomes; a text block's wraps its text in `<keep>` markers,
    a tool_result block's marks its tool message (compaction.keep)."""
    history = coding_messages(1)
    history[0] = {**history[0], "keep": True}
    result, go_on = history[2]["content"]
    history[2] = {"role": "user", "content": [{**result, "keep": True}, {**go_on, "keep": True}]}
    chat = to_chat(request(history), None).body["messages"]
    assert [m.get("keep") for m in chat] == [None, True, None, True, None, None]
    assert chat[4]["content"] == "<keep>Go on.</keep>"
    parse_messages(chat)


def test_the_compaction_edit_becomes_our_entry_below_the_hosted_minimum() -> None:
    instructions = "Keep every file path."
    config = {"edits": [edit(600, instructions=instructions, pause_after_compaction=True, background_threshold=400)]}
    call = to_chat(request(coding_messages(1), context_management=config, metadata={"user_id": "u1"}), None)
    assert call.pause and (call.session, call.session_field) == ("u1", "metadata.user_id")
    assert call.body["context_management"] == [
        {"type": "compaction", "compact_threshold": 600, "instructions": instructions, "background_threshold": 400,
         "chunk_tokens": 256, "max_chunk_summary_tokens": 16}
    ]  # fmt: skip
    assert call.wire_field("context_management[0].compact_threshold") == "context_management.edits[0].trigger.value"
    assert call.wire_field("context_management[0].layout") == "context_management.edits[0].layout"
    assert call.wire_field(WIRE_FIELD) == "metadata.user_id"
    assert to_chat(request(coding_messages(1), metadata={"user_id": "u1"}), "h1").session == "h1"


EDITS = "context_management.edits"


def edits(*entries: dict[str, Any]) -> dict[str, Any]:
    return {"context_management": {"edits": list(entries)}}


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        (edits({"type": "clear_everything_20990101"}), f"{EDITS}[0].type"),
        (edits({"type": "clear_tool_uses_20250919", "keep": {"type": "turns", "value": 2}}), f"{EDITS}[0].keep.type"),
        (edits(edit(), edit()), f"{EDITS}[1]"),
        (edits({"type": "compact_20260112"}), f"{EDITS}[0].trigger.value"),
        (edits({**edit(), "trigger": {"type": "turns"}}), f"{EDITS}[0].trigger"),
        (edits(edit(pause_after_compaction="y")), f"{EDITS}[0].pause_after_compaction"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "video", "source": {}}]}]}, "messages[0].content[0].type"),
        ({"output_config": {"format": {"type": "regex"}}}, "output_config.format"),
        ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
         "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "messages[0].content[0].tool_use_id"),
        ({"system": [{"type": "image"}]}, "system[0]"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
        ({"metadata": {"user_id": "\x00"}}, "metadata.user_id"),
        ({"messages": [{"role": "user", "content": "x", "keep": "yes"}]}, "messages[0].keep"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "keep": 1}]}]},
         "messages[0].content[0].keep"),
    ],
)  # fmt: skip
def test_what_is_not_served_is_refused_naming_the_field(fields: dict[str, Any], field: str) -> None:
    fields = {"messages": coding_messages(1), **fields}
    with pytest.raises(InvalidInput) as caught:
        to_chat(request(**fields), None)
    assert caught.value.field == field


def test_everything_before_the_last_compaction_block_is_ignored() -> None:
    carried = parse_messages([{"role": "user", "content": f"{SUMMARY_HEADER}\nA."}, {"role": "user", "content": "Q?"}])
    block = {"type": "compaction", "content": "A.", "encrypted_content": encode(carried)}
    old = {"type": "compaction", "content": "old", "encrypted_content": "never read"}
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [old]},
        *coding_messages(2),
        {"role": "assistant", "content": [block, {"type": "text", "text": "Done."}]},
        {"role": "user", "content": "Next?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Sure."}]},
    ]
    after = [{"role": "assistant", "content": "Done."}, {"role": "user", "content": "Next?"}]
    assert chat_messages(history)[0] == [*dumps(carried), *after, {"role": "assistant", "content": "Sure."}]
    other = [{"role": "assistant", "content": [{"type": "compaction", "content": "Bob booked trip 3."}]}]
    assert chat_messages(other)[0] == [{"role": "user", "content": f"{SUMMARY_HEADER}\nBob booked trip 3."}]
    emptied = {"type": "compaction", "content": None, "encrypted_content": None}  # what a client that lost it sends
    with pytest.raises(InvalidInput) as caught:
        chat_messages([*history, {"role": "assistant", "content": [emptied]}])  # never a silent drop of its turns
    assert caught.value.field == f"messages[{len(history)}].content[0].content"
    with pytest.raises(InvalidInput) as caught:
        chat_messages([*history, {"role": "assistant", "content": [{**block, "encrypted_content": "gAAAA"}]}])
    assert caught.value.field == f"messages[{len(history)}].content[0].encrypted_content"
    with pytest.raises(InvalidInput) as caught:
        chat_messages([{"role": "assistant", "content": [{"type": "compaction", "content": " "}]}])
    assert caught.value.field == "messages[0].content[0].content"
    stripped = {"type": "compaction", "content": f"{SUMMARY_HEADER}\nA."}  # ours, its encoding lost on the way
    with pytest.raises(InvalidInput, match="without its encrypted_content") as caught:
        chat_messages([*history, {"role": "assistant", "content": [stripped]}])  # not read as a foreign summary
    assert caught.value.field == f"messages[{len(history)}].content[0].encrypted_content"


async def compacted_turn(tokenizer: ChatTokenizer, **edit_fields: Any) -> tuple[ChatCall, dict[str, Any], Any]:
    history = [*coding_messages(8), {"role": "user", "content": "Which module has the bug?"}]
    call = to_chat(request(history, context_management={"edits": [edit(**edit_fields)]}), "s1")
    forward, outcome = await ChatPath(tokenizer).prepare(call, "messages")
    assert outcome is not None and outcome.status == "applied"
    return call, forward, outcome


@pytest.mark.parametrize("finish", ["tool_calls", "stop"])  # a forced (named) tool call finishes with "stop"
async def test_a_compacted_turn_answers_with_the_block_first_and_its_iterations(
    tokenizer: ChatTokenizer, finish: str
) -> None:
    call, forward, outcome = await compacted_turn(tokenizer)
    tool_call = {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"i": 3}'}}
    out = BetaMessage.model_validate(message(completion("module_3.py.", [tool_call], finish), call, outcome,
                                             forward["messages"]))  # fmt: skip
    assert [b.type for b in out.content] == ["compaction", "text", "tool_use"] and out.stop_reason == "tool_use"
    block = out.content[0]
    assert block.type == "compaction" and block.content and SUMMARY_HEADER in block.content
    assert block.encrypted_content is not None
    assert dumps(decode(block.encrypted_content, "b")) == dumps(parse_messages(forward["messages"]))[1:]
    iterations = out.usage.iterations or []
    assert [i.type for i in iterations] == ["compaction", "message"] and out.usage.input_tokens == 120
    assert iterations[0].input_tokens == outcome.stats.prompt_tokens and iterations[0].output_tokens > 0
    assert out.content[2].type == "tool_use" and out.content[2].input == {"i": 3}
    assert out.model_extra is not None and out.model_extra["compaction"]["status"] == "applied"


async def test_pause_after_compaction_answers_the_block_alone_and_the_resend_is_answered(
    tokenizer: ChatTokenizer,
) -> None:
    call, forward, outcome = await compacted_turn(tokenizer, pause_after_compaction=True)
    out = BetaMessage.model_validate(paused(call, outcome, forward["messages"]))
    assert out.stop_reason == "compaction" and [b.type for b in out.content] == ["compaction"]
    assert [i.type for i in out.usage.iterations or []] == ["compaction"] and out.usage.output_tokens == 0
    resent = [*coding_messages(8), {"role": "user", "content": "Which module has the bug?"},
              {"role": "assistant", "content": [b.model_dump() for b in out.content]}]  # fmt: skip
    again = to_chat(request(resent, context_management={"edits": [edit(pause_after_compaction=True)]}), "s1")
    assert again.body["messages"][-1] == {"role": "user", "content": "Which module has the bug?"}
    _, outcome2 = await ChatPath(tokenizer).prepare(again, "messages")
    assert outcome2 is not None and outcome2.status == "none"  # the compacted prompt is below the trigger
    events = [e async for e in stream(None, call, outcome, forward["messages"])]
    parsed = [EVENTS.validate_python(json.loads(e.split("data: ", 1)[1])) for e in events]
    assert parsed[-2].type == "message_delta" and parsed[-2].delta.stop_reason == "compaction"


@pytest.mark.parametrize("finish", ["tool_calls", "stop"])
async def test_the_stream_is_messages_events_the_sdk_reads(tokenizer: ChatTokenizer, finish: str) -> None:
    call, forward, outcome = await compacted_turn(tokenizer)
    tool = {"name": "read_file", "arguments": '{"i": 3}'}
    chunks = chat_chunks(chat_stream(["modu", "le_3", ".py"], tool=tool, finish=finish))
    text = "".join([e async for e in stream(chunks, call, outcome, forward["messages"])])
    events = [EVENTS.validate_python(json.loads(e.split("data: ", 1)[1])) for e in text.strip().split("\n\n")]
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert events[1].content_block.type == "compaction" and events[2].delta.type == "compaction_delta"
    assert events[2].delta.encrypted_content and events[2].delta.content
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert "".join(d.text for d in deltas if d.type == "text_delta") == "module_3.py"
    assert "".join(d.partial_json for d in deltas if d.type == "input_json_delta") == tool["arguments"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 3
    assert events[-2].delta.stop_reason == "tool_use" and events[-2].usage.iterations is not None


def sdk(path: ChatPath, seen: list[dict[str, Any]]) -> Anthropic:
    """The unmodified anthropic client, its requests answered by the translators over the chat path."""

    def serve(http: httpx2.Request) -> httpx2.Response:
        seen.append(json.loads(http.content))
        if http.url.path.endswith("/count_tokens"):
            call = to_chat(CountTokensRequest.model_validate(seen[-1]), None)
            return httpx2.Response(200, json={"input_tokens": len(call.body["messages"])})
        call = to_chat(MessagesRequest.model_validate(seen[-1]), http.headers.get("x-session-id"))
        forward, outcome = asyncio.run(path.prepare(call, "messages"))
        if not call.body.get("stream"):
            return httpx2.Response(200, json=message(completion(), call, outcome, forward["messages"]))

        async def events() -> str:
            chunks = chat_chunks(chat_stream(["Do", "ne."]))
            return "".join([e async for e in stream(chunks, call, outcome, forward["messages"])])

        text = asyncio.run(events())
        return httpx2.Response(200, content=text.encode(), headers={"content-type": "text/event-stream"})

    return Anthropic(
        base_url="http://test", api_key="k", http_client=httpx2.Client(transport=httpx2.MockTransport(serve))
    )


def test_the_anthropic_client_round_trips_the_block(tokenizer: ChatTokenizer) -> None:
    seen: list[dict[str, Any]] = []
    client = sdk(ChatPath(tokenizer), seen)
    history = [*coding_messages(8), {"role": "user", "content": "Which module has the bug?"}]
    management = {"edits": [edit(background_threshold=400)]}
    reply = client.beta.messages.create(model=MODEL, max_tokens=12, system=SYSTEM, messages=history, betas=[BETA],
                                        context_management=management)  # type: ignore[arg-type]  # fmt: skip
    assert seen[0]["context_management"] == management
    assert reply.content[0].type == "compaction" and reply.content[1].type == "text"
    history += [{"role": "assistant", "content": reply.content}, {"role": "user", "content": "And the fix?"}]
    with client.beta.messages.stream(model=MODEL, max_tokens=12, system=SYSTEM, messages=history, betas=[BETA],
                                     context_management=management) as events:  # type: ignore[arg-type]  # fmt: skip
        final = events.get_final_message()
    assert seen[1]["messages"][-2]["content"][0]["encrypted_content"] == reply.content[0].encrypted_content
    assert [b.type for b in final.content] == ["text"] and final.content[0].text == "Done."
    counted = client.beta.messages.count_tokens(model=MODEL, system=SYSTEM, messages=history)
    assert counted.input_tokens == len(to_chat(CountTokensRequest.model_validate(seen[-1]), None).body["messages"])


def errors_app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(AnthropicErrors)

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest) -> dict[str, Any]:
        to_chat(body, None)
        return {}

    @app.post("/v1/responses")
    async def responses() -> dict[str, Any]:
        raise InvalidInput("input[0].role", "unknown role")

    return app


def test_errors_on_the_anthropic_routes_have_anthropics_shape_and_the_others_keep_ours() -> None:
    client = TestClient(errors_app())
    bad = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "video"}]}]}
    answer = client.post("/v1/messages", json=bad)
    assert answer.status_code == 422
    error = ErrorResponse.model_validate(answer.json())
    assert error.error.type == "invalid_request_error" and error.error.message.startswith(
        "messages[0].content[0].type:"
    )
    missing = client.post("/v1/messages", json={"model": MODEL, "messages": []})
    assert missing.status_code == 422 and ErrorResponse.model_validate(missing.json()).error.message
    assert int(missing.headers["content-length"]) == len(missing.content)
    openai = client.post("/v1/responses", json={})
    assert openai.status_code == 422 and openai.json()["error"]["param"] == "input[0].role"
