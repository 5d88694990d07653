"""Caps on one compaction's work: chunks per compaction and history tokens, refused with what to change."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from compaction.chunk_cache import ChunkCache
from compaction.compactor import Compactor
from compaction.errors import OverLimit
from compaction.partition import PlanLimits
from compaction.render import content_spans, encode_rendering, token_floor
from compaction.tokenizer import ChatTokenizer, HFChatTokenizer
from serving.models import load_catalogue
from tests.fakes import ChatMLTokenizer

TURNS = [
    {"role": ("user", "assistant")[i % 2], "content": f"step {i}: " + "read the file again " * 12} for i in range(20)
]
MESSAGES = [{"role": "system", "content": "You are a coding agent."}, *TURNS]


@pytest.fixture(scope="module")
def tokenizer(chat_tokenizer: ChatMLTokenizer) -> ChatMLTokenizer:
    return chat_tokenizer


@pytest.fixture(scope="module")
def real_tokenizer(model_path: Path) -> HFChatTokenizer:
    return HFChatTokenizer.from_path(model_path)


def compactor(tokenizer: ChatTokenizer, limits: PlanLimits) -> Compactor:
    return Compactor(tokenizer, None, context_window=8192, block_size=16, cache=ChunkCache(), limits=limits)  # type: ignore[arg-type]


def test_too_many_chunks_names_the_chunk_tokens_that_fit(tokenizer: ChatTokenizer) -> None:
    capped = compactor(tokenizer, PlanLimits(max_chunks=8, max_history_tokens=100_000))
    with pytest.raises(OverLimit) as refused:
        capped.plan(MESSAGES, {"chunk_tokens": 16})
    assert refused.value.field == "chunk_tokens" and "max_chunks of 8" in refused.value.message
    least = int(re.search(r"chunk_tokens >= (\d+)", refused.value.message).group(1))  # type: ignore[union-attr]
    assert len(capped.plan(MESSAGES, {"chunk_tokens": least}).chunks) <= 8
    with pytest.raises(OverLimit):
        capped.plan(MESSAGES, {"chunk_tokens": least - 1})


def test_a_history_over_the_cap_is_refused_before_it_is_laid_out(tokenizer: ChatTokenizer) -> None:
    capped = compactor(tokenizer, PlanLimits(max_chunks=1024, max_history_tokens=600))
    with pytest.raises(OverLimit, match="max_history_tokens of 600; compact a shorter history") as refused:
        capped.plan(MESSAGES, {"chunk_tokens": 256})
    assert refused.value.field == "messages"
    assert compactor(tokenizer, PlanLimits(1024, 100_000)).plan(MESSAGES, {"chunk_tokens": 256}).chunks


def test_the_default_caps_follow_the_window_and_the_engine_batch() -> None:
    catalogue = load_catalogue()
    cpu, h100 = catalogue.get("smollm2-135m-instruct"), catalogue.get("llama-3.1-8b-instruct")
    assert cpu.plan_limits() == PlanLimits(max_chunks=128, max_history_tokens=16 * 8192)
    assert h100.plan_limits() == PlanLimits(max_chunks=1024, max_history_tokens=16 * 131_072)
    own = cpu.model_copy(update={"max_chunks": 32, "max_history_tokens": 50_000})
    assert own.plan_limits() == PlanLimits(32, 50_000)


_TEXTS = st.lists(st.sampled_from([*"ab #=\n\t é漢", "<|im_end|>", "word", "    ", "#" * 80]), max_size=60).map("".join)
_VIEWS = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": _TEXTS}),
    min_size=1,
    max_size=8,
)


def floor_holds(tokenizer: ChatTokenizer, views: list[dict[str, str]]) -> None:
    """The floor is at most the tokens the history renders to: the template's control tokens parsed, the content
    tokenised as text (`render_history`'s count)."""
    text = tokenizer.render(views)
    rendered = encode_rendering(text, content_spans(views, text, tokenizer), tokenizer)[0]
    assert token_floor(views, tokenizer) <= len(rendered)


@settings(max_examples=60, deadline=None)
@given(views=_VIEWS)
@example(views=[{"role": "user", "content": "#" * 1600}, {"role": "assistant", "content": "=" * 640}])
def test_the_token_floor_is_never_above_what_a_history_renders_to(
    chat_tokenizer: ChatMLTokenizer, real_tokenizer: HFChatTokenizer, views: list[dict[str, str]]
) -> None:
    """Any content (runs of one character, blanks a template may trim, control spellings, several scripts) and
    any order of roles: the floor a history is refused on before rendering is at most its real token count."""
    floor_holds(chat_tokenizer, views)
    floor_holds(real_tokenizer, views)


class FoldingTokenizer(ChatMLTokenizer):
    """A template that writes nothing but control tokens around each turn, and folds a first system message into
    the first user turn, unmarked (as Mistral's does); a system message later on is a turn of its own."""

    @staticmethod
    def _turn(role: str, content: str) -> str:
        return f"<|im_start|>{content}<|im_end|>"

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = False, tools: Any = None) -> str:
        if len(messages) > 1 and messages[0]["role"] == "system" and messages[1]["role"] == "user":
            folded = {"role": "user", "content": f"{messages[0]['content']} {messages[1]['content']}"}
            text = "".join(self._turn(m["role"], m["content"]) for m in [folded, *messages[2:]])
            return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")
        return super().render(messages, add_generation_prompt)


@settings(max_examples=40, deadline=None)
@given(views=_VIEWS)
@example(views=[{"role": "system", "content": "a"}, {"role": "user", "content": "b"}])
def test_the_token_floor_holds_when_a_template_folds_the_first_turn_into_another(
    views: list[dict[str, str]],
) -> None:
    """A system turn is marked where the template is probed (after other turns), but not when it comes first."""
    floor_holds(FoldingTokenizer(), views)


def test_a_history_that_cannot_fit_is_refused_before_it_is_rendered(
    tokenizer: ChatTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many short turns: every turn's two control tokens alone pass the cap, so planning refuses the history
    without rendering it (a maximal body took a coordinator tens of seconds to render before it was refused)."""
    turns = [{"role": ("user", "assistant")[i % 2], "content": f"step {i}"} for i in range(400)]
    assert token_floor(turns, tokenizer) >= 2 * len(turns)
    monkeypatch.setattr("compaction.plan.render_history", lambda *_: pytest.fail("rendered a history that cannot fit"))
    with pytest.raises(OverLimit, match=r"renders to at least \d+ tokens, over this model's max_history_tokens of 700"):
        compactor(tokenizer, PlanLimits(max_chunks=1024, max_history_tokens=700)).plan(turns, {"chunk_tokens": 256})
