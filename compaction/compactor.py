"""The strategies: plan (pure: render, partition, lay out) and run (dispatch, check, merge).

Sequential compaction is the same flow with one prompt over the whole span; extractive
compaction partitions like parallel but asks no model (each chunk's most salient lines).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from compaction.backend import Backend, GenerationRequest
from compaction.errors import ContextOverflow, InvalidInput
from compaction.extractive import extract, segments
from compaction.grounding import Source
from compaction.history import (
    ChatTokenizer,
    Message,
    RenderedHistory,
    parse_messages,
    render_history,
    template_view,
)
from compaction.layouts import ChunkPrompt, build_prompts, prefill_floor
from compaction.options import CompactionOptions
from compaction.partition import Chunk, partition
from compaction.result import ChunkStats, CompactionResult, CompactionStats
from compaction.settle import Attempt, Settled, settle, should_retry

SUMMARY_HEADER = "Summary of the earlier conversation (compacted):"
RETRY_REPETITION_PENALTY = 1.3


@dataclass(frozen=True)
class CompactionPlan:
    """Everything decided before any model call; the coordinator routes from it."""

    options: CompactionOptions
    history: RenderedHistory
    kept_head: int  # leading system messages kept verbatim
    kept_tail_from: int  # index of the first recent message kept verbatim
    span: tuple[int, int]  # token range compacted
    chunks: tuple[Chunk, ...]  # the span cut in chunk order (one chunk when sequential)
    prompts: tuple[ChunkPrompt, ...]  # one per chunk, in chunk order; none when extractive
    strict_prompts: tuple[ChunkPrompt, ...]  # same bodies, stricter tails (retries)
    prefill_floor_tokens: int


class Compactor:
    """Compacts histories with one tokenizer (chat template) and one backend."""

    def __init__(
        self, tokenizer: ChatTokenizer, backend: Backend, *, context_window: int, block_size: int = 16
    ) -> None:
        self.tokenizer = tokenizer
        self.backend = backend
        self.context_window = context_window
        self.block_size = block_size

    def plan(
        self,
        messages: Sequence[Message | Mapping[str, Any]],
        options: CompactionOptions | Mapping[str, Any] | None,
    ) -> CompactionPlan:
        """Validate, render once, partition and lay out. Raises InvalidInput naming the problem."""
        opts = CompactionOptions.parse(options)
        history = render_history(parse_messages(messages), self.tokenizer)
        head, tail_from = self._kept_ends(history, opts.keep_recent_tokens)
        starts = (*history.message_starts, len(history.token_ids))
        span = (starts[head], starts[tail_from])
        if opts.strategy == "sequential":
            chunks: tuple[Chunk, ...] = (Chunk(0, *span),)
        else:
            chunks = partition(*span, opts.chunk_tokens, self.block_size)
        if opts.chunk_instructions and max(opts.chunk_instructions) >= len(chunks):
            raise InvalidInput(
                "chunk_instructions",
                f"names chunk {max(opts.chunk_instructions)} but there are {len(chunks)}",
            )
        if opts.strategy == "extractive":
            return CompactionPlan(opts, history, head, tail_from, span, chunks, (), (), 0)
        prompts = build_prompts(history, self.tokenizer, opts, chunks, span[1])
        self._check_window(prompts, opts)
        strict = build_prompts(history, self.tokenizer, opts, chunks, span[1], strict=True)
        floor = prefill_floor(prompts, span[1], self.block_size)
        return CompactionPlan(opts, history, head, tail_from, span, chunks, prompts, strict, floor)

    @staticmethod
    def _kept_ends(history: RenderedHistory, keep_recent_tokens: int) -> tuple[int, int]:
        """(leading system messages kept, first recent message kept): whole messages only."""
        count = len(history.messages)
        head = 0
        while head < count and history.messages[head].role == "system":
            head += 1
        if head == count:
            raise InvalidInput("messages", "the history holds only system messages; nothing to compact")
        starts = (*history.message_starts, len(history.token_ids))
        tail_from = count
        while tail_from > head and starts[count] - starts[tail_from - 1] <= keep_recent_tokens:
            tail_from -= 1
        if tail_from == head:
            raise InvalidInput(
                "keep_recent_tokens",
                f"{keep_recent_tokens} keeps the whole history verbatim; nothing to compact",
            )
        return head, tail_from

    def _check_window(self, prompts: Sequence[ChunkPrompt], opts: CompactionOptions) -> None:
        for p in prompts:
            need = len(p) + opts.max_chunk_summary_tokens
            if need <= self.context_window:
                continue
            if opts.strategy == "sequential":
                raise ContextOverflow(
                    "messages",
                    f"the history ({len(p.body)} tokens) plus instructions and the summary budget needs {need} "
                    f"tokens, over the model window of {self.context_window}; use strategy=parallel with "
                    "layout=independent, or keep fewer tokens",
                )
            raise ContextOverflow(
                "messages",
                f"the prompt of chunk {p.chunk.index} needs {need} tokens, over the model window of "
                f"{self.context_window} ({opts.layout} puts the history before the chunk in the prompt); "
                "use layout=independent or compact a shorter history",
            )

    async def compact(
        self,
        messages: Sequence[Message | Mapping[str, Any]],
        options: CompactionOptions | Mapping[str, Any] | None = None,
    ) -> CompactionResult:
        """Plan and run on this compactor's backend. The caller's messages are never modified."""
        return await self.run(self.plan(messages, options))

    async def run(
        self, plan: CompactionPlan, routes: Sequence[str | None] | None = None, backend: Backend | None = None
    ) -> CompactionResult:
        """Dispatch every chunk prompt at once, check each summary, merge in chunk order.

        `routes` gives each chunk's routing key (a replica choice made by the coordinator).
        If any chunk fails for good, the error propagates and the other requests are cancelled.
        """
        began = time.perf_counter()
        if plan.options.strategy == "extractive":
            extracted = [self._extract(plan, chunk) for chunk in plan.chunks]
            return self._merge(plan, extracted, time.perf_counter() - began)
        keys = list(routes) if routes is not None else [None] * len(plan.prompts)
        target = backend or self.backend
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._summarise(target, plan, k, keys[k])) for k in range(len(plan.prompts))]
        except ExceptionGroup as failed:  # one chunk failed for good; the others were cancelled
            raise failed.exceptions[0] from None
        per_chunk = [t.result() for t in tasks]
        return self._merge(plan, per_chunk, time.perf_counter() - began)

    async def _summarise(
        self, backend: Backend, plan: CompactionPlan, k: int, route: str | None
    ) -> tuple[ChunkStats, str]:
        opts = plan.options
        began = time.perf_counter()
        source = self._source(plan, k)
        attempts: list[Attempt] = []
        while not attempts or should_retry(attempts, opts):
            strict = bool(attempts)
            request = GenerationRequest(
                prompt_token_ids=(plan.strict_prompts if strict else plan.prompts)[k].token_ids,
                max_tokens=opts.max_chunk_summary_tokens,
                min_tokens=opts.max_chunk_summary_tokens if opts.fixed_output_tokens else 0,
                temperature=opts.temperature,
                repetition_penalty=RETRY_REPETITION_PENALTY if strict else 1.0,
                request_id=f"chunk-{k}-{'retry' if strict else 'first'}",
                routing_key=route,
            )
            attempts.append(Attempt.of(await backend.generate(request), source))
        chunk = plan.chunks[k]
        kept = settle(
            attempts,
            opts,
            source,
            verbatim=lambda: self.tokenizer.decode(plan.history.token_ids[chunk.start : chunk.end]).strip(),
            extractive=lambda: self._extractive_text(plan, chunk),
        )
        return self._chunk_stats(plan, k, attempts, kept, time.perf_counter() - began), kept.text

    def _source(self, plan: CompactionPlan, k: int) -> Source:
        """What chunk k's summary may state: the chunk, the history before it, and the prompt's instructions."""
        before = segments(plan.history, self.tokenizer, 0, plan.chunks[k].end)
        return Source(*(s.text for s in before), self.tokenizer.decode(plan.prompts[k].tail))

    def _extractive_text(self, plan: CompactionPlan, chunk: Chunk) -> str:
        budget = plan.options.max_chunk_summary_tokens
        return extract(plan.history, self.tokenizer, chunk.start, chunk.end, budget)

    def _extract(self, plan: CompactionPlan, chunk: Chunk) -> tuple[ChunkStats, str]:
        """Strategy extractive: chunk's most salient lines, no model call."""
        began = time.perf_counter()
        text = self._extractive_text(plan, chunk)
        source = Source(*(s.text for s in segments(plan.history, self.tokenizer, 0, chunk.end)))
        kept = Settled(text, "extractive", 0, source.check(text))
        return self._chunk_stats(plan, chunk.index, [], kept, time.perf_counter() - began), text

    def _chunk_stats(
        self, plan: CompactionPlan, k: int, attempts: list[Attempt], kept: Settled, latency: float
    ) -> ChunkStats:
        generations = [a.generation for a in attempts]
        first = attempts[0] if attempts else None
        return ChunkStats(
            index=k,
            start=plan.chunks[k].start,
            end=plan.chunks[k].end,
            prompt_tokens=sum(g.prompt_tokens for g in generations),
            cached_prompt_tokens=sum(g.cached_prompt_tokens for g in generations),
            computed_prefill_tokens=sum(g.computed_prefill_tokens for g in generations),
            output_tokens=sum(g.output_tokens for g in generations),
            summary_tokens=len(self.tokenizer.encode(kept.text)),
            latency_s=latency,
            retries=max(0, len(attempts) - 1),
            failovers=sum(g.failovers for g in generations),
            status=kept.status,
            replica=generations[-1].replica if generations else None,
            first_verdict=first.verdict if first else None,
            first_grounding=round(first.grounding.score, 4) if first else None,
            first_salient_tokens=len(first.grounding.salient) if first else 0,
            first_ungrounded=list(first.grounding.ungrounded) if first else [],
            grounding=round(kept.grounding.score, 4),
            salient_tokens=len(kept.grounding.salient),
            ungrounded=list(kept.grounding.ungrounded),
            dropped_sentences=kept.dropped_sentences,
        )

    def _merge(self, plan: CompactionPlan, per_chunk: list[tuple[ChunkStats, str]], latency: float) -> CompactionResult:
        stats = [s for s, _ in per_chunk]
        summary = "\n\n".join(text for _, text in per_chunk if text)
        messages = [
            *plan.history.messages[: plan.kept_head],
            Message(role="user", content=f"{SUMMARY_HEADER}\n{summary}"),
            *plan.history.messages[plan.kept_tail_from :],
        ]
        compacted = len(self.tokenizer.encode(self.tokenizer.render([template_view(m) for m in messages])))
        opts = plan.options
        return CompactionResult(
            messages=messages,
            summary=summary,
            stats=CompactionStats(
                strategy=opts.strategy,
                layout=opts.layout if opts.strategy == "parallel" else opts.strategy,
                variant=opts.variant,
                history_tokens=len(plan.history.token_ids),
                input_tokens=plan.span[1] - plan.span[0],
                chunks=len(stats),
                prompt_tokens=sum(s.prompt_tokens for s in stats),
                cached_prompt_tokens=sum(s.cached_prompt_tokens for s in stats),
                computed_prefill_tokens=sum(s.computed_prefill_tokens for s in stats),
                prefill_floor_tokens=plan.prefill_floor_tokens,
                output_tokens=sum(s.output_tokens for s in stats),
                summary_tokens=len(self.tokenizer.encode(summary)),
                compacted_tokens=compacted,
                latency_s=latency,
                retries=sum(s.retries for s in stats),
                failovers=sum(s.failovers for s in stats),
                empty_or_runaway_chunks=[s.index for s in stats if s.first_verdict not in (None, "ok")],
                grounding_threshold=opts.grounding_threshold if opts.strategy != "extractive" else 0.0,
                ungrounded_chunks=[
                    s.index
                    for s in stats
                    if s.first_grounding is not None and s.first_grounding < opts.grounding_threshold
                ],
                extractive_fallback_chunks=[s.index for s in stats if s.status == "extractive_fallback"],
                replicas=[s.replica for s in stats],
                per_chunk=stats,
            ),
        )
