"""The chain-of-compactions sessions: canaries of every kind, unique checks, appendable rounds, size, tool share."""

from __future__ import annotations

import json
from typing import Any

import pytest

from compaction.checks.validity import check_history, problems
from compaction.history import parse_messages, template_view
from jobs.data.canaries import (
    KINDS,
    LATER,
    Canary,
    ChainSession,
    SessionKind,
    invented,
    session_text,
    survives,
)
from jobs.data.canary_sessions import chain_session
from jobs.data.traces import TokenCounter

SESSION_KINDS: tuple[SessionKind, ...] = ("coding", "analysis")
CASES = [(kind, seed) for kind in SESSION_KINDS for seed in range(6)]


def span(chain: ChainSession, canary: Canary) -> list[dict[str, Any]]:
    """The session up to the last round the canary is current in."""
    last = len(chain.rounds) + 1 if canary.superseded_in is None else canary.superseded_in - 1
    return chain.through(last)


def tool_name(message: dict[str, Any]) -> str:
    (call,) = message["tool_calls"]
    return str(call["function"]["name"])


@pytest.mark.parametrize("kind", SESSION_KINDS)
def test_deterministic_per_seed_and_different_across_seeds(kind: SessionKind) -> None:
    assert chain_session(kind, 3) == chain_session(kind, 3)
    assert chain_session(kind, 3).messages != chain_session(kind, 4).messages


@pytest.mark.parametrize(("kind", "seed"), CASES)
def test_round_one_plants_every_kind_where_an_agent_session_states_it(kind: SessionKind, seed: int) -> None:
    chain = chain_session(kind, seed)
    first = [c for c in chain.canaries if c.round == 1]
    assert sorted(c.kind for c in first) == sorted(KINDS)
    assert all(c.message_index < len(chain.system_and_first) for c in first)
    messages = chain.messages
    for canary in chain.canaries:
        message = messages[canary.message_index]
        if canary.kind in ("safety_rule", "constraint"):
            assert message["role"] == "user"
        elif canary.kind == "fact":
            assert message["role"] == "tool" and canary.text in message["content"]
        elif canary.kind == "file_modified":
            assert tool_name(message) == "edit_file"
            assert json.loads(message["tool_calls"][0]["function"]["arguments"])["path"] == canary.text
            assert messages[canary.message_index + 1]["content"].startswith("Applied 1 edit")
        elif canary.kind == "task_status":
            assert tool_name(message) == "update_plan"
            step, status = canary.checks
            plan = json.loads(message["tool_calls"][0]["function"]["arguments"])["plan"]
            assert {"step": step, "status": status} in plan and status in ("in_progress", "completed")
        else:
            prefix = "Decision: use " if canary.kind == "decision" else "Next step: "
            assert message["role"] == "assistant" and not message.get("tool_calls")
            assert message["content"].startswith(prefix)
        assert canary.kind != "decision" or (len(canary.checks) == 2 and " because " in canary.text)
    later = sorted((c.round, c.kind) for c in chain.canaries if c.round > 1)
    assert later == sorted((r, k) for r, kinds in LATER.items() for k in kinds)
    assert sorted(c.message_index for c in chain.canaries) == [c.message_index for c in chain.canaries]


@pytest.mark.parametrize(("kind", "seed"), CASES)
def test_each_check_occurs_only_in_its_canarys_message(kind: SessionKind, seed: int) -> None:
    chain = chain_session(kind, seed)
    texts = [template_view(m)["content"] for m in parse_messages(chain.messages)]
    lowered = [" ".join(t.lower().split()) for t in texts]
    for canary in chain.canaries:
        assert canary.text in texts[canary.message_index] and canary.checks
        allowed = {canary.message_index}
        if canary.kind == "task_status":  # the plan re-states the step with its other status
            allowed |= {c.message_index for c in chain.canaries if c.checks[0] == canary.checks[0]}
        for check in canary.checks:
            holders = {i for i, text in enumerate(lowered) if check.lower() in text}
            assert canary.message_index in holders and holders <= allowed, (canary, check, holders)


@pytest.mark.parametrize(("kind", "seed"), CASES)
def test_a_canary_survives_with_its_message_and_not_without_it(kind: SessionKind, seed: int) -> None:
    chain = chain_session(kind, seed)
    for canary in chain.canaries:
        messages = span(chain, canary)
        assert survives(canary, session_text(messages))
        assert not survives(
            canary, session_text(messages[: canary.message_index] + messages[canary.message_index + 1 :])
        )


def test_a_plan_step_marked_completed_supersedes_its_older_status() -> None:
    chain = chain_session("coding", 0)
    older, newer = [c for c in chain.canaries if c.kind == "task_status"]
    assert (older.round, older.superseded_in, older.checks[1]) == (1, 2, "in_progress")
    assert (newer.round, newer.superseded_in, newer.checks) == (2, None, (older.checks[0], "completed"))
    assert older in chain.current(1) and newer not in chain.current(1)
    assert newer in chain.current(5) and older not in chain.current(5)
    assert sorted(c.kind for c in chain.current(1)) == sorted(KINDS)
    assert [c for c in chain.current(5) if c.round == 1 and c.kind == "task_status"] == []
    assert len(chain.current(5)) == len(chain.canaries) - 1


@pytest.mark.parametrize(("kind", "seed"), CASES)
def test_rounds_append_validly_after_a_compacted_history(kind: SessionKind, seed: int) -> None:
    chain = chain_session(kind, seed)
    assert len(chain.rounds) == 4 and chain.system_and_first[0]["role"] == "system"
    assert chain.system_and_first[1]["role"] == "user" and chain.system_and_first[-1]["role"] == "assistant"
    check_history(parse_messages(chain.system_and_first + [m for r in chain.rounds for m in r]))
    compacted = [chain.system_and_first[0], {"role": "assistant", "content": "Summary of the work so far."}]
    for messages in chain.rounds:
        assert messages[0]["role"] == "user" and messages[-1]["role"] == "assistant"
        assert problems(parse_messages(messages)) == []
        check_history(parse_messages(compacted + messages))
    names = {f["function"]["name"] for f in chain.tools}
    called = {c["function"]["name"] for m in chain.messages for c in m.get("tool_calls") or []}
    assert called <= names and "update_plan" in names


@pytest.mark.parametrize(("kind", "seed"), CASES)
def test_tool_output_is_most_of_every_round(kind: SessionKind, seed: int) -> None:
    chain = chain_session(kind, seed)
    for messages in [chain.system_and_first[1:], *chain.rounds]:
        sizes = [(m.role, len(template_view(m)["content"])) for m in parse_messages(messages)]
        share = sum(n for role, n in sizes if role == "tool") / sum(n for _, n in sizes)
        assert share >= 0.6


@pytest.mark.parametrize("kind", SESSION_KINDS)
@pytest.mark.parametrize("tokens", [1500, 3000, 6000])
def test_each_round_holds_about_tokens_per_round(kind: SessionKind, tokens: int) -> None:
    for seed in range(3):
        chain = chain_session(kind, seed, tokens_per_round=tokens)
        count, before = TokenCounter(None, chain.system_and_first[0]), 0
        for round in range(1, len(chain.rounds) + 2):
            total = count(chain.through(round))
            assert 0.75 * tokens <= total - before <= 1.25 * tokens
            before = total


def test_the_number_of_rounds_is_free() -> None:
    one = chain_session("analysis", 1, rounds=1)
    assert one.rounds == [] and sorted(c.kind for c in one.canaries) == sorted(KINDS)
    assert one.system_and_first == chain_session("analysis", 1, rounds=7).system_and_first
    seven = chain_session("analysis", 1, rounds=7)
    assert len(seven.rounds) == 6 and max(c.round for c in seven.canaries) == max(LATER)
    with pytest.raises(ValueError):
        chain_session("coding", 0, rounds=0)


def test_survives_ignores_case_and_white_space_but_not_word_boundaries() -> None:
    rule = Canary("safety_rule", 1, ("git push --force",), 1, "Never run `git push --force` to the main branch.")
    assert survives(rule, "The user forbids GIT  push\n--force on main.")
    assert not survives(rule, "The user forbids git push on main.")
    both = Canary("decision", 1, ("pytest.approx", "ARM runners"), 5, "Decision: use pytest.approx ...")
    assert survives(both, "Chose pytest.approx (results differ on arm runners).")
    assert not survives(both, "Chose pytest.approx.")
    assert not survives(Canary("safety_rule", 1, ("DELETE",), 1, "Never run DELETE."), "Rows were deleted.")


def test_invented_lists_what_a_summary_made_up() -> None:
    chain = chain_session("coding", 0)
    original = session_text(chain.messages)
    summary = "The agent edited tests/conftest.py for the GolfBridge project and ran mutmut on port 8123."
    assert invented(summary, original) == ["golfbridge", "8123"]
    assert invented(session_text(chain.rounds[-1]), original) == []
