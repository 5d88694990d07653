"""The coding-agent trace generator: structure, planted facts, size, determinism, CLI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from compaction.checks.validity import problems
from compaction.history import parse_messages, template_view
from compaction.render import render_history
from compaction.tokenizer import HFChatTokenizer
from jobs.data.conversations import load_conversation, truncate_history
from jobs.data.traces import QUESTIONS, coding_trace, main


def tool_structure_ok(messages: list[dict[str, Any]]) -> bool:
    """Every assistant tool_calls turn is followed by exactly its results, in call order."""
    i = 0
    while i < len(messages):
        calls = messages[i].get("tool_calls") or []
        answers = [m.get("tool_call_id") for m in messages[i + 1 : i + 1 + len(calls)]]
        if answers != [c["id"] for c in calls]:
            return False
        if messages[i]["role"] == "tool":  # not consumed by a call before it: an orphan result
            return False
        i += 1 + len(calls)
    return True


@pytest.mark.parametrize("seed", range(12))
def test_every_fact_is_planted_once_in_its_message(seed: int) -> None:
    trace = coding_trace(seed, 4000)
    assert sorted(f.kind for f in trace.facts) == sorted(QUESTIONS)
    texts = [template_view(m)["content"] for m in parse_messages(trace.messages)]
    for fact in trace.facts:
        assert [i for i, t in enumerate(texts) if fact.text in t] == [fact.message_index]
        assert fact.question == QUESTIONS[fact.kind] and fact.text.strip()
    roles = {f.kind: trace.messages[f.message_index]["role"] for f in trace.facts}
    assert roles == {"constraint": "user", "failing_test": "tool", "command": "assistant",
                     "root_cause": "assistant", "fix": "assistant"}  # fmt: skip
    assert trace.messages[0]["role"] == "system" and trace.messages[-1]["role"] == "user"
    assert tool_structure_ok(trace.messages)


def test_sessions_look_like_a_coding_agent() -> None:
    messages = [m for seed in range(4) for m in coding_trace(seed, 8000).messages]
    calls = [m for m in messages if m.get("tool_calls")]
    assert any(m["content"] is None for m in calls) and any(m["content"] for m in calls)
    assert any(len(m["tool_calls"]) > 1 for m in calls)  # parallel tool calls in one turn
    names = {c["function"]["name"] for m in calls for c in m["tool_calls"]}
    assert {"read_file", "search_code", "run_command", "edit_file"} <= names
    assert any(m["role"] == "assistant" and not m.get("tool_calls") for m in messages)  # prose turns
    assert any("def " in m["content"] for m in messages if m["role"] == "tool")  # file dumps


def test_deterministic_per_seed_and_different_across_seeds() -> None:
    assert coding_trace(3, 3000) == coding_trace(3, 3000)
    assert coding_trace(3, 3000).messages != coding_trace(4, 3000).messages


def test_grows_to_about_the_target_in_the_models_tokens(tokenizer: HFChatTokenizer) -> None:
    for target in (3000, 20_000):
        trace = coding_trace(1, target, tokenizer)
        tokens = len(render_history(parse_messages(trace.messages), tokenizer).token_ids)
        assert target <= tokens <= 1.1 * target
        positions = [f.message_index / len(trace.messages) for f in trace.facts]
        assert max(positions) < 0.8  # every fact lies before the session's last fifth


def test_cli_prints_a_history_the_demo_loads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--seed", "2", "--tokens", "2000"]) == 0
    path = tmp_path / "trace.json"
    path.write_text(capsys.readouterr().out)
    assert load_conversation(path) == json.loads(path.read_text())
    assert main(["--seed", "2", "--tokens", "2000", "--with-facts"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["seed"] == 2 and len(data["facts"]) == 5 and data["messages"][0]["role"] == "system"


def test_truncating_a_trace_keeps_calls_with_their_results(tokenizer: HFChatTokenizer) -> None:
    messages = coding_trace(4, 3000, tokenizer).messages
    for limit in range(300, 3000, 97):
        kept = truncate_history(messages, tokenizer, limit)
        assert kept == messages[: len(kept)] and problems(parse_messages(kept)) == []
        assert len(render_history(parse_messages(kept), tokenizer).token_ids) <= limit
