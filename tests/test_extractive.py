"""Extractive summaries on the real tokenizer (pure; no engine)."""

from __future__ import annotations

import json
from typing import Any

from compaction.compactor import Compactor
from compaction.extractive import CALL_TAG, candidate_lines, extract, segments
from compaction.history import parse_messages
from compaction.render import render_history
from compaction.tokenizer import HFChatTokenizer
from tests.fakes import FakeBackend

NOISE = [f"line {i} of the module body, nothing to see here" for i in range(30)]


def coding_history() -> list[dict[str, Any]]:
    function = {"name": "run", "arguments": json.dumps({"cmd": "make ci"})}
    call = {"id": "call_1", "type": "function", "function": function}
    return [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Please fix the date parser.\nNever edit the migrations/ folder.\nthanks a lot"},
        {"role": "assistant", "content": "Sure, running the suite first.", "tool_calls": [call]},
        {
            "role": "tool",
            "tool_call_id": "call_1",
            "content": "collected 120 items\n"
            + "\n".join(NOISE)
            + "\nFAILED tests/test_dates.py::test_parse_iso - ValueError: month must be in 1..12",
        },
        {
            "role": "assistant",
            "content": "ok\nThe root cause is an off-by-one month in src/dates.py, so I will fix it.",
        },
        {"role": "user", "content": "sounds good\n" + "\n".join(NOISE[:10])},
    ]


def rendered(tokenizer: HFChatTokenizer, messages: list[dict[str, Any]]):
    return render_history(parse_messages(messages), tokenizer)


def test_keeps_the_salient_lines_in_order_verbatim_within_budget(tokenizer: HFChatTokenizer) -> None:
    history = rendered(tokenizer, coding_history())
    start, end = history.message_starts[1], len(history.token_ids)
    text = extract(history, tokenizer, start, end, budget=80)
    assert len(tokenizer.encode(text)) <= 80
    assert text.splitlines() == [
        "user: Please fix the date parser.",
        "user: Never edit the migrations/ folder.",
        "tool: FAILED tests/test_dates.py::test_parse_iso - ValueError: month must be in 1..12",
        "assistant: The root cause is an off-by-one month in src/dates.py, so I will fix it.",
    ]
    wider = extract(history, tokenizer, start, end, budget=130).splitlines()
    assert len(wider) > 4 and set(text.splitlines()) < set(wider)
    assert 'assistant: [tool call call_1] run({"cmd": "make ci"})' in wider
    assert not any("nothing to see here" in line or line == "assistant: ok" for line in wider)


def test_a_smaller_budget_keeps_the_best_lines(tokenizer: HFChatTokenizer) -> None:
    history = rendered(tokenizer, coding_history())
    text = extract(history, tokenizer, history.message_starts[1], len(history.token_ids), budget=40)
    assert len(tokenizer.encode(text)) <= 40
    assert text.splitlines() == [
        "user: Please fix the date parser.",
        "assistant: The root cause is an off-by-one month in src/dates.py, so I will fix it.",
    ]


def _scores(tokenizer: HFChatTokenizer, messages: list[dict[str, Any]]) -> dict[str, float]:
    history = rendered(tokenizer, messages)
    lines = candidate_lines(segments(history, tokenizer, 0, len(history.token_ids)))
    return {CALL_TAG.sub("", line.text).strip(): line.score for line in lines}


def _call(i: int, command: str) -> dict[str, Any]:
    function = {"name": "run_command", "arguments": json.dumps({"command": command})}
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": f"c{i}", "type": "function", "function": function}],
    }


def test_a_call_whose_result_fails_outweighs_one_whose_result_passes(tokenizer: HFChatTokenizer) -> None:
    messages = [
        _call(1, "pytest tests/test_a.py -q"),
        {"role": "tool", "tool_call_id": "c1", "content": "3 passed in 0.2s"},
        _call(2, "pytest tests/test_b.py -k caps"),
        {"role": "tool", "tool_call_id": "c2", "content": "FAILED tests/test_b.py::test_caps - AssertionError"},
    ]
    scores = _scores(tokenizer, messages)
    failing = scores['run_command({"command": "pytest tests/test_b.py -k caps"})']
    assert failing >= scores['run_command({"command": "pytest tests/test_a.py -q"})'] + 4


def test_vague_lines_routine_lines_and_everyones_names_weigh_little(tokenizer: HFChatTokenizer) -> None:
    filler = ["Sure thing.", "Sounds lovely.", "Oh, really?", "Tell me more.", "That is so kind.", "Wow, nice.",
              "Good luck then.", "Talk soon."]  # fmt: skip
    texts = [
        "I'll do my best to make sure it works out.",
        filler[0],
        "I moved here from Sweden 4 years ago.",
        *filler[1:],
    ]
    chat = [
        {"role": "user" if i % 2 else "assistant", "content": f"Caroline: Melanie, {text}"}
        for i, text in enumerate(texts)
    ]
    scores = _scores(tokenizer, chat)
    assert (
        scores["Caroline: Melanie, I moved here from Sweden 4 years ago."]
        > scores["Caroline: Melanie, I'll do my best to make sure it works out."]
    )  # a fact outranks a promise that names nothing; the two names are on every line
    listing = [
        _call(1, "ls"),
        {"role": "tool", "tool_call_id": "c1", "content": "\n".join(f"saved plots/p_{i}.png" for i in range(16))},
        {"role": "user", "content": "Never edit the migrations folder."},
    ]
    scores = _scores(tokenizer, listing)
    assert scores["saved plots/p_3.png"] < scores["Never edit the migrations folder."] - 3  # routine vs an order


def test_a_border_inside_a_message_decodes_only_its_part(tokenizer: HFChatTokenizer) -> None:
    history = rendered(tokenizer, coding_history())
    tool = history.message_starts[3]
    middle = tool + 60
    before, after = segments(history, tokenizer, 0, middle), segments(history, tokenizer, middle, middle + 400)
    assert [s.message for s in before][-1] == 3 and before[-1].opens_message
    assert before[-1].text.startswith("[tool result call_1] collected 120 items")  # no "user" header line
    assert after[0].message == 3 and not after[0].opens_message
    assert before[-1].text.strip()[-10:] in history_text(tokenizer, history, tool, middle)


def test_a_border_never_leaves_half_a_word(tokenizer: HFChatTokenizer) -> None:
    messages = [{"role": "user", "content": "    return retry_out_of_budget_total + 1"}]
    history = render_history(parse_messages(messages), tokenizer)
    ids = history.token_ids
    words = {"return", "retry_out_of_budget_total", "+", "1"}
    for border in range(history.message_starts[0] + 3, len(ids) - 2):
        for part in (segments(history, tokenizer, 0, border)[-1], segments(history, tokenizer, border, len(ids))[0]):
            assert set(part.text.split()) <= words, (border, part.text)


def history_text(tokenizer: HFChatTokenizer, history, start: int, end: int) -> str:
    return tokenizer.decode(history.token_ids[start:end])


async def test_strategy_extractive_calls_no_model_and_fits_any_window(tokenizer: HFChatTokenizer) -> None:
    backend = FakeBackend()
    messages = coding_history() * 6  # over the window for any model-based prompt
    compactor = Compactor(tokenizer, backend, context_window=512, block_size=16)
    options = {"strategy": "extractive", "chunk_tokens": 256, "max_chunk_summary_tokens": 48}
    plan = compactor.plan(messages, options)
    assert plan.prompts == () and len(plan.chunks) > 3
    result = await compactor.compact(messages, options)
    stats = result.stats
    assert not backend.requests
    assert stats.layout == "extractive" and stats.chunks == len(plan.chunks)
    assert stats.prompt_tokens == stats.output_tokens == stats.computed_prefill_tokens == 0
    assert {c.status for c in stats.per_chunk} == {"extractive"}
    assert all(c.summary_tokens <= 48 and c.grounding == 1.0 and c.first_grounding is None for c in stats.per_chunk)
    assert stats.compacted_tokens < stats.history_tokens
    assert "FAILED tests/test_dates.py::test_parse_iso" in result.summary
