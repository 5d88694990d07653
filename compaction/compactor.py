"""The two strategies: plan (pure: render, partition, lay out) and run (dispatch, check, merge).

Sequential compaction is the same flow with one prompt over the whole span.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from compaction.backend import Backend, Generation, GenerationRequest
from compaction.errors import ContextOverflow, InvalidInput
from compaction.history import (
    ChatTokenizer,
    Message,
    RenderedHistory,
    parse_messages,
    render_history,
    template_view,
)
from compaction.layouts import ChunkPrompt, lay_out
from compaction.options import CompactionOptions
from compaction.partition import Chunk, partition
from compaction.quality import collapse_repeats, judge
from compaction.result import ChunkStats, CompactionResult, CompactionStats
from compaction.validity import check_history, check_output, turn_start

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
    prompts: tuple[ChunkPrompt, ...]  # one per chunk, in chunk order
    strict_prompts: tuple[ChunkPrompt, ...]  # same bodies, stricter tails (retries)
    prefill_floor_tokens: int
    windows: int = 1  # groups of chunk prompts sharing a window start (windowed layout), else 1

    @property
    def chunks(self) -> tuple[Chunk, ...]:
        return tuple(p.chunk for p in self.prompts)


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
        parsed = parse_messages(messages)
        check_history(parsed)
        history = render_history(parsed, self.tokenizer)
        head, tail_from = self._kept_ends(history, opts.keep_recent_tokens)
        starts = (*history.message_starts, len(history.token_ids))
        span = (starts[head], starts[tail_from])
        if opts.strategy == "parallel":
            chunks = partition(*span, opts.chunk_tokens, self.block_size)
        else:
            chunks = (Chunk(0, *span),)
        if opts.chunk_instructions and max(opts.chunk_instructions) >= len(chunks):
            raise InvalidInput(
                "chunk_instructions",
                f"names chunk {max(opts.chunk_instructions)} but there are {len(chunks)}",
            )
        laid = lay_out(history, self.tokenizer, opts, chunks, span[1], self.context_window, self.block_size)
        self._check_window((*laid.prompts, *laid.strict_prompts), laid.options)
        return CompactionPlan(
            laid.options,
            history,
            head,
            tail_from,
            span,
            laid.prompts,
            laid.strict_prompts,
            laid.floor,
            len(laid.windows),
        )

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
        tail_from = turn_start(history.messages, tail_from, head)
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
        attempts: list[Generation] = []
        fixed = opts.fixed_output_tokens
        for strict in (False, True):
            prompt = (plan.strict_prompts if strict else plan.prompts)[k]
            request = GenerationRequest(
                prompt_token_ids=prompt.token_ids,
                max_tokens=opts.max_chunk_summary_tokens,
                min_tokens=opts.max_chunk_summary_tokens if fixed else 0,
                temperature=opts.temperature,
                repetition_penalty=RETRY_REPETITION_PENALTY if strict else 1.0,
                request_id=f"chunk-{k}-{'retry' if strict else 'first'}",
                routing_key=route,
            )
            attempts.append(await backend.generate(request))
            verdict = judge(attempts[-1].text, attempts[-1].finish_reason)
            if verdict == "ok" or fixed or not opts.retry_bad_summaries:
                break
        text, status = self._settle(plan, k, attempts, verdict)
        last = attempts[-1]
        stats = ChunkStats(
            index=k,
            start=plan.prompts[k].chunk.start,
            end=plan.prompts[k].chunk.end,
            prompt_tokens=sum(a.prompt_tokens for a in attempts),
            cached_prompt_tokens=sum(a.cached_prompt_tokens for a in attempts),
            computed_prefill_tokens=sum(a.computed_prefill_tokens for a in attempts),
            output_tokens=sum(a.output_tokens for a in attempts),
            summary_tokens=len(self.tokenizer.encode(text)),
            latency_s=time.perf_counter() - began,
            retries=len(attempts) - 1,
            failovers=sum(a.failovers for a in attempts),
            status=status,
            replica=last.replica,
        )
        return stats, text

    def _settle(self, plan: CompactionPlan, k: int, attempts: list[Generation], verdict: str) -> tuple[str, Any]:
        """The text kept for chunk k and its status: nothing empty or looping is spliced in silently."""
        text = attempts[-1].text.strip()
        if verdict == "ok" or plan.options.fixed_output_tokens:
            return text, "ok" if len(attempts) == 1 else "retried"
        if verdict == "runaway":
            return collapse_repeats(text), "runaway_trimmed"
        chunk = plan.prompts[k].chunk
        raw = self.tokenizer.decode(plan.history.token_ids[chunk.start : chunk.end]).strip()
        return raw, "kept_verbatim"

    def _merge(self, plan: CompactionPlan, per_chunk: list[tuple[ChunkStats, str]], latency: float) -> CompactionResult:
        stats = [s for s, _ in per_chunk]
        summary = "\n\n".join(text for _, text in per_chunk if text)
        messages = [
            *plan.history.messages[: plan.kept_head],
            Message(role="user", content=f"{SUMMARY_HEADER}\n{summary}"),
            *plan.history.messages[plan.kept_tail_from :],
        ]
        check_output(messages)
        compacted = len(self.tokenizer.encode(self.tokenizer.render([template_view(m) for m in messages])))
        opts = plan.options
        return CompactionResult(
            messages=messages,
            summary=summary,
            stats=CompactionStats(
                strategy=opts.strategy,
                layout=opts.layout if opts.strategy == "parallel" else "sequential",
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
                empty_or_runaway_chunks=[s.index for s in stats if s.status != "ok"],
                replicas=[s.replica for s in stats],
                per_chunk=stats,
            ),
        )
