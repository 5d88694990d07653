"""What a compaction keeps for the agent: the user's words, pinned lines, content-chosen tails, no loops (pure)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from compaction.backend import GenerationRequest
from compaction.checks.quality import collapse_repeats, judge, repeated_sentences
from compaction.chunk_content import INSTRUCTIONS, classify
from compaction.chunk_summary import request_id
from compaction.compactor import Compactor
from compaction.errors import InvalidInput, NothingToCompact
from compaction.extractive import segments
from compaction.history import parse_messages
from compaction.merge import USER_WORDS_HEADER, ChunkText, pin
from compaction.merge import keep_user_words as keep
from compaction.pacing import BACKGROUND, Escalation
from compaction.partition import Chunk
from compaction.plan import SUMMARY_HEADER
from compaction.render import render_history
from compaction.tokenizer import ChatTokenizer
from jobs.data.analysis_traces import analysis_trace
from jobs.data.traces import coding_trace
from tests.fakes import PLAIN, ChatMLTokenizer, FakeBackend, HoldingBackend

DEMO_LOOP = "I'm so glad you're doing great. I'm so glad you're doing great too. I'm so glad y"


@pytest.fixture(scope="module")
def tokenizer(chat_tokenizer: ChatMLTokenizer) -> ChatMLTokenizer:
    return chat_tokenizer


def test_a_repeated_sentence_is_a_runaway_even_when_the_summary_stopped() -> None:
    assert repeated_sentences(DEMO_LOOP) == 2  # the last one cut inside a word by max_tokens
    assert judge(DEMO_LOOP, "stop") == "runaway"
    assert collapse_repeats(DEMO_LOOP) == "I'm so glad you're doing great."
    varied = "Caroline went to a support group. Melanie painted a lake. Caroline went to the beach on Monday."
    assert repeated_sentences(varied) == 0 and judge(varied, "stop") == "ok"
    assert judge("Thanks. Thanks. All good.", "stop") == "ok"  # short sentences may repeat


def _rendered(tokenizer: ChatTokenizer, messages: list[dict[str, Any]]) -> Any:
    return render_history(parse_messages(messages), tokenizer)


def test_the_classifier_names_what_a_chunk_holds(tokenizer: ChatTokenizer) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "run", "arguments": "{}"}}
    log = "\n".join(f"2026-01-0{i % 9 + 1} worker {i} heartbeat ok" for i in range(40))
    code = "\n".join(["def load(path):", "    with open(path) as f:", "        return f.read()"] * 12)
    cases = {
        "tool_output": [{"role": "assistant", "content": None, "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": "c1", "content": log}],
        "code": [{"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": "c1", "content": code}],
        "requests": [{"role": "user", "content": "Please keep the API stable and never touch vendor/. " * 6},
                     {"role": "assistant", "content": "Understood."}],
        "dialogue": [{"role": "user", "content": "How was the trip to Lisbon with your sister last week?"},
                     {"role": "assistant", "content": "Wonderful, we walked up to the castle and ate far too much."}],
    }  # fmt: skip
    for kind, messages in cases.items():
        history = _rendered(tokenizer, messages)
        assert classify(history, Chunk(0, 0, len(history.token_ids))) == kind
        assert INSTRUCTIONS[kind]


def test_user_words_keep_the_newest_distinct_messages_in_order(tokenizer: ChatTokenizer) -> None:
    messages = parse_messages(
        [
            {"role": "user", "content": "First: keep Python 3.8 compatibility."},
            {"role": "assistant", "content": "Noted."},
            {"role": "user", "content": "Second request " + "word " * 200},
            {"role": "user", "content": "First: keep Python 3.8 compatibility."},
            {"role": "user", "content": f"{SUMMARY_HEADER}\nan earlier summary"},
            {"role": "user", "content": "Third: add a CHANGELOG entry."},
        ]
    )
    words = keep(messages, tokenizer, 40, lambda m: m.text().startswith(SUMMARY_HEADER))
    # the long one does not fit: it is left to the summary, and the older one is still kept
    assert words.texts == ("First: keep Python 3.8 compatibility.", "Third: add a CHANGELOG entry.")
    assert words.total == 3 and words.dropped == 1 and words.tokens <= 40
    assert words.render().startswith(USER_WORDS_HEADER)
    assert keep(messages, tokenizer, 0, lambda m: False).texts == ()


def test_pinned_lines_fill_what_the_summaries_leave_and_state_nothing_twice(tokenizer: ChatTokenizer) -> None:
    trace = coding_trace(1, 2500, tokenizer)
    history = _rendered(tokenizer, trace.messages)
    end = len(history.token_ids)
    chunks = [Chunk(0, 0, end // 2), Chunk(1, end // 2, end)]
    fact = next(f for f in trace.facts if f.kind == "failing_test")
    summary = f"The agent ran the tests; {fact.text} failed."
    parts = [segments(history, tokenizer, c.start, c.end) for c in chunks]
    texts = [ChunkText(summary, parts[0], chunks[0].size, True), ChunkText("", parts[1], chunks[1].size, True)]
    pinned = pin(texts, tokenizer, 60, elsewhere="")
    assert sum(len(tokenizer.encode(p.text)) for p in pinned) <= 2 * 60 + 2
    assert pinned[0].text.startswith(summary) or pinned[0].dropped_sentences == 1
    everything = "\n".join(p.text for p in pinned)
    assert everything.count(fact.text) == 1  # the summary states it: no line repeats it
    assert all(p.lines > 0 for p in pinned)
    closed = pin([ChunkText("x", parts[0], chunks[0].size, False), texts[1]], tokenizer, 60)
    assert closed[0].text == "x" and closed[0].lines == 0  # nothing is pinned beside a fallback text


def test_a_summary_keeps_its_lines_when_lines_are_pinned_beside_it(tokenizer: ChatTokenizer) -> None:
    """A code block or a list the model wrote stays on its lines: joined into one, "``` 19 passed in 1.8s 2 failed
    ```" would quote what no one wrote."""
    trace = coding_trace(1, 2500, tokenizer)
    history = _rendered(tokenizer, trace.messages)
    parts = segments(history, tokenizer, 0, len(history.token_ids))
    summary = "The agent ran the suite:\n```\n19 passed in 1.89s\n2 failed\n```\n- next: fix the retry cap"
    (pinned,) = pin([ChunkText(summary, parts, len(history.token_ids), True)], tokenizer, 200)
    assert pinned.lines > 0 and pinned.text.startswith(summary)


def test_a_line_naming_what_another_names_is_still_pinned_when_it_says_something_new(
    tokenizer: ChatTokenizer,
) -> None:
    messages = [
        {"role": "user", "content": "Why does test_backoff fail?"},
        {"role": "assistant", "content": "Found it: backoff_delay multiplies before clamping, so the cap is exceeded."},
        {"role": "assistant", "content": "The plan: clamp the exponent before multiplying in backoff_delay."},
        {"role": "assistant", "content": "Again: backoff_delay multiplies before clamping, so the cap is exceeded!"},
    ]  # fmt: skip
    history = _rendered(tokenizer, messages)
    parts = segments(history, tokenizer, 0, len(history.token_ids))
    (pinned,) = pin([ChunkText("", parts, len(history.token_ids), True)], tokenizer, 80)
    assert "clamp the exponent before multiplying in backoff_delay" in pinned.text  # same name, another fact
    assert pinned.text.count("multiplies before clamping") == 1  # the same fact twice: once


async def test_a_compaction_keeps_the_users_words_and_pins_lines_and_names_the_content(
    tokenizer: ChatTokenizer,
) -> None:
    def script(request: GenerationRequest) -> tuple[str, str]:
        return "The agent worked on the bug.", "stop"

    trace = coding_trace(2, 3000, tokenizer)
    backend = FakeBackend(script=script)
    compactor = Compactor(tokenizer, backend, context_window=8192)
    result = await compactor.compact(trace.messages, {"chunk_tokens": 1024, "max_chunk_summary_tokens": 64})
    head = result.messages[1].text()
    constraint = next(f for f in trace.facts if f.kind == "constraint")
    assert USER_WORDS_HEADER in head and constraint.text in head.split(USER_WORDS_HEADER)[1]
    stats = result.stats
    assert stats.user_words_kept == 2 and stats.user_words_dropped == 0 and stats.user_words_tokens > 0
    assert sum(c.pinned_lines for c in stats.per_chunk) > 0
    assert {c.content for c in stats.per_chunk} <= set(INSTRUCTIONS)
    assert all(r.max_tokens == 16 and r.repetition_penalty == 1.05 for r in backend.requests)
    assert sum(c.summary_tokens for c in stats.per_chunk) <= stats.chunks * (64 + 2)  # the budgets, pooled
    caller = await compactor.compact(trace.messages, {"chunk_tokens": 1024, "chunk_instructions": {0: "Be brief."}})
    assert caller.stats.per_chunk[0].content == "caller"


def _parrot(tokenizer: ChatTokenizer) -> Any:
    """Every answer restates its prompt's instructions; chunk 0's and chunk 1's strict prompt write content too."""

    def parrot(request: GenerationRequest) -> tuple[str, str]:
        prompt = tokenizer.decode(list(request.prompt_token_ids))
        said = "keep who said what," if "who said what" in prompt else "keep the commands run,"
        content = request.request_id.startswith("chunk-0-") or request.request_id == request_id(1, strict=True)
        facts = "They walked up to the castle and ate at the market." if content else ""
        return f"This part is a conversation: {said}\n{facts}", "stop"

    return parrot


def _castle_chat() -> list[dict[str, Any]]:
    chat = [{"role": "system", "content": "You are a travel agent."}]
    for i in range(40):
        chat.append({"role": "user", "content": f"Day {i}: how was the walk up to the castle with your sister?"})
        chat.append({"role": "assistant", "content": f"Lovely on day {i}; we ate far too much at the market."})
    return chat


@pytest.mark.parametrize("background", [False, True], ids=["waited_for", "background"])
async def test_a_summary_that_restates_its_instructions_keeps_none_of_them(
    tokenizer: ChatTokenizer, background: bool
) -> None:
    """Chunk 0 writes content after an echoed sentence (kept, the echo dropped); the others echo their first prompt,
    and chunk 1 writes content for its strict one. Where an agent waits, an echo takes the chunk's extractive text at
    once; in the background, where nobody waits, it is asked again strictly first (chunk 1 then keeps a summary)."""
    backend = FakeBackend(script=_parrot(tokenizer))
    compactor = Compactor(tokenizer, Escalation(backend, BACKGROUND) if background else backend, context_window=8192)
    result = await compactor.compact(_castle_chat(), {"chunk_tokens": 256, "max_chunk_summary_tokens": 48, **PLAIN})
    assert "who said what" not in result.summary and "keep the commands" not in result.summary
    stats = result.stats.per_chunk
    assert len(stats) > 2
    assert [c.first_verdict for c in stats] == ["ok"] + ["echo"] * (len(stats) - 1)
    assert result.stats.empty_or_runaway_chunks == list(range(1, len(stats)))
    if background:
        assert [c.status for c in stats] == ["ok", "retried"] + ["extractive_fallback"] * (len(stats) - 2)
        assert [c.retries for c in stats] == [0] + [1] * (len(stats) - 1)
    else:
        assert [c.status for c in stats] == ["ok"] + ["extractive_fallback"] * (len(stats) - 1)
        assert all(c.retries == 0 for c in stats) and len(backend.requests) == len(stats)


async def test_an_echo_asked_again_in_the_background_is_not_waited_for_once_a_turn_needs_it(
    tokenizer: ChatTokenizer,
) -> None:
    """The background strict prompts of the echoed chunks are in flight when a turn raises the run: they are given up
    (cancelled on the backend) and each such chunk keeps its extractive text at once, as a waited-for echo does;
    the turn waits for no second asking."""
    backend = HoldingBackend(lambda request, _: request.request_id.endswith("-retry"), script=_parrot(tokenizer))
    escalation = Escalation(backend, BACKGROUND)
    compactor = Compactor(tokenizer, escalation, context_window=8192)
    plan = compactor.plan(_castle_chat(), {"chunk_tokens": 256, "max_chunk_summary_tokens": 48, **PLAIN})
    echoed = backend.expect = len(plan.chunks) - 1
    run = asyncio.create_task(compactor.run(plan))
    await backend.all_held.wait()  # every echoed chunk's strict prompt is in flight
    escalation.hurry()  # a turn waits for the run now
    result = await run
    stats = result.stats.per_chunk
    assert echoed > 1 and sorted(backend.given_up) == sorted(request_id(k, strict=True) for k in range(1, len(stats)))
    assert [c.first_verdict for c in stats] == ["ok"] + ["echo"] * echoed
    assert [c.status for c in stats] == ["ok"] + ["extractive_fallback"] * echoed
    assert all(c.retries == 0 for c in stats)
    assert [c.given_up for c in stats] == [False] + [True] * echoed
    assert result.stats.given_up_chunks == list(range(1, len(stats)))  # the record says which were given up
    assert "who said what" not in result.summary and "keep the commands" not in result.summary


@pytest.mark.parametrize("seed", range(4))
def test_analysis_traces_plant_six_facts_of_their_own_once(seed: int, tokenizer: ChatTokenizer) -> None:
    trace = analysis_trace(seed, 3000, tokenizer)
    assert [f.kind for f in trace.facts] == ["requirement", "metric", "followup", "query", "anomaly", "conclusion"]
    roles = {f.kind: trace.messages[f.message_index]["role"] for f in trace.facts}
    assert roles["requirement"] == roles["followup"] == "user" and roles["metric"] == "tool"
    assert roles["anomaly"] == roles["conclusion"] == "assistant"
    assert trace.messages == analysis_trace(seed, 3000, tokenizer).messages


async def test_spans_marked_to_keep_survive_a_chain_of_compactions_verbatim(tokenizer: ChatTokenizer) -> None:
    """<keep>…</keep> in any message of the compacted span (a tool result here) is written in the head verbatim,
    markers included, so a later compaction that summarises that head again keeps it again."""
    rule = "<keep>Never run migrations on the production database without a backup.</keep>"
    trace = coding_trace(0, 3000, tokenizer)
    messages = [*trace.messages]
    at = next(i for i, m in enumerate(messages) if m["role"] == "tool")
    messages[at] = {**messages[at], "content": f"{messages[at]['content']}\n{rule}"}
    compactor = Compactor(tokenizer, FakeBackend(), context_window=8192)
    options = {"chunk_tokens": 512, "carry_summary_tokens": 0, **PLAIN}
    first = await compactor.compact(messages, options)
    assert first.messages[1].text().count(rule) == 1 and first.replaces_through > at
    later = [m.model_dump(mode="json", exclude_none=True) for m in first.messages] + trace.messages[1:]
    second = await compactor.compact(later, options)  # the first head is summarised again, not carried
    assert second.kept_head == 1 and second.messages[1].text().count(rule) == 1


async def test_marking_more_than_a_quarter_of_the_window_to_keep_is_refused_before_any_call(
    tokenizer: ChatTokenizer,
) -> None:
    backend = FakeBackend()
    long = " ".join(f"rule {i}" for i in range(1200))
    messages = [{"role": "user", "content": f"<keep>{long}</keep>"}, *coding_trace(0, 2000, tokenizer).messages[1:]]
    with pytest.raises(InvalidInput, match=r"<keep>…</keep> spans .* over a quarter") as refused:
        await Compactor(tokenizer, backend, context_window=8192).compact(messages, {"chunk_tokens": 512})
    assert refused.value.field == "messages" and backend.requests == []


async def test_messages_and_parts_sent_with_keep_true_survive_a_chain_of_compactions(tokenizer: ChatTokenizer) -> None:
    """A message (a tool result here) and a text part marked by their `keep` field are written verbatim in the
    head, between the markers, so the chain keeps them as it keeps `<keep>` spans; a `keep` that is not a
    boolean is refused naming it."""
    trace = coding_trace(0, 3000, tokenizer)
    messages = [*trace.messages]
    tool = next(i for i, m in enumerate(messages) if m["role"] == "tool")
    user = next(i for i, m in enumerate(messages) if m["role"] == "user" and i > tool)
    messages[tool] = {**messages[tool], "keep": True}
    rule = "Deploy only from the release branch."
    messages[user] = {**messages[user], "content": [{"type": "text", "text": messages[user]["content"]},
                                                    {"type": "text", "text": rule, "keep": True}]}  # fmt: skip
    result = f"[tool result {messages[tool]['tool_call_id']}] {messages[tool]['content']}".strip()
    compactor = Compactor(tokenizer, FakeBackend(), context_window=8192)
    options = {"chunk_tokens": 512, "carry_summary_tokens": 0, "user_words_tokens": 0, **PLAIN}
    first = await compactor.compact(messages, options)
    assert first.replaces_through > user
    for text in (f"<keep>{result}</keep>", f"<keep>{rule}</keep>"):
        assert first.messages[1].text().count(text) == 1, text
    later = [m.model_dump(mode="json", exclude_none=True) for m in first.messages] + trace.messages[1:]
    second = await compactor.compact(later, options)
    assert second.kept_head == 1
    assert all(second.messages[1].text().count(f"<keep>{t}</keep>") == 1 for t in (result, rule))
    for value in ("always", "yes", 1):  # a boolean only: "yes" and 1 are not read as true
        with pytest.raises(InvalidInput) as refused:
            parse_messages([{"role": "user", "content": [{"type": "text", "text": "x"}], "keep": value}])
        assert refused.value.field == "messages[0].keep"
    with pytest.raises(InvalidInput) as refused:
        parse_messages([{"role": "user", "content": [{"type": "text", "text": "x", "keep": "yes"}]}])
    assert refused.value.field == "messages[0].content[0].keep"


async def test_a_history_its_compaction_would_not_shorten_is_answered_nothing_to_compact(
    tokenizer: ChatTokenizer,
) -> None:
    """A short history whose summary header and the user's words kept outweigh what they replace: never a longer
    history than was sent. A longer one of the same kind is compacted, and comes back shorter."""
    said = [{"role": "user", "content": "Keep Python 3.8 support."}, {"role": "assistant", "content": "Sure."}]
    compactor = Compactor(tokenizer, FakeBackend(), context_window=8192)
    with pytest.raises(NothingToCompact, match="nothing to compact: the compacted history would hold") as refused:
        await compactor.compact(
            [*said, {"role": "user", "content": "Add a CHANGELOG entry."}], {"keep_recent_tokens": 0}
        )
    assert refused.value.field == "messages"
    worked = {"role": "assistant", "content": "I read setup.cfg, pyproject.toml and tox.ini and ran the tests. " * 8}
    result = await compactor.compact([*said, worked, {"role": "user", "content": "Thanks."}], {"keep_recent_tokens": 0})
    assert result.stats.compacted_tokens < result.stats.history_tokens
