"""Chat-side compaction decisions (pure): the context_management entry, the turn's action, snapshots."""

from __future__ import annotations

from typing import Any

import pytest

from compaction.compactor import Compactor
from compaction.errors import InvalidInput, NothingToCompact
from compaction.history import parse_messages
from compaction.tokenizer import ChatTokenizer
from compaction.turn_policy import (
    ContextManagement,
    Snapshot,
    check_window,
    decide,
    message_digests,
    parse_context_management,
    spliced,
)
from tests.fakes import ChatMLTokenizer, FakeBackend

ENTRY = {"type": "compaction", "compact_threshold": 6000}


@pytest.fixture(scope="module")
def tokenizer(chat_tokenizer: ChatMLTokenizer) -> ChatMLTokenizer:
    return chat_tokenizer


def entry(**fields: Any) -> ContextManagement:
    parsed = parse_context_management([{**ENTRY, **fields}])
    assert parsed is not None
    return parsed


def test_absent_or_empty_means_no_compaction() -> None:
    assert parse_context_management(None) is None and parse_context_management([]) is None


def test_defaults_follow_the_thresholds() -> None:
    plain = entry()
    assert plain.keep_recent_tokens == 1500 and plain.carry_summary_tokens == 1500 and plain.keep_current_turn
    assert entry(background_threshold=2000).keep_recent_tokens == 500
    rolling = entry(background_threshold=1000, apply_background="rolling")  # τ's compaction is blocking's: its window
    assert rolling.keep_recent_tokens == entry().keep_recent_tokens == 1500
    with pytest.raises(InvalidInput, match="keep_recent_tokens"):
        entry(background_threshold=1000, keep_recent_tokens=1500)  # a snapshot's result must fit under 1000
    with pytest.raises(InvalidInput, match="compact_threshold"):
        entry(background_threshold=1000, apply_background="rolling", keep_recent_tokens=6000)  # τ's must fit
    assert entry(keep_recent_tokens=0).keep_recent_tokens == 0
    options = entry(chunk_tokens=512, variant="concise").options()
    assert options.chunk_tokens == 512 and options.variant == "concise" and options.keep_current_turn


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"compaction": 1}, "context_management"),
        ([{"type": "summarise", "compact_threshold": 6000}], "context_management[0].type"),
        (["compaction"], "context_management[0].type"),
        ([{"type": "compaction", "compact_threshold": "lots"}], "context_management[0].compact_threshold"),
        ([{"type": "compaction", "compact_threshold": 6000.5}], "context_management[0].compact_threshold"),
        ([{"type": "compaction"}], "context_management[0].compact_threshold"),
        ([{**ENTRY, "background_threshold": 6000}], "context_management[0].background_threshold"),
        ([{**ENTRY, "keep_recent_tokens": 7000}], "context_management[0].compact_threshold"),
        (
            [{**ENTRY, "background_threshold": 3000, "keep_recent_tokens": 3500}],
            "context_management[0].background_threshold",
        ),
        ([{**ENTRY, "chunk_tokens": -5}], "context_management[0].chunk_tokens"),
        ([{**ENTRY, "layout": "diagonal"}], "context_management[0].layout"),
        ([{**ENTRY, "compact": True}], "context_management[0].compact"),
        ([ENTRY, ENTRY], "context_management[1]"),
    ],
)
def test_bad_entries_name_their_field(raw: Any, field: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        parse_context_management(raw)
    assert caught.value.field == field, caught.value


def test_a_threshold_must_leave_room_for_the_reply() -> None:
    check_window(entry(), 8192, 512)
    with pytest.raises(InvalidInput, match="use at most 7680") as caught:
        check_window(entry(compact_threshold=8000), 8192, 512)
    assert caught.value.field == "context_management[0].compact_threshold"


@pytest.mark.parametrize(
    ("tokens", "background", "session", "action"),
    [
        (3000, "absent", True, "none"),
        (5000, "absent", True, "start_background"),
        (5000, "absent", False, "none"),  # no session: nowhere to keep the result
        (5000, "running", True, "none"),
        (5000, "done", True, "apply"),  # a finished run is applied at the next turn: no wait, a shorter prompt
        (5000, "failed", True, "none"),  # a failed background run is not retried before the threshold
        (7000, "done", True, "apply"),
        (7000, "running", True, "wait"),
        (7000, "failed", True, "compact"),
        (7000, "absent", True, "compact"),
    ],
)
def test_the_turns_action(tokens: int, background: Any, session: bool, action: str) -> None:
    assert decide(tokens, entry(background_threshold=4000), background, session) == action


def test_a_finished_run_can_wait_for_the_hard_threshold() -> None:
    late = entry(background_threshold=4000, apply_background="threshold")
    assert decide(5000, late, "done", True) == "none"
    assert decide(7000, late, "done", True) == "apply"


def test_a_turn_that_would_put_the_next_past_the_threshold_starts_the_background_run() -> None:
    soft = entry(background_threshold=4000)
    assert decide(3000, soft, "absent", True, growth=2900) == "none"
    assert decide(3000, soft, "absent", True, growth=3001) == "start_background"  # 3000 + 3001 > 6000
    assert decide(3000, soft, "running", True, growth=3001) == "none"
    assert decide(3000, entry(), "absent", True, growth=3001) == "none"  # background is opt-in


def test_a_back_to_back_agent_gets_no_background_run() -> None:
    soft = entry(background_threshold=4000)
    assert decide(5000, soft, "absent", True, idle_s=0.01) == "none"  # no idle time to run it in
    assert decide(5000, soft, "absent", True, idle_s=0.5) == "start_background"
    assert decide(5000, soft, "absent", True, idle_s=None) == "start_background"  # not measured yet
    assert decide(7000, soft, "absent", True, idle_s=0.01) == "compact"  # it compacts blocking at the threshold
    assert decide(5000, entry(background_threshold=4000, background_min_idle_s=0), "absent", True, idle_s=0.0) == (
        "start_background"
    )


def test_without_background_threshold_only_blocking_compaction() -> None:
    assert decide(5999, entry(), "absent", True) == "none"
    assert decide(6001, entry(), "absent", True) == "compact"


def test_a_snapshot_covers_the_histories_that_grow_from_it() -> None:
    history = parse_messages([{"role": "user", "content": f"m{i}"} for i in range(6)])
    snap = Snapshot.of(message_digests(history[:4]))
    assert snap.covers(message_digests(history)) and snap.covers(message_digests(history[:4]))
    assert not snap.covers(message_digests(history[:3]))
    edited = [*history[:2], parse_messages([{"role": "user", "content": "changed"}])[0], *history[3:]]
    assert not snap.covers(message_digests(edited))
    # null fields do not change a message's identity
    assert message_digests(parse_messages([{"role": "user", "content": "m0", "name": None}])) == message_digests(
        history[:1]
    )
    head = parse_messages([{"role": "user", "content": "summary"}])
    assert [m.content for m in spliced(head, 3, history)] == ["summary", "m3", "m4", "m5"]


def test_the_current_turn_is_never_summarised(tokenizer: ChatTokenizer) -> None:
    compactor = Compactor(tokenizer, FakeBackend(), context_window=8192, block_size=16)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "sys"}]
    for i in range(10):
        messages += [{"role": "user", "content": f"question {i} " * 20}, {"role": "assistant", "content": "ok " * 20}]
    messages += [{"role": "user", "content": "now fix the bug"}]
    messages += [{"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "function": {"name": "ls"}}]}]
    messages += [{"role": "tool", "tool_call_id": "c1", "content": "a.py b.py"}]
    plan = compactor.plan(messages, {"chunk_tokens": 128, "keep_current_turn": True})
    assert plan.kept_tail_from == len(messages) - 3  # the last user message and what follows it
    assert compactor.plan(messages, {"chunk_tokens": 128}).kept_tail_from == len(messages)
    with pytest.raises(NothingToCompact):
        compactor.plan(messages[:1] + messages[-3:], {"keep_current_turn": True})


def test_rolling_compacts_at_the_threshold_as_blocking_would_and_rolls_on_each_new_chunk() -> None:
    rolling = entry(compact_threshold=4000, background_threshold=2000, chunk_tokens=512, apply_background="rolling")
    # Past the threshold: a finished run is never spliced; the turn compacts (taking its summaries from the cache).
    assert decide(4100, rolling, "done", True) == "compact"
    assert decide(4100, rolling, "failed", True) == "compact"
    assert decide(4100, rolling, "running", True) == "wait"
    # Below it: one run at a time, a new one once a whole chunk's worth of history has become final since the last.
    assert decide(2100, rolling, "absent", True) == "start_background"
    assert decide(2600, rolling, "running", True, fresh=600) == "none"
    assert decide(2600, rolling, "done", True, fresh=500) == "none"
    assert decide(2700, rolling, "done", True, fresh=600) == "start_background"
    assert decide(2700, rolling, "failed", True, fresh=600) == "start_background"
    # The last turn before the threshold rolls whatever became final, so that turn's chunks are ready at it.
    assert decide(3700, rolling, "done", True, growth=400, fresh=100) == "start_background"
    assert decide(3700, rolling, "done", True, growth=400, fresh=0) == "none"
    assert decide(3300, rolling, "done", True, growth=400, fresh=100) == "none"
    assert decide(3500, rolling, "done", True, growth=400, fresh=100) == "start_background"  # 3500 + 1.5 x 400
    # It starts beside a run still in flight (joining its chunks), another last turn's too: this turn's own history
    # would otherwise be summarised at the threshold.
    assert decide(3700, rolling, "running", True, growth=400, fresh=100) == "start_background"
    assert decide(3700, rolling, "running", True, growth=400, fresh=0) == "none"
    # An agent with short idle times rolls only there (that run is the threshold's own work); one back to back never.
    assert decide(2700, rolling, "done", True, growth=400, idle_s=0.2, fresh=600) == "none"
    assert decide(3700, rolling, "done", True, growth=400, idle_s=0.2, fresh=100) == "start_background"
    assert decide(3700, rolling, "done", True, growth=400, idle_s=0.01, fresh=100) == "none"
    assert decide(1900, rolling, "absent", True) == "none" and decide(2100, rolling, "absent", False) == "none"
