"""Valid histories out: every compaction output is a valid OpenAI chat history, for every keep_recent_tokens."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types.chat import ChatCompletionMessageParam
from pydantic import TypeAdapter

from compaction.checks.validity import check_output, problems, turn_start
from compaction.compactor import Compactor
from compaction.errors import InvalidInput, InvalidOutput, NothingToCompact
from compaction.history import Message, parse_messages
from compaction.render import render_history
from compaction.tokenizer import ChatTokenizer
from jobs.data.traces import coding_trace
from tests.fakes import ChatMLTokenizer, FakeBackend

OPENAI_MESSAGES = TypeAdapter(list[ChatCompletionMessageParam])  # the official client's own request schema


@pytest.fixture(scope="module")
def tokenizer(chat_tokenizer: ChatMLTokenizer) -> ChatMLTokenizer:
    return chat_tokenizer


def openai_valid(messages: list[dict[str, Any]]) -> bool:
    """An oracle independent of compaction.checks.validity: calls are answered right after their turn, nothing else."""
    i = 0
    while i < len(messages):
        if messages[i]["role"] == "tool":
            return False
        calls = [c["id"] for c in messages[i].get("tool_calls") or []]
        block = messages[i + 1 : i + 1 + len(calls)]
        if any(m["role"] != "tool" for m in block) or sorted(m["tool_call_id"] for m in block) != sorted(calls):
            return False
        i += 1 + len(calls)
    OPENAI_MESSAGES.validate_python(messages)  # raises on a field the OpenAI schema refuses (e.g. "name": null)
    return True


def call(*ids: str, content: str | None = None) -> dict[str, Any]:
    calls = [{"id": i, "type": "function", "function": {"name": "read_file", "arguments": "{}"}} for i in ids]
    return {"role": "assistant", "content": content, "tool_calls": calls}


def result(i: str, text: str = "ok") -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": i, "content": text}


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ([{"role": "user", "content": "x"}, result("a")], "messages[1]"),
        ([call("a"), {"role": "user", "content": "x"}], "messages[0].tool_calls"),
        ([call("a"), result("b")], "messages[1].tool_call_id"),
        ([call("a", "a"), result("a"), result("a")], "messages[0].tool_calls"),
        ([call("a"), result("a"), result("a")], "messages[2].tool_call_id"),
        ([call("a")], "messages[0].tool_calls"),
    ],
)
def test_invalid_histories_are_refused_naming_the_message(tokenizer: ChatTokenizer, raw: list, field: str) -> None:
    assert problems(parse_messages(raw))[0][0] == field
    compactor = Compactor(tokenizer, FakeBackend(), context_window=8192)
    with pytest.raises(InvalidInput) as err:
        compactor.plan([{"role": "user", "content": "task"}, *raw], {"chunk_tokens": 16})
    index = int(field.split("[")[1].split("]")[0])
    assert err.value.field == field.replace(f"[{index}]", f"[{index + 1}]")  # the task message comes first
    assert "tool" in err.value.message


def test_valid_parallel_calls_pass_and_outputs_are_checked() -> None:
    good = parse_messages(
        [call("a", "b", content="Reading both."), result("b"), result("a"), {"role": "user", "content": "x"}]
    )
    assert problems(good) == []
    with pytest.raises(InvalidOutput):
        check_output(parse_messages([{"role": "user", "content": "summary"}, result("a")]))


def test_a_kept_tail_moves_back_to_the_turn_that_made_the_calls() -> None:
    messages = parse_messages(
        [{"role": "user", "content": "t"}, call("a", "b"), result("a"), result("b"), call("c"), result("c")]
    )
    assert [turn_start(messages, i, 0) for i in range(7)] == [0, 1, 1, 1, 4, 4, 6]
    # moving back would reach the kept head: move forward past the block instead (keep less)
    assert turn_start(messages, 2, 1) == 4 and turn_start(messages, 5, 4) == 6


def test_messages_dump_without_nulls() -> None:
    message = Message(role="user", content="hi")
    assert message.model_dump() == {"role": "user", "content": "hi"}
    assert json.loads(Message.model_validate(call("a")).model_dump_json())["content"] is None  # allowed beside calls


words = st.lists(
    st.sampled_from(["read", "the", "lexer", "test", "failed", "42", "src/a.py", "\n"]), min_size=1, max_size=30
)
turns = st.one_of(
    st.tuples(st.just("user"), words),
    st.tuples(st.just("assistant"), words),
    st.tuples(st.just("calls"), st.integers(1, 3), words, st.booleans()),
)


def build(spec: list[tuple], with_system: bool) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."}] if with_system else []
    out.append({"role": "user", "content": "Fix the failing test."})
    for n, turn in enumerate(spec):
        if turn[0] == "calls":
            _, count, text, with_text = turn
            ids = [f"call_{n}_{k}" for k in range(count)]
            out.append(call(*ids, content=" ".join(text) if with_text else None))
            out += [result(i, " ".join(text)) for i in ids]
        else:
            out.append({"role": turn[0], "content": " ".join(turn[1])})
    return out


def keep_values(tokenizer: ChatTokenizer, messages: list[dict[str, Any]]) -> list[int]:
    """Every distinct behaviour of keep_recent_tokens: each suffix size, one below it, and zero."""
    rendered = render_history(parse_messages(messages), tokenizer)
    total = len(rendered.token_ids)
    sizes = {total - start for start in rendered.message_starts}
    return sorted({0} | sizes | {s - 1 for s in sizes})


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=st.lists(turns, min_size=1, max_size=10), with_system=st.booleans(), chunk=st.sampled_from([16, 48, 128]))
async def test_every_output_is_valid_for_every_keep_recent_tokens(
    tokenizer: ChatTokenizer, spec: list, with_system: bool, chunk: int
) -> None:
    messages = build(spec, with_system)
    assert openai_valid(messages)
    compactor = Compactor(tokenizer, FakeBackend(), context_window=8192, block_size=16)
    for keep in keep_values(tokenizer, messages):
        try:
            out = await compactor.compact(messages, {"chunk_tokens": chunk, "keep_recent_tokens": keep})
        except InvalidInput as exc:  # the kept tail would be the whole history, or the result not shorter
            shorter = isinstance(exc, NothingToCompact) and exc.field == "messages"
            assert exc.field == "keep_recent_tokens" or shorter, exc
            continue
        dumped = [m.model_dump(mode="json") for m in out.messages]
        assert openai_valid(dumped), (keep, dumped)
        assert out.stats.compacted_tokens < out.stats.history_tokens  # never a longer history than was sent
        tail = dumped[1 + with_system :]
        assert tail == (messages[-len(tail) :] if tail else [])  # the kept tail is a verbatim suffix


async def test_coding_trace_compacts_to_a_valid_history(tokenizer: ChatTokenizer) -> None:
    messages = coding_trace(3, 6000, tokenizer).messages
    compactor = Compactor(tokenizer, FakeBackend(), context_window=8192, block_size=16)
    for keep in (0, 500, 1500, 3000):
        out = await compactor.compact(messages, {"chunk_tokens": 512, "keep_recent_tokens": keep})
        dumped = [m.model_dump(mode="json") for m in out.messages]
        assert openai_valid(dumped) and out.stats.compacted_tokens < out.stats.history_tokens
