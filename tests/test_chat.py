"""The ingress side of chat-side compaction (pure): prompt counting, the turn's forwarded request, the response."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.responses import JSONResponse, StreamingResponse

from compaction.errors import InvalidInput
from compaction.history import parse_messages
from compaction.tokenizer import ChatTokenizer
from compaction.turn_policy import prompt_tokens
from serving.turns import ChatTurn, PromptCounter, TurnCompaction, prepare_turn
from serving.wire.chat import compaction_json, when_sent, with_compaction
from tests.fakes import ChatMLTokenizer

SYSTEM = {"role": "system", "content": "You are a coding agent."}


@pytest.fixture(scope="module")
def tokenizer(chat_tokenizer: ChatMLTokenizer) -> ChatMLTokenizer:
    return chat_tokenizer


def history(turns: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [SYSTEM]
    for i in range(turns):
        out.append({"role": "user", "content": f"Step {i}: run the tests in module_{i}.py and report."})
        out.append({"role": "assistant", "content": None, "tool_calls": [{"id": f"c{i}", "function": {"name": "run"}}]})
        out.append({"role": "tool", "tool_call_id": f"c{i}", "content": f"{i} passed, {i % 3} failed"})
    return out


def test_the_session_count_equals_a_whole_count(tokenizer: ChatTokenizer) -> None:
    counter = PromptCounter(tokenizer, tokenizer.special_tokens)
    fresh = PromptCounter(tokenizer, tokenizer.special_tokens)
    for turns in (3, 4, 9, 10):
        messages = parse_messages(history(turns))
        expected = prompt_tokens(messages, tokenizer)
        assert counter.count(messages, "s1") == expected == fresh.count(messages, None)
    edited = parse_messages([SYSTEM, {"role": "user", "content": "A different start."}, *history(10)[2:]])
    assert counter.count(edited, "s1") == prompt_tokens(edited, tokenizer)  # a changed prefix is counted anew


class Asked:
    def __init__(self, outcome: TurnCompaction) -> None:
        self.outcome = outcome
        self.turns: list[ChatTurn] = []

    async def __call__(self, turn: ChatTurn) -> TurnCompaction:
        self.turns.append(turn)
        return self.outcome


def body(messages: list[dict[str, Any]], **entry: Any) -> dict[str, Any]:
    cm = [{"type": "compaction", "compact_threshold": 600, **entry}]
    return {"model": "m", "messages": messages, "max_tokens": 32, "context_management": cm, "temperature": 0}


async def test_below_the_thresholds_the_turn_goes_out_unchanged_without_asking(tokenizer: ChatTokenizer) -> None:
    counter = PromptCounter(tokenizer, tokenizer.special_tokens)
    ask = Asked(TurnCompaction(status="none", prompt_tokens=0))
    forward, outcome = await prepare_turn(body(history(2)), "s1", counter, 8192, ask)
    assert outcome is not None and outcome.status == "none" and not ask.turns
    assert forward == {k: v for k, v in body(history(2)).items() if k != "context_management"}


async def test_past_the_threshold_the_forwarded_messages_are_the_compacted_prompt(tokenizer: ChatTokenizer) -> None:
    counter = PromptCounter(tokenizer, tokenizer.special_tokens)
    head = parse_messages([SYSTEM, {"role": "user", "content": "Summary: steps 0-9 ran."}])
    ask = Asked(TurnCompaction(status="applied", messages=head, replaces_through=31, prompt_tokens=900))
    messages = [*history(10), {"role": "user", "content": "Now fix module_3."}]
    forward, outcome = await prepare_turn(body(messages, compact_threshold=400), "s1", counter, 8192, ask)
    assert outcome is ask.outcome and len(ask.turns) == 1 and ask.turns[0].prompt_tokens > 400
    assert ask.turns[0].room == 8192 - 32 and ask.turns[0].session_id == "s1" and ask.turns[0].wire == "chat"
    assert forward["messages"] == [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Summary: steps 0-9 ran."},
        {"role": "user", "content": "Now fix module_3."},
    ]
    assert "context_management" not in forward and forward["max_tokens"] == 32


async def test_bad_entries_and_messages_are_refused_before_any_work(tokenizer: ChatTokenizer) -> None:
    counter = PromptCounter(tokenizer, tokenizer.special_tokens)
    ask = Asked(TurnCompaction(status="none", prompt_tokens=0))
    cases = [
        (body(history(2), compact_threshold=9000), "context_management[0].compact_threshold"),
        (body(history(2), background_threshold=700), "context_management[0].background_threshold"),
        ({**body(history(2)), "messages": []}, "messages"),
        (body([{"role": "robot", "content": "x"}]), "messages[0].role"),
    ]
    for request, field in cases:
        with pytest.raises(InvalidInput) as caught:
            await prepare_turn(request, "s1", counter, 8192, ask)
        assert caught.value.field == field
    assert not ask.turns


def outcome() -> TurnCompaction:
    head = parse_messages([{"role": "user", "content": "Summary."}])
    return TurnCompaction(status="applied", messages=head, replaces_through=3, prompt_tokens=10, stall_s=0.5)


def test_the_json_answer_carries_compaction_without_null_fields() -> None:
    response = with_compaction(JSONResponse({"id": "x", "choices": []}), outcome())
    data = json.loads(bytes(response.body))
    assert data["id"] == "x" and data["compaction"]["status"] == "applied"
    assert data["compaction"]["messages"] == [{"role": "user", "content": "Summary."}]
    assert data["compaction"]["replaces_through"] == 3 and data["compaction"]["stall_s"] == 0.5
    error = JSONResponse({"error": {"message": "no"}}, status_code=400)
    assert with_compaction(error, outcome()) is error


async def test_a_reply_counts_as_sent_after_its_last_event_with_the_message_it_answered() -> None:
    sent: list[dict[str, Any] | None] = []
    midway: list[list[dict[str, Any] | None]] = []

    async def events() -> AsyncIterator[str]:
        yield 'data: {"choices": [{"delta": {"role": "assistant", "content": "Hel"}}]}\n\ndata: {"choi'
        midway.append(list(sent))  # what was recorded while the stream still runs
        yield 'ces": [{"delta": {"content": "lo"}}]}\n\ndata: not json\n\n'
        call = {"index": 0, "id": "c1", "function": {"name": "ls"}}
        yield f"data: {json.dumps({'choices': [{'delta': {'tool_calls': [call]}}]})}\n\n"
        yield 'data: {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}}]}\n\n'
        yield "data: [DONE]\n\n"

    stream = when_sent(StreamingResponse(events(), media_type="text/event-stream"), sent.append)
    assert isinstance(stream, StreamingResponse) and sent == []
    assert len([str(e) async for e in stream.body_iterator]) == 5  # every packet passed on as it came
    call = {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
    assert midway == [[]] and sent == [{"role": "assistant", "content": "Hello", "tool_calls": [call]}]
    reply = JSONResponse({"id": "x", "choices": [{"message": {"role": "assistant", "content": "Hi"}}]})
    assert when_sent(reply, sent.append) is reply and sent[-1] == {"role": "assistant", "content": "Hi"}
    error = JSONResponse({"error": {"message": "no"}}, status_code=400)
    assert when_sent(error, sent.append) is error and sent[-1] is None


async def test_the_stream_carries_compaction_on_its_last_chunk() -> None:
    async def events() -> AsyncIterator[str]:
        yield 'data: {"id": "a", "choices": [{"delta": {"content": "Hel"}}]}\n\n'
        yield 'data: {"id": "a", "choices": [{"delta": {"content": "lo"}}]}\n\ndata: {"id": "a", "choices": []}'
        yield "\n\ndata: [DONE]\n\n"

    response = with_compaction(StreamingResponse(events(), media_type="text/event-stream"), outcome())
    assert isinstance(response, StreamingResponse)
    text = "".join([str(chunk) async for chunk in response.body_iterator])
    chunks = [e.removeprefix("data: ") for e in text.split("\n\n") if e.strip()]
    assert chunks[-1] == "[DONE]" and len(chunks) == 4
    parsed = [json.loads(c) for c in chunks[:-1]]
    assert ["compaction" in p for p in parsed] == [False, False, True]
    assert parsed[-1]["compaction"] == compaction_json(outcome())


def test_the_counter_measures_the_agents_idle_time_between_a_reply_and_its_next_turn(
    tokenizer: ChatTokenizer,
) -> None:
    counter = PromptCounter(tokenizer, tokenizer.special_tokens)
    assert counter.arrived("s1") is None  # nothing replied yet
    counter.replied("s1")
    time.sleep(0.2)
    first = counter.arrived("s1")
    assert first is not None and 0.2 <= first < 1.0
    assert counter.arrived("s1") == first  # a retried turn before any reply adds no gap
    counter.replied("s1")
    second = counter.arrived("s1")  # back to back: the mean falls
    assert second is not None and second < first / 1.5
    assert counter.arrived("other") is None and counter.arrived(None) is None


async def test_the_ingress_asks_early_when_the_next_turn_would_pass_the_threshold(tokenizer: ChatTokenizer) -> None:
    counter = PromptCounter(tokenizer, tokenizer.special_tokens)
    ask = Asked(TurnCompaction(status="running", prompt_tokens=0))
    entry = {"compact_threshold": 1100, "background_threshold": 950}
    first, second = history(4), history(16)
    await prepare_turn(body(first, **entry), "s1", counter, 8192, ask)
    assert not ask.turns  # below both thresholds, nothing known of the session's growth
    grown = counter.count(parse_messages(second), None)
    assert grown < 950 and 2 * grown - counter.count(parse_messages(first), None) > 1100
    await prepare_turn(body(second, **entry), "s1", counter, 8192, ask)
    assert len(ask.turns) == 1 and ask.turns[0].growth == grown - counter.count(parse_messages(first), None)
    await prepare_turn(body(second, **entry), "other", counter, 8192, ask)
    assert len(ask.turns) == 1  # another session has no growth on record
    short = [*second, {"role": "user", "content": "And?"}]  # a short turn after a long one: the long one counts
    await prepare_turn(body(short, **entry), "s1", counter, 8192, ask)
    assert len(ask.turns) == 2 and ask.turns[1].growth == ask.turns[0].growth
