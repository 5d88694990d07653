"""The retention benchmark's measures: what survives a compaction, and what it invented.

Per compaction of a history with known facts (`jobs.data.facts`):
- exact recall: a fact counts as recalled when its string occurs (case and white space aside)
  in the compacted history's messages;
- judged recall: the agent model answers the fact's question from the compacted history, and
  the judge grades the answer against the fact (on the CPU default the judge is the agent model
  itself: rows carry `judge_is_agent_model`);
- grounding, from the compaction's per-chunk stats: summaries (and salient tokens) that were
  invented in the first model attempt, and those that reached the output after the check.
Only facts inside the compacted span count (not ones in kept system or recent messages).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from compaction.backend import Backend, GenerationRequest
from compaction.history import Message, template_view
from compaction.result import CompactionStats
from compaction.tokenizer import ChatTokenizer
from jobs.agent.judge import Grade, Judge
from jobs.agent.pipeline import question_prompt
from jobs.data.episodes import Question
from jobs.data.facts import Fact, normalise


@dataclass(frozen=True)
class FactResult:
    fact: Fact
    recalled: bool  # exact: the string occurs in the compacted history
    prediction: str | None  # the agent's answer from the compacted history (None: not asked)
    grade: Grade | None  # the judge's verdict on it


def compacted_text(messages: Sequence[Message]) -> str:
    return normalise("\n".join(template_view(m)["content"] for m in messages))


def recalled(fact: Fact, text: str) -> bool:
    """`fact.text` occurs in the normalised `text` as a whole (not inside a longer word)."""
    return re.search(rf"(?<!\w){re.escape(normalise(fact.text))}(?!\w)", text) is not None


async def answer(
    messages: Sequence[Message], question: str, tokenizer: ChatTokenizer, backend: Backend, window: int, tokens: int
) -> str | None:
    """The agent's answer to `question` after the compacted history; None when the prompt would not fit."""
    ask = question_prompt(Question("retention", question, "", "retention"))
    views = [template_view(m) for m in messages] + [{"role": "user", "content": ask}]
    ids = tuple(tokenizer.encode(tokenizer.render(views, add_generation_prompt=True)))
    if len(ids) + tokens > window:
        return None
    reply = await backend.generate(GenerationRequest(ids, max_tokens=tokens, request_id="answer-retention"))
    return reply.text.strip()


async def recall(
    facts: Sequence[Fact],
    messages: Sequence[Message],
    tokenizer: ChatTokenizer,
    backend: Backend,
    judge: Judge | None,
    window: int,
    answer_tokens: int,
) -> list[FactResult]:
    """Exact recall of every fact; with a judge, judged recall too (answers and grades run concurrently)."""
    text = compacted_text(messages)
    if judge is None:
        return [FactResult(f, recalled(f, text), None, None) for f in facts]

    async def one(fact: Fact) -> FactResult:
        prediction = await answer(messages, fact.question, tokenizer, backend, window, answer_tokens)
        grade = None if prediction is None else await judge.grade(fact.question, fact.text, prediction)
        return FactResult(fact, recalled(fact, text), prediction, grade)

    return list(await asyncio.gather(*(one(f) for f in facts)))


def grounding_columns(stats: CompactionStats) -> dict[str, Any]:
    """Invented salient tokens before the check (first model attempts) and after it (the kept texts)."""
    chunks = stats.per_chunk
    asked = [c for c in chunks if c.first_grounding is not None]
    return {
        "model_summaries": len(asked),
        "summaries_ungrounded_first": sum(bool(c.first_ungrounded) for c in asked),
        "summaries_ungrounded_out": sum(bool(c.ungrounded) for c in chunks),
        "salient_tokens_first": sum(c.first_salient_tokens for c in asked),
        "ungrounded_tokens_first": sum(len(c.first_ungrounded) for c in asked),
        "salient_tokens_out": sum(c.salient_tokens for c in chunks),
        "ungrounded_tokens_out": sum(len(c.ungrounded) for c in chunks),
        "ungrounded_chunks": len(stats.ungrounded_chunks),
        "fallback_chunks": len(stats.extractive_fallback_chunks),
        "dropped_sentences": sum(c.dropped_sentences for c in chunks),
    }


def fact_rows(results: Sequence[FactResult], judge_name: str | None, agent: str) -> list[dict[str, Any]]:
    rows = []
    for i, r in enumerate(results):
        row: dict[str, Any] = {
            "event": "fact",
            "fact_index": i,
            "fact_kind": r.fact.kind,
            "question": r.fact.question,
            "gold": r.fact.text,
            "recalled_exact": r.recalled,
            "prediction": r.prediction,
        }
        if r.grade is not None:
            row |= {"judge_model": judge_name, "judge_is_agent_model": judge_name == agent}
            row |= {"judge_correct": r.grade.correct, "judge_raw": r.grade.raw}
        rows.append(row)
    return rows


def totals(results: Sequence[FactResult]) -> dict[str, Any]:
    """Recall over the facts of one compaction (judged: over parsed verdicts only)."""
    verdicts = [r.grade.correct for r in results if r.grade is not None and r.grade.correct is not None]
    return {
        "facts": len(results),
        "recall_exact": sum(r.recalled for r in results) / len(results) if results else None,
        "recall_judged": sum(verdicts) / len(verdicts) if verdicts else None,
    }
