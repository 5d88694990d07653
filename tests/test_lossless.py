"""The clearing tier (`compaction.clearing`) and what the merge writes around it: pure, a fake backend."""

from __future__ import annotations

import json

import pytest

from compaction.archive import handle_of
from compaction.checks.omission import REPAIRED_HEADER, handles_in
from compaction.clearing import MIN_CLEARED_TOKENS, STUB, key_line, stub, summary_room
from compaction.compactor import Compactor
from compaction.history import Message, parse_messages
from compaction.ledger import LEDGER_HEADER, derive, parse
from compaction.merge import USER_WORDS_HEADER, carried_words
from compaction.options import CompactionOptions
from compaction.plan import SUMMARY_HEADER
from compaction.render import rendered_tokens
from jobs.data.traces import coding_trace
from serving.archive import without_handles
from tests.fakes import ChatMLTokenizer, FakeBackend

WINDOW = 32_768


@pytest.fixture(scope="module")
def tokenizer(chat_tokenizer: ChatMLTokenizer) -> ChatMLTokenizer:
    return chat_tokenizer


@pytest.fixture(scope="module")
def trace(tokenizer: ChatMLTokenizer) -> list[dict]:
    return coding_trace(seed=0, target_tokens=8000, tokenizer=tokenizer).messages


def make(tokenizer: ChatMLTokenizer) -> tuple[Compactor, FakeBackend]:
    backend = FakeBackend()
    return Compactor(tokenizer, backend, context_window=WINDOW), backend


def spliced(result, sent: list[dict]) -> None:
    """The protocol: the result is its head, then what was sent from replaces_through on."""
    sent_messages = parse_messages(sent)
    assert result.messages[: result.kept_head] == sent_messages[: result.kept_head]
    assert result.messages[result.head_messages :] == sent_messages[result.replaces_through :]


async def test_only_clears_every_tool_result_of_the_span_and_asks_no_model(tokenizer, trace) -> None:
    compactor, backend = make(tokenizer)
    options = {"clearing": "only", "keep_recent_tokens": 500}
    result = await compactor.compact(trace, options)
    assert backend.requests == []  # the cheapest tier: no model call
    spliced(result, trace)
    cleared = result.messages[result.kept_head + 1 : result.head_messages]
    tools = [m for m in cleared if m.role == "tool"]

    def saves(text: str) -> int:
        tokens = len(tokenizer.encode(text))
        return tokens - len(tokenizer.encode(stub(text, tokens, None)))

    assert tools and all(m.text().startswith(STUB) or saves(m.text()) < MIN_CLEARED_TOKENS for m in tools)
    assert result.stats.cleared_tool_outputs >= len([m for m in tools if m.text().startswith(STUB)])
    assert result.stats.cleared_tokens > 0
    assert result.stats.compacted_tokens < 0.5 * result.stats.history_tokens
    # the agent's words and the user's stay verbatim, the stub says what it was
    originals = parse_messages(trace)[result.kept_head : result.replaces_through]
    assert [m.text() for m in cleared if m.role != "tool"] == [m.text() for m in originals if m.role != "tool"]
    first = next(m.text() for m in tools if m.text().startswith(STUB))
    assert "tokens, it began" in first and "[archived:" not in first  # no archive: no handle to promise


async def test_with_archive_every_stub_carries_the_handle_of_its_original(tokenizer, trace) -> None:
    compactor, _ = make(tokenizer)
    result = await compactor.compact(trace, {"clearing": "only", "keep_recent_tokens": 500, "archive": True})
    archived = {a.handle: a.text for a in result.archived}
    stubs = [m for m in result.messages if m.role == "tool" and m.text().startswith(STUB)]
    assert stubs and set(handles_in(stubs)) <= set(archived)
    by_call = {m.tool_call_id: m.text() for m in parse_messages(trace) if m.role == "tool"}
    for cleared in stubs:
        (handle,) = handles_in([cleared])
        assert archived[handle] == by_call[cleared.tool_call_id] and handle == handle_of(by_call[cleared.tool_call_id])
    assert result.stats.archived_handles == list(archived)
    # an archive that could not store: no stub promises a handle
    bare = without_handles(result, "full")
    assert handles_in(bare.messages) == () and bare.stats.archive_note == "full"
    assert [m.text().split(" [archived")[0] for m in bare.messages] == [
        m.text().split(" [archived")[0] for m in result.messages
    ]


async def test_auto_clears_the_newest_turns_within_the_room_of_summaries_and_summarises_the_rest(
    tokenizer, trace
) -> None:
    compactor, backend = make(tokenizer)
    base = {"keep_recent_tokens": 500, "chunk_tokens": 1024}
    off = await compactor.compact(trace, {**base, "max_chunk_summary_tokens": 128})
    everything = await compactor.compact(trace, {**base, "max_chunk_summary_tokens": 600, "clearing": "auto"})
    assert everything.stats.chunks == 0 and everything.head_messages == everything.replaces_through + 1
    tight = await compactor.compact(trace, {**base, "max_chunk_summary_tokens": 128, "clearing": "auto"})
    assert tight.stats.cleared_tool_outputs == 0 and tight.head_messages == tight.kept_head + 1  # summaries only
    # in between: the older turns summarised, the newest cleared, no larger than summaries of it all
    for budget in range(128, 600, 8):
        sent = len(backend.requests)
        mid = await compactor.compact(trace, {**base, "max_chunk_summary_tokens": budget, "clearing": "auto"})
        if mid.stats.chunks and mid.stats.cleared_tool_outputs:
            break
    assert 0 < mid.stats.chunks < off.stats.chunks and len(backend.requests) - sent == mid.stats.chunks
    assert mid.stats.cleared_tool_outputs > 0 and mid.head_messages > mid.kept_head + 1
    assert mid.messages[mid.kept_head + 1].role != "tool"  # the cleared turns start on a turn
    spliced(mid, trace)
    span = mid.stats.input_tokens  # tokens summarised
    cleared = rendered_tokens(mid.messages[mid.kept_head + 1 : mid.head_messages], tokenizer)
    options = CompactionOptions.parse({**base, "max_chunk_summary_tokens": budget})
    assert cleared + summary_room(span, options) <= summary_room(off.stats.input_tokens, options) + 64
    assert budget > 128  # the smallest budget summarised it all


async def test_a_tool_result_marked_to_keep_and_short_ones_stay(tokenizer) -> None:
    long = "line of output\n" * 200
    messages = [
        {"role": "system", "content": "agent"},
        {"role": "user", "content": "Run it."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "run", "arguments": "{}"}},
            {"id": "b", "type": "function", "function": {"name": "run", "arguments": "{}"}},
            {"id": "c", "type": "function", "function": {"name": "run", "arguments": "{}"}},
        ]},
        {"role": "tool", "tool_call_id": "a", "content": long, "keep": True},
        {"role": "tool", "tool_call_id": "b", "content": "ok"},
        {"role": "tool", "tool_call_id": "c", "content": long},
        {"role": "user", "content": "Next."},
    ]  # fmt: skip
    compactor, _ = make(tokenizer)
    result = await compactor.compact(messages, {"clearing": "only", "keep_recent_tokens": 4})
    texts = {m.tool_call_id: m.text() for m in result.messages if m.role == "tool"}
    assert texts["a"] == long and texts["b"] == "ok" and texts["c"].startswith(STUB)
    assert result.stats.cleared_tool_outputs == 1


async def test_long_tool_call_arguments_are_cleared_and_the_path_stays(tokenizer) -> None:
    old, new = "x = 1\n" * 200, "x = 2\n" * 200
    arguments = json.dumps({"path": "src/app/core.py", "old": old, "new": new})
    messages = [
        {"role": "user", "content": "Fix it."},
        {"role": "assistant", "content": "Editing.", "tool_calls": [
            {"id": "e", "type": "function", "function": {"name": "edit_file", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "e", "content": "Applied 1 edit to src/app/core.py"},
        {"role": "user", "content": "Thanks, now the docs."},
    ]  # fmt: skip
    compactor, _ = make(tokenizer)
    result = await compactor.compact(messages, {"clearing": "only", "keep_recent_tokens": 4, "archive": True})
    call = next(m for m in result.messages if m.tool_calls).tool_calls[0]
    kept = json.loads(call.function.arguments)
    assert kept["path"] == "src/app/core.py" and kept["old"].startswith("[cleared: 1200 chars")
    (original,) = [a for a in result.archived if a.handle in kept["new"] or a.handle in kept["old"]]
    assert original.text == f"edit_file({arguments})"


async def test_nothing_long_to_clear_leaves_the_summaries_alone(tokenizer) -> None:
    compactor, backend = make(tokenizer)
    chat = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"Message {i} about trip {i}."} for i in range(60)
    ]
    result = await compactor.compact(chat, {"clearing": "auto", "chunk_tokens": 256})
    assert result.stats.cleared_tool_outputs == 0 and backend.requests
    assert result.head_messages == result.kept_head + 1


def test_the_users_words_of_an_earlier_head_are_read_back() -> None:
    head = f"{SUMMARY_HEADER}\nThey met.\n\n{USER_WORDS_HEADER}\n- Never push to main.\n- Two lines:\nsecond line"
    assert carried_words(head) == ["Never push to main.", "Two lines:\nsecond line"]
    assert carried_words("no block here") == []


async def test_an_earlier_heads_handles_and_user_words_survive_its_summary(tokenizer) -> None:
    handle = handle_of("the original chunk")
    earlier = (
        f"{SUMMARY_HEADER}\nWe set up the build. [archived: {handle}]\n\n{USER_WORDS_HEADER}\n- Never push to main."
    )
    messages = [{"role": "system", "content": "agent"}, {"role": "user", "content": earlier}]
    messages += [{"role": "assistant", "content": f"Module m{i} looks fine: {i} checks passed."} for i in range(80)]
    messages.append({"role": "user", "content": "Go on."})
    compactor, _ = make(tokenizer)  # the fake's summary drops the handle
    result = await compactor.compact(messages, {"carry_summary_tokens": 0, "chunk_tokens": 256, "pinned_share": 0})
    head = result.messages[result.kept_head].text()
    assert REPAIRED_HEADER in head and f"[archived: {handle}]" in head
    assert result.stats.omissions_repaired == 1
    assert "- Never push to main." in head.split(USER_WORDS_HEADER)[1]  # anchored, not summarised away
    assert isinstance(result.messages[result.kept_head], Message)


def edit(path: str, call: str) -> list[dict]:
    arguments = json.dumps({"path": path, "old": "a", "new": "b"})
    return [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call, "type": "function", "function": {"name": "edit_file", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call, "content": f"Applied 1 edit to {path}."},
    ]  # fmt: skip


async def test_the_ledger_is_written_in_the_head_and_carried_through_a_chain(tokenizer, trace) -> None:
    compactor, _ = make(tokenizer)
    options = {"ledger_tokens": 400, "keep_recent_tokens": 300, "carry_summary_tokens": 0, "chunk_tokens": 1024}
    first = await compactor.compact(trace, options)
    head = first.messages[first.kept_head].text()
    ledger = parse(head)
    assert ledger is not None and LEDGER_HEADER in head
    assert [f.path for f in ledger.files if f.action == "modified"] == ["src/ledgerly/money.py"]
    assert first.stats.ledger_entries == len(ledger.entries()) and 0 < first.stats.ledger_tokens <= 400
    # the agent works on; the next compaction summarises the first head again and updates its ledger
    later = [m.model_dump(exclude_none=True) for m in first.messages]
    later += [{"role": "user", "content": "Also fix the report module."}, *edit("src/ledgerly/report.py", "r1")]
    later += [{"role": "assistant", "content": f"Checked report line {i}: the totals add up."} for i in range(60)]
    later.append({"role": "user", "content": "Go on."})
    second = await compactor.compact(later, options)
    again = parse(second.messages[second.kept_head].text())
    assert again is not None and {f.path for f in again.files if f.action == "modified"} == {
        "src/ledgerly/money.py",
        "src/ledgerly/report.py",
    }
    assert set(ledger.constraints) <= set(again.constraints)  # anchored: never summarised away


async def test_a_constraint_the_ledger_budget_cut_is_pinned_back_by_the_omission_check(tokenizer, trace) -> None:
    compactor = Compactor(
        tokenizer, FakeBackend(script=lambda _: ("The agent looked into the bug.", "stop")), context_window=WINDOW
    )
    options = {"ledger_tokens": 4, "user_words_tokens": 0, "pinned_share": 0, "keep_recent_tokens": 300}
    result = await compactor.compact(trace, options)
    (constraint,) = derive(parse_messages(trace)).constraints
    head = result.messages[result.kept_head].text()
    assert result.stats.ledger_entries == 0 and result.stats.omissions_repaired == 1
    assert REPAIRED_HEADER in head and f"- {constraint}" in head.split(REPAIRED_HEADER)[1]


def test_a_stub_quotes_the_line_that_names_the_most() -> None:
    output = "Scanning CI runs...\n" + "\n".join("run ok" for _ in range(30)) + "\nquarantined: 37 flaky tests\ndone"
    kept = stub(output, 200, "arc-" + "0" * 24)
    assert kept.startswith(f'{STUB}: 200 tokens, it began "Scanning CI runs..."')
    assert 'it held "quarantined: 37 flaky tests"' in kept and kept.endswith("[archived: arc-" + "0" * 24 + "]")
    assert key_line("all fine\nnothing here") == "" and "it held" not in stub("all fine\nnothing here", 60, None)


async def test_a_conversation_without_tool_calls_gets_no_ledger(tokenizer) -> None:
    chat = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"I always visit city {i} because of its food."}
            for i in range(60)]  # fmt: skip
    compactor, _ = make(tokenizer)
    result = await compactor.compact(chat, {"ledger_tokens": 500, "chunk_tokens": 256, "user_words_tokens": 0})
    assert result.stats.ledger_entries == 0 and LEDGER_HEADER not in result.messages[result.kept_head].text()
