"""Extractive summaries on the real tokenizer (pure; no engine)."""

from __future__ import annotations

import json
import re
from typing import Any

from compaction.compactor import Compactor
from compaction.extractive import (
    CALL_TAG,
    Line,
    candidate_lines,
    extract,
    render_lines,
    segments,
    select,
    weights,
    written,
)
from compaction.history import parse_messages
from compaction.partition import partition
from compaction.render import RenderedHistory, render_history
from compaction.tokenizer import HFChatTokenizer
from jobs.data.conversations import locomo_messages, truncate_history
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


def rendered(tokenizer: HFChatTokenizer, messages: list[dict[str, Any]]) -> RenderedHistory:
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


def history_text(tokenizer: HFChatTokenizer, history: RenderedHistory, start: int, end: int) -> str:
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


# A line of a dialogue made only of greetings, thanks, reactions, compliments and questions (a speaker's name first).
GREETING_ONLY = re.compile(
    r"^(\w+: )?(((hey|hi|hello|thanks|thank you|wow|bye|take care|good to see you|that's|you're|you've|you'd|"
    r"i totally agree)\b[^.!?]*[.!?]+|[^.!?]*\?+)\s*)+$",
    re.IGNORECASE,
)
GREETINGS = ["Hey Caroline! Good to see you!", "Thanks!", "Wow, that's great!", "Bye! Take care",
             "Hey Mel! How have you been?", "Thanks, Melanie! That's really sweet.", "I totally agree, Mel.",
             "You'd be a great counselor!"]  # fmt: skip
FACTS = ["I went to a LGBTQ support group yesterday.", "We're moving to Boston next month.",
         "My brother started at Google in 2022.", "I'm planning to adopt a dog.",
         "I painted that lake sunrise last year!",
         "Researching adoption agencies, it's been a dream to have a family."]  # fmt: skip


def test_greetings_never_outrank_facts_in_a_dialogue(tokenizer: HFChatTokenizer) -> None:
    texts = [text for pair in zip(GREETINGS, FACTS + FACTS[:2], strict=True) for text in pair]
    chat = [
        {"role": "user", "content": f"Caroline: {text}"} if i % 2 else
        {"role": "assistant", "content": f"Melanie: {text}"}
        for i, text in enumerate(texts)
    ]  # fmt: skip
    scores = _scores(tokenizer, chat)
    said = {text.split(": ", 1)[1]: score for text, score in scores.items()}
    assert all(said[text] == 0.0 for text in GREETINGS), said  # the addressee's name (or "Mel") names nothing
    assert all(said[text] >= 1.0 for text in FACTS), said
    assert said["I went to a LGBTQ support group yesterday."] > said["I'm planning to adopt a dog."]  # a time, a name
    history = rendered(tokenizer, coding_history())  # a span with tool calls is no dialogue: weighed as before
    assert weights(segments(history, tokenizer, 0, len(history.token_ids))).speakers == frozenset()


def test_the_demo_conversation_keeps_both_speakers_facts_not_greetings(
    tokenizer: HFChatTokenizer, locomo: list[dict[str, Any]]
) -> None:
    messages = truncate_history(locomo_messages(locomo[0]), tokenizer, 3072)  # as jobs/demo.py's defaults
    history = rendered(tokenizer, messages)
    chunks = partition(history.message_starts[0], len(history.token_ids), 512)
    first = chunks[0]
    for budget in (42, 96):  # the demo's budget per chunk, and room for more lines
        kept = extract(history, tokenizer, first.start, first.end, budget).splitlines()
        assert kept and not [line for line in kept if GREETING_ONLY.match(line.split(": ", 1)[1])], kept
        assert "user: Caroline: I went to a LGBTQ support group yesterday and it was so powerful." in kept
    assert {line.split(": ")[0] for line in kept} == {"user", "assistant"}, kept  # Caroline's and Melanie's
    assert "assistant: Melanie: Yeah, I painted that lake sunrise last year! It's special to me." in kept
    # Ranked over the whole span as `compaction.merge.pin` ranks them: greetings score 0, both speakers on top.
    parts = [segments(history, tokenizer, c.start, c.end) for c in chunks]
    span = weights([part for chunk in parts for part in chunk])
    assert span.speakers == {"caroline", "melanie"}
    lines = [line for chunk in parts for line in candidate_lines(chunk, span)]
    greetings = [line for line in lines if GREETING_ONLY.match(line.text)]
    assert len(greetings) > 10 and all(line.score == 0.0 for line in greetings)
    best = sorted(lines, key=lambda line: -line.score)[:6]
    assert {line.label for line in best} == {"user", "assistant"}
    assert all(line.score >= 2.0 for line in best)


def test_a_line_too_long_for_the_budget_is_cut_before_the_word_it_splits(tokenizer: HFChatTokenizer) -> None:
    row = "North | 2829 | 634.7 | 38128 | 750.0 | 47089 | 492.8"
    lines = [Line(0, "tool", row, 1.0)]
    for budget in range(4, len(tokenizer.encode(f"tool: {row}"))):
        text = select(lines, tokenizer, budget, 4.0)
        assert text and len(tokenizer.encode(text)) <= budget
        assert f"tool: {row}".startswith(text)
        assert all(word in row.split() for word in text.removeprefix("tool: ").split()), text  # no "38" of 38128


def test_a_line_pinned_in_an_earlier_summary_keeps_its_one_label() -> None:
    """A head compacted again holds its pinned lines ("assistant: …") in a user message: not "user: assistant: …"."""
    again = Line(0, "user", "assistant: Decision: use weekly buckets because weekends swing.", 5.0)
    fresh = Line(1, "assistant", "Decision: use weekly buckets because weekends swing.", 5.0)
    assert written(again) == written(fresh) == "assistant: Decision: use weekly buckets because weekends swing."
    assert render_lines([fresh, again]).splitlines() == [written(again)] * 2
