"""The agent pipeline: fake backend for exact bookkeeping, the real CPU engine for the real loop."""

from __future__ import annotations

from typing import Any

import pytest

from compaction.backend import GenerationRequest
from compaction.options import CompactionOptions
from jobs.agent.pipeline import AgentPipeline, AgentSettings, question_prompt
from jobs.data.conversations import SHARED_DATA
from jobs.data.datasets import load_hotpotqa
from jobs.data.episodes import Document, Question, Step, hotpotqa_steps
from tests.fakes import PLAIN, FakeBackend

HOTPOT = SHARED_DATA / "hotpotqa_dev_distractor_sample100.json"


def doc(i: int, words: int = 60) -> Document:
    text = f"Document {i}: " + " ".join(f"fact{i}-{k}" for k in range(words))
    return Document(f"d{i}", ({"role": "user", "content": text},))


def stream() -> list[Step]:
    steps: list[Step] = []
    for i in range(8):
        steps.append(doc(i))
        if i % 2:
            steps.append(Question(f"q{i}", f"What is fact {i}?", f"fact{i}-0", "bridge"))
    return steps


def settings(**kw: Any) -> AgentSettings:
    options = CompactionOptions(
        chunk_tokens=kw.pop("chunk_tokens", 256), strategy=kw.pop("strategy", "parallel"), **kw.pop("extra", {})
    )
    return AgentSettings(tau=kw.pop("tau", 600), compaction=options, summary_tokens=64, answer_tokens=8, **kw)


def by_kind(request: GenerationRequest) -> tuple[str, str]:
    return ("Summary." if request.request_id.startswith("chunk") else "fact-answer"), "stop"


async def test_history_is_compacted_past_tau_and_answers_continue(tokenizer) -> None:
    backend = FakeBackend(script=by_kind)
    pipeline = AgentPipeline(tokenizer, backend, settings(), context_window=8192, block_size=16)
    episode = await pipeline.run(stream())
    assert len(episode.turns) == len(stream())
    compacted = [t for t in episode.turns if t.compaction is not None]
    assert len(compacted) >= 2 and episode.compactions == len(compacted)
    for turn in episode.turns:
        assert turn.compaction_stall_s > 0 if turn.compaction else turn.compaction_stall_s == 0
        assert (turn.context_tokens > 600) == (turn.compaction is not None)
        assert turn.tokens_after <= 600
    answers = [t for t in episode.turns if t.answer]
    assert len(answers) == 4 and all(t.answer and t.answer.text == "fact-answer" for t in answers)
    assert any(t.index > compacted[0].index for t in answers)  # answering goes on after a compaction
    assert 0 < episode.compaction_s < episode.e2e_s


async def test_answer_prompt_is_the_rendered_history_with_a_generation_prompt(tokenizer) -> None:
    backend = FakeBackend(script=by_kind)
    pipeline = AgentPipeline(tokenizer, backend, settings(tau=100_000), context_window=8192)
    steps = stream()[:3]
    await pipeline.run(steps)
    (request,) = [r for r in backend.requests if r.request_id.startswith("answer")]
    question = steps[2]
    assert isinstance(question, Question)
    messages = [
        {"role": "system", "content": pipeline.settings.system_prompt},
        steps[0].messages[0],  # type: ignore[union-attr]
        steps[1].messages[0],  # type: ignore[union-attr]
        {"role": "user", "content": question_prompt(question)},
    ]
    expected = tokenizer.encode(tokenizer.render(messages, add_generation_prompt=True))
    assert list(request.prompt_token_ids) == expected and request.temperature == 0.0 and request.max_tokens == 8


async def test_summary_budget_is_split_over_chunks_for_matched_volume(tokenizer) -> None:
    for strategy in ("sequential", "parallel"):
        backend = FakeBackend(script=by_kind)
        plain = settings(strategy=strategy, tau=400, extra=PLAIN)
        pipeline = AgentPipeline(tokenizer, backend, plain, context_window=8192)
        episode = await pipeline.run(stream()[:4])
        first = next(t.compaction for t in episode.turns if t.compaction)
        budgets = [r.max_tokens for r in backend.requests if r.request_id.startswith("chunk")][: first.chunks]
        assert sum(budgets) <= 64 and min(budgets) == 64 // first.chunks
        assert (first.chunks > 1) == (strategy == "parallel")


def test_multiple_choice_prompt_letters_the_choices() -> None:
    prompt = question_prompt(Question("m", "Which?", "b", "x", ("a", "b"), 1))
    assert "(A) a\n(B) b" in prompt and prompt.endswith("letter of the correct choice.")


@pytest.mark.engine
async def test_real_engine_agent_compacts_and_still_answers(engine, tokenizer) -> None:
    if not HOTPOT.exists():
        pytest.skip(f"shared HotpotQA sample not found at {HOTPOT}")
    steps = hotpotqa_steps(load_hotpotqa(HOTPOT)[:2])
    agent = AgentSettings(
        tau=1024,
        compaction=CompactionOptions(chunk_tokens=512, variant="concise"),
        summary_tokens=96,
        answer_tokens=16,
    )
    pipeline = AgentPipeline(
        tokenizer, engine, agent, context_window=engine.max_model_len, block_size=engine.block_size
    )
    episode = await pipeline.run(steps)
    compactions = [t for t in episode.turns if t.compaction]
    assert compactions, "tau=1024 over two HotpotQA examples must compact at least once"
    first = compactions[0].compaction
    assert first is not None and first.chunks >= 2 and first.output_tokens > 0
    assert first.compacted_tokens < first.history_tokens
    later = [t for t in episode.turns if t.answer and t.index > compactions[0].index]
    assert later, "a question must be answered after a compaction"
    for turn in later:
        assert turn.answer is not None and turn.answer.output_tokens > 0 and turn.answer.prompt_tokens > 0
    print(
        f"\n{len(steps)} steps, {len(compactions)} compactions, e2e {episode.e2e_s:.1f} s, "
        f"compaction {episode.compaction_s:.1f} s; answers: {[t.answer.text for t in later if t.answer]}"
    )
