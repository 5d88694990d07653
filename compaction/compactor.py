"""The strategies: plan (pure: render, partition, lay out) and run (dispatch, check, merge).

Sequential compaction is the same flow with one prompt over the whole span; extractive
compaction partitions like parallel but asks no model (each chunk's most salient lines).

Incremental by construction: the summaries of earlier compactions at the head of a history are
carried verbatim (`carry_summary_tokens`), not summarised again, and with a `ChunkCache` a chunk
whose prompt is unchanged since an earlier compaction is not summarised again either.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from compaction.backend import Backend, GenerationRequest
from compaction.chunk_cache import ChunkCache, scope_of
from compaction.chunk_content import choice
from compaction.errors import ContextOverflow, InvalidInput, NothingToCompact
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
from compaction.instructions import caller_instructions
from compaction.layouts import ChunkPrompt, lay_out
from compaction.limits import PlanLimits
from compaction.options import CompactionOptions
from compaction.partition import Chunk, partition
from compaction.pinning import ChunkText, model_budget, pin
from compaction.quality import drop_seen
from compaction.result import ChunkStats, CompactionResult, CompactionStats
from compaction.settle import Attempt, Settled, settle, should_retry
from compaction.sources import ChunkSources
from compaction.user_words import UserWords
from compaction.user_words import budget as user_words_budget
from compaction.user_words import keep as keep_user_words
from compaction.validity import check_history, check_output, turn_start

SUMMARY_HEADER = "Summary of the earlier conversation (compacted):"
RETRY_REPETITION_PENALTY = 1.3
_Kept = tuple[ChunkStats, str]  # a chunk's stats and kept text
_CLOSED = ("kept_verbatim", "extractive_fallback")  # fallback texts: no lines are pinned beside them


def request_id(k: int, strict: bool = False) -> str:
    """The request id of chunk k's first prompt or of its stricter retry (engine logs, the coordinator's figures)."""
    return f"chunk-{k}-{'retry' if strict else 'first'}"


def is_summary(message: Message) -> bool:
    """True for the summary message a compaction wrote (the client carries it in its history)."""
    return message.role == "user" and message.text().startswith(SUMMARY_HEADER)


@dataclass(frozen=True)
class CompactionPlan:
    """Everything decided before any model call; the coordinator routes from it."""

    options: CompactionOptions
    history: RenderedHistory
    kept_head: int  # leading messages kept verbatim: system messages, then carried earlier summaries
    kept_tail_from: int  # index of the first recent message kept verbatim
    carried_tokens: int  # tokens of the earlier summaries carried verbatim in the head
    scope: str  # the options that shape a chunk summary, as the chunk cache's key
    span: tuple[int, int]  # token range compacted
    chunks: tuple[Chunk, ...]  # the span cut in chunk order (one chunk when sequential)
    prompts: tuple[ChunkPrompt, ...]  # one per chunk, in chunk order; none when extractive
    strict_prompts: tuple[ChunkPrompt, ...]  # same bodies, stricter tails (retries)
    prefill_floor_tokens: int
    windows: int = 1  # groups of chunk prompts sharing a window start (windowed layout), else 1
    sources: ChunkSources | None = None  # what each chunk's summary may state, built in one pass over the history


class Compactor:
    """Compacts histories with one tokenizer (chat template) and one backend."""

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        backend: Backend,
        *,
        context_window: int,
        block_size: int = 16,
        cache: ChunkCache | None = None,
        limits: PlanLimits | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.backend = backend
        self.context_window = context_window
        self.block_size = block_size
        self.cache = cache  # chunk summaries reused across compactions; None disables reuse
        self.limits = limits  # caps on chunks and history tokens (compaction.limits); None: none

    def plan(
        self,
        messages: Sequence[Message | Mapping[str, Any]],
        options: CompactionOptions | Mapping[str, Any] | None,
        namespace: str = "",
    ) -> CompactionPlan:
        """Validate, render once, partition and lay out. Raises InvalidInput naming the problem. `namespace`
        (a tenant): chunk summaries are reused only within it."""
        opts = CompactionOptions.parse(options)
        parsed = parse_messages(messages)
        check_history(parsed)
        history = render_history(parsed, self.tokenizer)
        if self.limits is not None:
            self.limits.check_history(len(history.token_ids))
        system, head, summaries, tail_from = self._kept_ends(history, opts)
        starts = (*history.message_starts, len(history.token_ids))
        span = (starts[head], starts[tail_from])
        scope = scope_of(opts, namespace)
        if opts.strategy == "sequential":
            chunks: tuple[Chunk, ...] = (Chunk(0, *span),)
        else:
            # Summaries summarised again (not carried) form chunks of their own: a second level.
            chunks = self._partition(history, opts, span, [starts[summaries]] if head < summaries else [], scope)
        if opts.chunk_instructions and max(opts.chunk_instructions) >= len(chunks):
            raise InvalidInput(
                "chunk_instructions",
                f"names chunk {max(opts.chunk_instructions)} but there are {len(chunks)}",
            )
        carried = starts[head] - starts[system]
        sources = ChunkSources(history, self.tokenizer, [c.end for c in chunks])
        if opts.strategy == "extractive":
            return CompactionPlan(opts, history, head, tail_from, carried, scope, span, chunks, (), (), 0, 1, sources)
        laid = lay_out(history, self.tokenizer, opts, chunks, span[1], self.context_window, self.block_size)
        self._check_window((*laid.prompts, *laid.strict_prompts), laid.options)
        return CompactionPlan(
            laid.options,
            history,
            head,
            tail_from,
            carried,
            scope,
            span,
            chunks,
            laid.prompts,
            laid.strict_prompts,
            laid.floor,
            len(laid.windows),
            sources,
        )

    def _partition(
        self, history: RenderedHistory, opts: CompactionOptions, span: tuple[int, int], fixed: list[int], scope: str
    ) -> tuple[Chunk, ...]:
        """Cut the span; borders of chunks cached before stay borders unless that passes max_chunks."""
        cached = []
        if self.cache is not None and opts.strategy == "parallel" and opts.reuse_chunks:
            cached = self.cache.borders(history.token_ids, *span, scope)
        chunks = partition(*span, opts.chunk_tokens, self.block_size, fixed + cached)
        if self.limits is None or len(chunks) <= self.limits.max_chunks:
            return chunks
        chunks = partition(*span, opts.chunk_tokens, self.block_size, fixed)
        cut = lambda size: partition(*span, size, self.block_size, fixed)  # noqa: E731
        self.limits.check_chunks(chunks, opts.chunk_tokens, cut, span[1] - span[0])
        return chunks

    @staticmethod
    def _kept_ends(history: RenderedHistory, opts: CompactionOptions) -> tuple[int, int, int, int]:
        """(system messages, messages kept at the head, end of the earlier summaries, first recent message kept).

        Whole messages only. The head is the leading system messages, then the summaries of earlier
        compactions while together they fit `carry_summary_tokens` (else they are summarised again).
        """
        count = len(history.messages)
        starts = (*history.message_starts, len(history.token_ids))
        system = 0
        while system < count and history.messages[system].role == "system":
            system += 1
        if system == count:
            raise NothingToCompact("messages", "the history holds only system messages; nothing to compact")
        summaries = system
        while summaries < count and is_summary(history.messages[summaries]):
            summaries += 1
        head = summaries if starts[summaries] - starts[system] <= opts.carry_summary_tokens else system
        if head == count:
            raise NothingToCompact("messages", "the history holds only system messages and earlier summaries")
        tail_from = count
        keep = opts.keep_recent_tokens
        while tail_from > head and starts[count] - starts[tail_from - 1] <= keep:
            tail_from -= 1
        if opts.keep_current_turn:
            users = [i for i in range(head, count) if history.messages[i].role == "user"]
            tail_from = min(tail_from, users[-1]) if users else tail_from
        tail_from = turn_start(history.messages, tail_from, head)
        if tail_from == head:
            field = "keep_current_turn" if opts.keep_current_turn else "keep_recent_tokens"
            message = f"keeps the whole history verbatim ({keep} recent tokens); nothing to compact"
            raise NothingToCompact(field, message)
        return system, head, summaries, tail_from

    def _check_window(self, prompts: Sequence[ChunkPrompt], opts: CompactionOptions) -> None:
        for p in prompts:
            need = len(p) + opts.max_chunk_summary_tokens
            if need <= self.context_window:
                continue
            if opts.strategy == "sequential":
                raise ContextOverflow(
                    "messages",
                    f"the history ({len(p.body)} tokens) plus instructions and the summary budget needs {need} "
                    f"tokens, over the model window of {self.context_window}; use strategy=parallel (its default "
                    "layout=auto fits any history), or keep fewer tokens",
                )
            raise ContextOverflow(
                "messages",
                f"the prompt of chunk {p.chunk.index} needs {need} tokens, over the model window of "
                f"{self.context_window} ({opts.layout} puts the history before the chunk in the prompt); "
                "use layout=auto (windowed when the history is too long) or compact a shorter history",
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
        reused = {k: hit for k in range(len(plan.prompts)) if (hit := self._cached(plan, k)) is not None}
        try:
            async with asyncio.TaskGroup() as group:
                tasks = {
                    k: group.create_task(self._summarise(target, plan, k, keys[k]))
                    for k in range(len(plan.prompts))
                    if k not in reused
                }
        except ExceptionGroup as failed:  # one chunk failed for good; the others were cancelled
            raise failed.exceptions[0] from None
        per_chunk = [reused[k] if k in reused else tasks[k].result() for k in range(len(plan.prompts))]
        if self.cache is not None:
            for k, task in tasks.items():
                stats, text = task.result()
                prompt = plan.prompts[k]
                self.cache.put(plan.scope, plan.history.token_ids, prompt.chunk, prompt.view, text, stats)
        return self._merge(plan, per_chunk, time.perf_counter() - began)

    def reusable(self, plan: CompactionPlan) -> frozenset[int]:
        """Chunks whose summary the chunk cache already holds: `run` sends no prompt for them."""
        return frozenset(k for k in range(len(plan.prompts)) if self._cached(plan, k) is not None)

    def _cached(self, plan: CompactionPlan, k: int) -> tuple[ChunkStats, str] | None:
        """Chunk k's summary from the cache, if this exact prompt was summarised before."""
        if self.cache is None or not plan.options.reuse_chunks:
            return None
        prompt = plan.prompts[k]
        hit = self.cache.get(plan.scope, plan.history.token_ids, prompt.chunk, prompt.view)
        if hit is None:
            return None
        nothing = {"prompt_tokens": 0, "cached_prompt_tokens": 0, "computed_prefill_tokens": 0, "output_tokens": 0}
        update = {**nothing, "index": k, "latency_s": 0.0, "retries": 0, "failovers": 0, "replica": None}
        return hit.stats.model_copy(update={**update, "reused": True}), hit.text

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
                max_tokens=model_budget(opts),
                min_tokens=model_budget(opts) if opts.fixed_output_tokens else 0,
                temperature=opts.temperature,
                repetition_penalty=max(RETRY_REPETITION_PENALTY, opts.repetition_penalty)
                if strict
                else opts.repetition_penalty,
                request_id=request_id(k, strict),
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
            instructions=self.tokenizer.decode(plan.prompts[k].tail),
        )
        return self._chunk_stats(plan, k, attempts, kept, time.perf_counter() - began), kept.text

    def _pinned(
        self, plan: CompactionPlan, per_chunk: list[tuple[ChunkStats, str]], words: str
    ) -> list[tuple[ChunkStats, str]]:
        """Each chunk's summary with its pinned lines (`pinned_share`; `words`: the kept user words)."""
        opts = plan.options
        if opts.pinned_share == 0 or opts.strategy == "extractive":
            return per_chunk
        texts = [
            ChunkText(text, segments(plan.history, self.tokenizer, c.start, c.end), c.size, s.status not in _CLOSED)
            for c, (s, text) in zip(plan.chunks, per_chunk, strict=True)
        ]
        pinned = pin(texts, self.tokenizer, opts.max_chunk_summary_tokens, words)
        return [
            (s.model_copy(update={
                "pinned_lines": p.lines,
                "summary_tokens": len(self.tokenizer.encode(p.text)),
                "dropped_sentences": s.dropped_sentences + p.dropped_sentences,
            }), p.text)
            for (s, _), p in zip(per_chunk, pinned, strict=True)
        ]  # fmt: skip

    def user_words(self, plan: CompactionPlan) -> UserWords:
        """The user's messages of the compacted span kept verbatim in the compacted head (`user_words_tokens`)."""
        span = plan.history.messages[plan.kept_head : plan.kept_tail_from]
        return keep_user_words(span, self.tokenizer, user_words_budget(plan.options, self.context_window), is_summary)

    def _source(self, plan: CompactionPlan, k: int) -> Source:
        """What chunk k's summary may state: the chunk, the history before it, and the caller's instructions
        (chunk_instructions and instructions).

        Our own instruction text (part numbers, the word budget) is not a source: a summary that
        states "24" because the tail said "at most 24 words" has invented it.
        """
        extra = caller_instructions(plan.options, k)
        if plan.sources is not None:
            return plan.sources.source(plan.chunks[k].end, *([extra] if extra else []))
        before = segments(plan.history, self.tokenizer, 0, plan.chunks[k].end)
        return Source(*(s.text for s in before), *([extra] if extra else []))

    def _extractive_text(self, plan: CompactionPlan, chunk: Chunk) -> str:
        budget = plan.options.max_chunk_summary_tokens
        return extract(plan.history, self.tokenizer, chunk.start, chunk.end, budget)

    def _extract(self, plan: CompactionPlan, chunk: Chunk) -> tuple[ChunkStats, str]:
        """Strategy extractive: chunk's most salient lines, no model call."""
        began = time.perf_counter()
        text = self._extractive_text(plan, chunk)
        if plan.sources is not None:
            source = plan.sources.source(chunk.end)
        else:
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
            content=choice(plan.history, plan.options, plan.chunks[k]) if attempts else None,
        )

    def _merge(self, plan: CompactionPlan, per_chunk: list[tuple[ChunkStats, str]], latency: float) -> CompactionResult:
        words = self.user_words(plan)
        per_chunk = self._pinned(plan, per_chunk, "\n".join(words.texts))
        stats = [s for s, _ in per_chunk]
        seen: list[tuple[str, ...]] = []  # no sentence of the summary repeats another, across chunks too
        texts = [drop_seen(text, seen) for _, text in per_chunk]
        summary = "\n\n".join(text for text in texts if text)
        head = "\n\n".join(part for part in (f"{SUMMARY_HEADER}\n{summary}", words.render()) if part)
        messages = [
            *plan.history.messages[: plan.kept_head],
            Message(role="user", content=head),
            *plan.history.messages[plan.kept_tail_from :],
        ]
        check_output(messages)
        compacted = len(self.tokenizer.encode(self.tokenizer.render([template_view(m) for m in messages])))
        opts = plan.options
        return CompactionResult(
            messages=messages,
            summary=summary,
            kept_head=plan.kept_head,
            replaces_through=plan.kept_tail_from,
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
                windows=plan.windows,
                output_tokens=sum(s.output_tokens for s in stats),
                summary_tokens=len(self.tokenizer.encode(summary)),
                compacted_tokens=compacted,
                latency_s=latency,
                retries=sum(s.retries for s in stats),
                failovers=sum(s.failovers for s in stats),
                reused_chunks=sum(s.reused for s in stats),
                carried_summary_tokens=plan.carried_tokens,
                user_words_kept=len(words.texts),
                user_words_dropped=words.dropped,
                user_words_tokens=len(self.tokenizer.encode(words.render())) if words.texts else 0,
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
