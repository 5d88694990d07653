"""Prompt layouts in token space, on the real SmolLM2 tokenizer and chat template."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compaction.chunk_content import INSTRUCTIONS
from compaction.history import parse_messages
from compaction.layouts import SEGMENT, TARGET, build_prompts, prefill_floor
from compaction.options import CompactionOptions
from compaction.partition import partition
from compaction.render import render_history
from compaction.tokenizer import ChatTokenizer
from tests.fakes import ChatMLTokenizer

WORDS = ["alpha", "beta", "Paris", "2023", "said", "the", "meeting", "moved", "to", "Friday", ".", "?", "\n"]

histories = st.lists(
    st.tuples(st.sampled_from(["user", "assistant"]), st.lists(st.sampled_from(WORDS), min_size=1, max_size=60)),
    min_size=2,
    max_size=30,
).map(lambda turns: [{"role": r, "content": " ".join(w)} for r, w in turns])


@pytest.fixture(scope="module")
def tokenizer(chat_tokenizer: ChatMLTokenizer) -> ChatMLTokenizer:
    return chat_tokenizer


def prompts_for(tokenizer: ChatTokenizer, messages: list[dict], layout: str, chunk_tokens: int, block: int = 16):
    rendered = render_history(parse_messages(messages), tokenizer)
    end = len(rendered.token_ids)
    chunks = partition(0, end, chunk_tokens, block)
    options = CompactionOptions(layout=layout, chunk_tokens=chunk_tokens)  # type: ignore[arg-type]
    return rendered, build_prompts(rendered, tokenizer, options, chunks, end)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=histories, chunk_tokens=st.sampled_from([16, 32, 48, 100, 128]))
def test_prefix_exact_body_is_strict_prefix_of_next(tokenizer: ChatTokenizer, messages, chunk_tokens) -> None:
    for layout in ("prefix_exact", "prefix_exact_marked"):
        rendered, prompts = prompts_for(tokenizer, messages, layout, chunk_tokens)
        for a, b in itertools.pairwise(prompts):
            assert len(a.body) < len(b.body) and b.body[: len(a.body)] == a.body
            assert b.token_ids[: len(a.body)] == a.body  # prompt k minus its tail starts prompt k+1
        if layout == "prefix_exact":
            for p in prompts:
                assert p.body == rendered.token_ids[: p.chunk.end] and p.raw_prefix == p.chunk.end


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=histories)
def test_every_chunk_appears_once_per_prompt_in_order(tokenizer: ChatTokenizer, messages) -> None:
    _, prompts = prompts_for(tokenizer, messages, "independent", 32)
    rebuilt = sum((p.body for p in prompts), ())
    rendered = render_history(parse_messages(messages), tokenizer)
    assert rebuilt == rendered.token_ids


def test_paper_wraps_only_the_target(tokenizer: ChatTokenizer) -> None:
    messages = [
        {"role": "user", "content": " ".join(WORDS * 12)},
        {"role": "assistant", "content": "ok " * 50},
    ]
    rendered, prompts = prompts_for(tokenizer, messages, "paper", 64)
    open_ids, close_ids = tokenizer.encode(TARGET[0]), tokenizer.encode(TARGET[1])
    assert len(prompts) > 2
    for p in prompts:
        c = p.chunk
        assert p.body == (
            *rendered.token_ids[: c.start],
            *open_ids,
            *rendered.token_ids[c.start : c.end],
            *close_ids,
        )
    # prompt k+1 holds chunk k without tags, so it diverges from prompt k at chunk k's start
    assert prompts[2].body[: len(prompts[1].body)] != prompts[1].body


def test_shared_full_holds_the_whole_snapshot(tokenizer: ChatTokenizer) -> None:
    messages = [
        {"role": "user", "content": " ".join(WORDS * 12)},
        {"role": "assistant", "content": "ok " * 50},
    ]
    rendered, prompts = prompts_for(tokenizer, messages, "shared_full", 64)
    marker_len = len(tokenizer.encode(TARGET[0])) + len(tokenizer.encode(TARGET[1]))
    assert all(len(p.body) == len(rendered.token_ids) + marker_len for p in prompts)


def test_marked_layout_wraps_every_chunk(tokenizer: ChatTokenizer) -> None:
    messages = [{"role": "user", "content": " ".join(WORDS * 12)}]
    _, prompts = prompts_for(tokenizer, messages, "prefix_exact_marked", 48)
    text = tokenizer.decode(prompts[-1].body)
    assert text.count(SEGMENT[0].strip()) == len(prompts) == text.count(SEGMENT[1].strip())


def test_tail_names_target_and_budget(tokenizer: ChatTokenizer) -> None:
    messages = [{"role": "user", "content": " ".join(WORDS * 12)}]
    rendered = render_history(parse_messages(messages), tokenizer)
    chunks = partition(0, len(rendered.token_ids), 64, 16)
    options = CompactionOptions(
        chunk_tokens=64, max_chunk_summary_tokens=100, chunk_instructions={1: "Name the city."}, pinned_share=0
    )
    prompts = build_prompts(rendered, tokenizer, options, chunks, len(rendered.token_ids))
    tail = tokenizer.decode(prompts[1].tail)
    assert "part 2 of the conversation" in tail and "at most 60 words" in tail and "Name the city." in tail
    # the caller's entry replaces the content-chosen instructions; the other chunks get theirs
    assert INSTRUCTIONS["requests"] not in tail and INSTRUCTIONS["requests"] in tokenizer.decode(prompts[0].tail)
    assert str(len(chunks)) not in tail  # a chunk's tail does not change when the history grows
    assert "Name the city." not in tokenizer.decode(prompts[0].tail)
    assert tokenizer.decode(prompts[0].tail).endswith("assistant\n")


def test_instructions_end_every_tail_after_the_chunks_own(tokenizer: ChatTokenizer) -> None:
    messages = [{"role": "user", "content": " ".join(WORDS * 12)}]
    rendered = render_history(parse_messages(messages), tokenizer)
    chunks = partition(0, len(rendered.token_ids), 64, 16)
    options = CompactionOptions(chunk_tokens=64, chunk_instructions={1: "Name the city."}, instructions="Keep paths.")
    prompts = build_prompts(rendered, tokenizer, options, chunks, len(rendered.token_ids))
    tails = [tokenizer.decode(p.tail) for p in prompts]
    assert all("Keep paths. Write only the summary." in tail for tail in tails)
    assert "Name the city. Keep paths." in tails[1]


def test_prefill_floor_is_history_once_plus_tails(tokenizer: ChatTokenizer) -> None:
    messages = [{"role": "user", "content": " ".join(WORDS * 20)}]
    rendered, prompts = prompts_for(tokenizer, messages, "prefix_exact", 64)
    end = len(rendered.token_ids)
    expected = -(-end // 16) * 16 + sum(len(p.tail) + p.chunk.end % 16 for p in prompts)
    assert prefill_floor(prompts, end, 16) == expected
