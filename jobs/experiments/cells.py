"""Running one cell of a sweep into result rows. Plain async code over `Backend` (no Ray here).

`summary` cells compact one LoCoMo snapshot of a given size; `agent` cells run the agent
pipeline over a dataset stream, then score every answer (deterministic metrics and the judge);
`retention` cells compact a history with known facts and measure what survived
(`jobs.experiments.retention`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, Protocol, runtime_checkable

import pyarrow as pa

from compaction.backend import Backend
from compaction.checks.quality import repeated_sentences
from compaction.compactor import Compactor
from compaction.errors import InvalidInput
from compaction.history import Message, parse_messages
from compaction.tokenizer import ChatTokenizer, HFChatTokenizer
from jobs.agent.judge import Grade, Judge
from jobs.agent.metrics import score_answer
from jobs.agent.pipeline import AgentPipeline, AgentSettings, Episode, Turn, matched_options
from jobs.data.conversations import locomo_messages, truncate_history
from jobs.data.datasets import LocomoSample, load_hotpotqa, load_locomo, load_locomo_mc
from jobs.data.episodes import Question, Step, hotpotqa_steps, locomo_mc_steps, locomo_steps
from jobs.data.facts import KnownHistory, analysis_history, coding_history, locomo_history
from jobs.experiments.chat_agent import chat_agent_rows
from jobs.experiments.grid import Cell
from jobs.experiments.results import compaction_columns, to_table
from jobs.experiments.retention import fact_rows, grounding_columns, recall, totals


@dataclass(frozen=True)
class ModelAccess:
    """How a cell reaches one model. Picklable: it travels to the cell's Ray task."""

    name: str  # catalogue name
    tokenizer_path: str  # local folder or HF repo id with the chat template
    context_window: int
    block_size: int
    backend_factory: Callable[[], Backend]  # called inside the task
    label: str  # what served it, recorded in every row
    base_url: str | None = None  # the service's URL (backend: service); chat_agent cells talk to its chat endpoint


@runtime_checkable
class ResettableBackend(Protocol):
    async def reset_prefix_cache(self) -> None: ...


@cache
def load_tokenizer(path: str) -> HFChatTokenizer:
    """One tokenizer per worker process and model (a Ray worker runs many cells)."""
    return HFChatTokenizer.from_path(path)


def base_row(cell: Cell, access: ModelAccess, cold: bool) -> dict[str, Any]:
    return {
        "cell_id": cell.cell_id,
        "experiment": cell.experiment,
        "kind": cell.kind,
        "model": cell.model,
        "dataset": cell.dataset,
        "strategy": cell.strategy,
        "layout": cell.layout,
        "variant": cell.variant,
        "chunk_tokens": cell.chunk_tokens,
        "tau": cell.tau,
        "target_input_tokens": cell.input_tokens,
        "summary_budget": cell.summary_tokens,
        "fixed_output_tokens": cell.fixed_output_tokens,
        "temperature": cell.temperature,
        "repeat": cell.repeat,
        "backend": access.label,
        "cold_start": cold,
        "mode": cell.mode,
        "option_set": cell.option_set,
    }


def snapshot(
    samples: Sequence[LocomoSample], sample_id: str | None, tokens: int, tokenizer: ChatTokenizer
) -> list[dict[str, Any]]:
    """LoCoMo conversations from `sample_id` on, concatenated, cut to whole messages within `tokens`."""
    start = next((i for i, s in enumerate(samples) if s.sample_id == sample_id), 0) if sample_id else 0
    messages: list[dict[str, str]] = []
    rough = 0
    for sample in samples[start:]:
        for message in locomo_messages(sample.model_dump()):
            messages.append(message)
            rough += len(tokenizer.encode(message["content"])) + 8
        if rough > tokens * 1.2:
            break
    return truncate_history(messages, tokenizer, tokens)


async def summary_rows(
    cell: Cell, paths: dict[str, str], access: ModelAccess, backend: Backend, cold: bool
) -> list[dict[str, Any]]:
    tokenizer = load_tokenizer(access.tokenizer_path)
    messages = snapshot(load_locomo(paths["locomo"]), cell.sample_id, cell.input_tokens or 0, tokenizer)
    compactor = Compactor(tokenizer, backend, context_window=access.context_window, block_size=access.block_size)
    history: list[Message] = parse_messages(messages)
    options = matched_options(compactor, history, cell.compaction_options(), cell.summary_tokens)
    result = await compactor.compact(history, options)
    row = {**base_row(cell, access, cold), "event": "summary", **compaction_columns(result.stats)}
    return [{**row, "summary_text": result.summary}]


def known_history(cell: Cell, paths: dict[str, str], tokenizer: ChatTokenizer) -> KnownHistory:
    """A coding or analysis trace (seed = repeat) or a LoCoMo conversation (the repeat-th from sample_id) of the
    cell's size."""
    size = cell.input_tokens or 0
    if cell.dataset == "coding":
        return coding_history(cell.repeat, size, tokenizer)
    if cell.dataset == "analysis":
        return analysis_history(cell.repeat, size, tokenizer)
    samples = load_locomo(paths["locomo"])
    start = next((i for i, s in enumerate(samples) if s.sample_id == cell.sample_id), 0)
    return locomo_history(samples[(start + cell.repeat) % len(samples)], size, tokenizer)


async def retention_rows(
    cell: Cell, paths: dict[str, str], access: ModelAccess, backend: Backend, judge: ModelAccess | None, cold: bool
) -> list[dict[str, Any]]:
    """One `retention` row (the compaction, its grounding, recall totals) and one `fact` row per known fact."""
    tokenizer = load_tokenizer(access.tokenizer_path)
    known = known_history(cell, paths, tokenizer)
    compactor = Compactor(tokenizer, backend, context_window=access.context_window, block_size=access.block_size)
    history = parse_messages(known.messages)
    plan = compactor.plan(history, matched_options(compactor, history, cell.compaction_options(), cell.summary_tokens))
    result = await compactor.run(plan)
    facts = [f for f in known.facts if plan.kept_head <= f.message_index < plan.replaces_through]
    grader = Judge(load_tokenizer(judge.tokenizer_path), judge.backend_factory()) if judge else None
    try:
        window, budget = access.context_window, cell.answer_tokens
        results = await recall(facts, result.messages, tokenizer, backend, grader, window, budget)
    finally:
        if grader is not None:
            await close(grader.backend)
    stats = result.stats
    base = {**base_row(cell, access, cold), "label": known.label, "grounding_threshold": stats.grounding_threshold}
    measured = {**compaction_columns(stats), **grounding_columns(stats), **totals(results)}
    measured["repeated_sentences"] = repeated_sentences(result.summary)
    rows = [{**base, "event": "retention", **measured, "summary_text": result.summary}]
    return rows + [{**base, **row} for row in fact_rows(results, judge.name if judge else None, cell.model)]


def build_steps(cell: Cell, paths: dict[str, str]) -> list[Step]:
    path = paths[cell.dataset]
    if cell.dataset == "hotpotqa":
        return hotpotqa_steps(load_hotpotqa(path)[: cell.limit])
    if cell.dataset == "locomo":
        samples = load_locomo(path)
        if cell.sample_id:
            samples = [s for s in samples if s.sample_id == cell.sample_id]
        return locomo_steps(samples, cell.limit, cell.questions_per_document)
    return locomo_mc_steps(load_locomo_mc(path)[: cell.limit])


def turn_row(turn: Turn) -> dict[str, Any]:
    row: dict[str, Any] = {
        "event": "turn",
        "turn_index": turn.index,
        "step": "question" if isinstance(turn.step, Question) else "document",
        "label": turn.step.task_id if isinstance(turn.step, Question) else turn.step.label,
        "context_tokens": turn.context_tokens,
        "tokens_after": turn.tokens_after,
        "compaction_stall_s": turn.compaction_stall_s,
        "compacted": turn.compaction is not None,
    }
    if turn.compaction:
        row |= compaction_columns(turn.compaction)
    if turn.answer:
        answer = turn.answer
        row |= {
            "answer_prompt_tokens": answer.prompt_tokens,
            "answer_cached_tokens": answer.cached_prompt_tokens,
            "answer_output_tokens": answer.output_tokens,
            "answer_latency_s": answer.latency_s,
            "prediction": answer.text,
        }
    return row


def episode_row(episode: Episode) -> dict[str, Any]:
    compactions = [t.compaction for t in episode.turns if t.compaction]
    answers = [t.answer for t in episode.turns if t.answer]
    return {
        "event": "episode",
        "e2e_s": episode.e2e_s,
        "compaction_time_s": episode.compaction_s,
        "compaction_count": len(compactions),
        "answer_time_s": sum(a.latency_s for a in answers),
        "questions": len(answers),
        "compacted_input_tokens": sum(c.input_tokens for c in compactions),
        "summary_tokens_total": sum(c.summary_tokens for c in compactions),
    }


async def close(backend: Backend) -> None:
    """Release an HTTP backend's connections (engine-actor backends hold none)."""
    aclose = getattr(backend, "aclose", None)
    if aclose is not None:
        await aclose()


async def grade_all(judge: Judge, questions: Sequence[tuple[Question, str]]) -> list[Grade]:
    return list(await asyncio.gather(*(judge.grade(q.question, q.gold, answer) for q, answer in questions)))


async def agent_rows(
    cell: Cell, paths: dict[str, str], access: ModelAccess, backend: Backend, judge: ModelAccess | None, cold: bool
) -> list[dict[str, Any]]:
    tokenizer = load_tokenizer(access.tokenizer_path)
    settings = AgentSettings(
        tau=cell.tau or 0,
        compaction=cell.compaction_options(),
        summary_tokens=cell.summary_tokens,
        answer_tokens=cell.answer_tokens,
    )
    pipeline = AgentPipeline(
        tokenizer, backend, settings, context_window=access.context_window, block_size=access.block_size
    )
    episode = await pipeline.run(build_steps(cell, paths))
    base = base_row(cell, access, cold)
    rows = [{**base, **turn_row(t)} for t in episode.turns]
    turns = enumerate(episode.turns)
    asked = [(i, t.step, t.answer.text) for i, t in turns if isinstance(t.step, Question) and t.answer]
    for i, question, answer in asked:
        rows[i] |= {"task_id": question.task_id, "category": question.category, "question": question.question}
        rows[i] |= {"gold": question.gold, **score_answer(cell.dataset, question, answer)}
    free_form = [(i, q, a) for i, q, a in asked if not q.choices]
    if judge is not None and free_form:
        grader = Judge(load_tokenizer(judge.tokenizer_path), judge.backend_factory())
        try:
            grades = await grade_all(grader, [(q, a) for _, q, a in free_form])
        finally:
            await close(grader.backend)
        for (i, _, _), grade in zip(free_form, grades, strict=True):
            rows[i] |= {"judge_model": judge.name, "judge_is_agent_model": judge.name == cell.model}
            rows[i] |= {"judge_correct": grade.correct, "judge_raw": grade.raw}
    return [*rows, {**base, **episode_row(episode)}]


async def chat_rows(cell: Cell, paths: dict[str, str], access: ModelAccess, cold: bool) -> list[dict[str, Any]]:
    """A chat_agent cell: the agent through the service's chat endpoint (jobs.experiments.chat_agent)."""
    if access.base_url is None:
        raise InvalidInput("backend", "chat_agent cells run against the service: set backend.kind: service")
    rows = await chat_agent_rows(cell, build_steps(cell, paths), access.base_url)
    return [{**base_row(cell, access, cold), **row} for row in rows]


async def run_cell(
    cell: Cell, paths: dict[str, str], agent: ModelAccess, judge: ModelAccess | None, cold_start: bool
) -> pa.Table:
    """One cell's rows as a results table. `cold_start` empties the engine's prefix cache first, if it can."""
    began = time.perf_counter()
    backend = agent.backend_factory()
    try:
        cold = False
        if cold_start and isinstance(backend, ResettableBackend):
            await backend.reset_prefix_cache()
            cold = True
        if cell.kind == "summary":
            rows = await summary_rows(cell, paths, agent, backend, cold)
        elif cell.kind == "chat_agent":
            rows = await chat_rows(cell, paths, agent, cold)
        elif cell.kind == "retention":
            rows = await retention_rows(cell, paths, agent, backend, judge, cold)
        else:
            rows = await agent_rows(cell, paths, agent, backend, judge, cold)
    finally:
        await close(backend)
    wall = time.perf_counter() - began
    return to_table([{**row, "cell_wall_s": wall} for row in rows])
