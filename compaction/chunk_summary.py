"""Stage 4, one chunk: its prompt on a backend, its stricter retry where the checks ask for one, the attempts
settled (`compaction.checks.settle`) and its stats; or, with strategy extractive, its most salient lines and no
model call. `compaction.compactor` runs these for every chunk of a plan at once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from compaction.backend import Backend, GenerationRequest
from compaction.checks.grounding import Source
from compaction.checks.settle import Attempt, Settled, settle, should_retry
from compaction.chunk_content import choice
from compaction.extractive import extract, segments
from compaction.instructions import caller_instructions
from compaction.options import model_budget
from compaction.pacing import AGENT, unless_raised, urgency
from compaction.partition import Chunk
from compaction.plan import CompactionPlan
from compaction.result import ChunkStats
from compaction.tokenizer import ChatTokenizer

RETRY_REPETITION_PENALTY = 1.3


def request_id(k: int, strict: bool = False) -> str:
    """The request id of chunk k's first prompt or of its stricter retry (engine logs, the coordinator's figures)."""
    return f"chunk-{k}-{'retry' if strict else 'first'}"


async def summarise_chunk(
    tokenizer: ChatTokenizer, backend: Backend, plan: CompactionPlan, k: int, route: str | None, both: bool = False
) -> tuple[ChunkStats, str]:
    """Chunk k's summary: its prompt, then its strict prompt if that attempt was bad. `both`: the chunk fell back
    before (a background run's summary, never kept), so both prompts go at once, the strict one's answer used only
    if the first is bad: the agent waiting for it waits for one attempt, not two."""
    opts = plan.options
    began = time.perf_counter()
    source = chunk_source(tokenizer, plan, k)
    tails = [tokenizer.decode(prompts[k].tail) for prompts in (plan.prompts, plan.strict_prompts)]

    def request(strict: bool) -> GenerationRequest:
        return GenerationRequest(
            prompt_token_ids=(plan.strict_prompts if strict else plan.prompts)[k].token_ids,
            max_tokens=model_budget(opts),
            min_tokens=model_budget(opts) if opts.fixed_output_tokens else 0,
            temperature=opts.temperature,
            repetition_penalty=max(RETRY_REPETITION_PENALTY, opts.repetition_penalty)
            if strict
            else opts.repetition_penalty,
            request_id=request_id(k, strict),
            routing_key=route,
        )

    attempts: list[Attempt] = []
    spent: list[Attempt] = []  # every attempt made, for the stats
    given_up = False
    if both and opts.retry_bad_summaries and not opts.fixed_output_tokens:
        first, strict = await asyncio.gather(backend.generate(request(False)), backend.generate(request(True)))
        spent = [Attempt.of(first, source, tails[0]), Attempt.of(strict, source, tails[1])]
        attempts = spent if should_retry(spent[:1], opts) else spent[:1]
    while not attempts or should_retry(attempts, opts, echo=urgency(backend) > AGENT):  # nobody waits
        again = bool(attempts)
        asked = asyncio.ensure_future(backend.generate(request(again)))
        if again and not should_retry(attempts, opts, echo=False) and not await unless_raised(backend, asked):
            given_up = True  # asked again for an echo, and a turn waits for it now: it keeps its extractive text
            break
        attempts.append(Attempt.of(await asked, source, tails[again]))
    chunk = plan.chunks[k]
    kept = settle(
        attempts,
        opts,
        source,
        verbatim=lambda: tokenizer.decode(plan.history.token_ids[chunk.start : chunk.end]).strip(),
        extractive=lambda: extractive_text(tokenizer, plan, chunk),
    )
    stats = chunk_stats(tokenizer, plan, k, attempts, kept, time.perf_counter() - began, spent, given_up)
    return stats, kept.text


def extract_chunk(tokenizer: ChatTokenizer, plan: CompactionPlan, chunk: Chunk) -> tuple[ChunkStats, str]:
    """Strategy extractive: the chunk's most salient lines, no model call."""
    began = time.perf_counter()
    text = extractive_text(tokenizer, plan, chunk)
    if plan.sources is not None:
        source = plan.sources.source(chunk.end)
    else:
        source = Source(*(s.text for s in segments(plan.history, tokenizer, 0, chunk.end)))
    kept = Settled(text, "extractive", 0, source.check(text))
    return chunk_stats(tokenizer, plan, chunk.index, [], kept, time.perf_counter() - began), text


def chunk_source(tokenizer: ChatTokenizer, plan: CompactionPlan, k: int) -> Source:
    """What chunk k's summary may state: the chunk, the history before it, and the caller's instructions
    (chunk_instructions and instructions).

    Our own instruction text (part numbers, the word budget) is not a source: a summary that
    states "24" because the tail said "at most 24 words" has invented it.
    """
    extra = caller_instructions(plan.options, k)
    if plan.sources is not None:
        return plan.sources.source(plan.chunks[k].end, *([extra] if extra else []))
    before = segments(plan.history, tokenizer, 0, plan.chunks[k].end)
    return Source(*(s.text for s in before), *([extra] if extra else []))


def extractive_text(tokenizer: ChatTokenizer, plan: CompactionPlan, chunk: Chunk) -> str:
    return extract(plan.history, tokenizer, chunk.start, chunk.end, plan.options.max_chunk_summary_tokens)


def chunk_stats(
    tokenizer: ChatTokenizer,
    plan: CompactionPlan,
    k: int,
    attempts: list[Attempt],
    kept: Settled,
    latency: float,
    spent: Sequence[Attempt] = (),
    given_up: bool = False,
) -> ChunkStats:
    generations = [a.generation for a in spent or attempts]  # what was sent, an unused attempt too
    first = attempts[0] if attempts else None
    return ChunkStats(
        index=k,
        start=plan.chunks[k].start,
        end=plan.chunks[k].end,
        prompt_tokens=sum(g.prompt_tokens for g in generations),
        cached_prompt_tokens=sum(g.cached_prompt_tokens for g in generations),
        computed_prefill_tokens=sum(g.computed_prefill_tokens for g in generations),
        output_tokens=sum(g.output_tokens for g in generations),
        summary_tokens=len(tokenizer.encode(kept.text)),
        latency_s=latency,
        retries=max(0, len(attempts) - 1),
        failovers=sum(g.failovers for g in generations),
        status=kept.status,
        replica=generations[-1].replica if generations else None,
        given_up=given_up,
        first_verdict=first.verdict if first else None,
        first_grounding=round(first.grounding.score, 4) if first else None,
        first_salient_tokens=len(first.grounding.salient) if first else 0,
        first_ungrounded=list(first.grounding.ungrounded) if first else [],
        grounding=round(kept.grounding.score, 4),
        salient_tokens=len(kept.grounding.salient),
        ungrounded=list(kept.grounding.ungrounded),
        dropped_sentences=kept.dropped_sentences,
        content=choice(plan.history, plan.options, plan.chunks[k]) if attempts else None,
    )
