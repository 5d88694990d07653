"""Stage 4: a compaction, planned (`compaction.plan`), run and merged (`compaction.merge`).

`Compactor.run` sends every chunk prompt at once on the backend, each settled through the checks
(`compaction.chunk_summary`, `compaction.checks`: retry, strip, fall back), and merges them in chunk order.
Sequential compaction is the same flow with one prompt over the whole span; extractive
compaction partitions like parallel but asks no model (each chunk's most salient lines).

Incremental by construction: the summaries of earlier compactions at the head of a history are
carried verbatim (`carry_summary_tokens`), not summarised again, and with a `ChunkCache` a chunk
whose prompt is unchanged since an earlier compaction is not summarised again either.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from compaction.backend import Backend
from compaction.bounded import BoundedLRU
from compaction.chunk_cache import ChunkCache
from compaction.chunk_summary import extract_chunk, summarise_chunk
from compaction.history import Message
from compaction.merge import merge
from compaction.options import CompactionOptions
from compaction.pacing import AGENT, Escalation, first_of, unless_raised, urgency
from compaction.partition import PlanLimits
from compaction.plan import CompactionPlan, Planner
from compaction.result import ChunkStats, CompactionResult
from compaction.tokenizer import ChatTokenizer

FALLBACKS = frozenset({"kept_verbatim", "extractive_fallback"})  # a chunk's statuses without a model summary
FELL_BACK_ENTRIES = 4096  # chunk prompts remembered as fallen back in a background run
LASTS = 4096  # rolling runs' last chunks in flight, by where they start (`Compactor._newest_last`)
_Kept = tuple[ChunkStats, str]  # a chunk's stats and kept text
Ahead = Literal["turn", "reply"]  # a rolling run's last chunk: of a turn's history, or of it with the turn's reply


@dataclass(frozen=True)
class _InFlight:
    """A chunk prompt being summarised: the backend it goes out on, and its summary once done."""

    backend: Backend
    done: asyncio.Future[_Kept]


async def _join(other: _InFlight, backend: Backend) -> None:
    """Until another run's summary of the same prompt is done; that prompt is raised to the agent's priority where
    it is once this run's prompts go there (now, or when a turn waits for this run)."""
    while not other.done.done():
        if urgency(backend) < urgency(other.backend) and isinstance(other.backend, Escalation):
            other.backend.hurry()
        if urgency(backend) <= AGENT or not isinstance(backend, Escalation):
            await asyncio.wait({other.done})
            return
        raised: asyncio.Future[Any] = asyncio.ensure_future(backend.until_raised())
        try:
            await asyncio.wait({other.done, raised}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            raised.cancel()


def _as_reused(kept: _Kept, k: int) -> _Kept:
    """Chunk k's summary made by another run (the chunk cache, or a run in flight): none of its work is this run's."""
    stats, text = kept
    nothing = {"prompt_tokens": 0, "cached_prompt_tokens": 0, "computed_prefill_tokens": 0, "output_tokens": 0}
    update = {**nothing, "index": k, "latency_s": 0.0, "retries": 0, "failovers": 0, "replica": None}
    return stats.model_copy(update={**update, "reused": True}), text


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
        self.limits = limits  # caps on chunks and history tokens (compaction.partition); None: none
        self._in_flight: dict[tuple[str, ...], _InFlight] = {}  # chunk prompts being summarised, by identity
        self._lasts: BoundedLRU[tuple[str, ...], list[tuple[tuple[str, ...], asyncio.Event]]] = BoundedLRU(LASTS)
        self._fell_back: BoundedLRU[tuple[str, ...], bool] = BoundedLRU(FELL_BACK_ENTRIES)  # in background runs

    def plan(
        self,
        messages: Sequence[Message | Mapping[str, Any]],
        options: CompactionOptions | Mapping[str, Any] | None,
        namespace: str = "",
        prefer_tail_from: int | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> CompactionPlan:
        """Stage 3 (`compaction.plan`): validate, render once, partition and lay out. Raises InvalidInput naming
        the problem. `namespace` (a tenant): chunk summaries are reused only within it; `prefer_tail_from`: where
        the kept tail may start instead (`compaction.plan.kept_ends`); `tools`: the agent's tool list."""
        planner = Planner(self.tokenizer, self.context_window, self.block_size, self.cache, self.limits)
        return planner.plan(messages, options, namespace, prefer_tail_from, tools)

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
            extracted = [extract_chunk(self.tokenizer, plan, chunk) for chunk in plan.chunks]
            return self._merge(plan, extracted, time.perf_counter() - began)
        summaries = await self.summarise(plan, range(len(plan.prompts)), routes, backend)
        per_chunk = [summaries[k] for k in range(len(plan.prompts))]
        return self._merge(plan, per_chunk, time.perf_counter() - began)

    async def summarise(
        self,
        plan: CompactionPlan,
        chunks: Iterable[int],
        routes: Sequence[str | None] | None = None,
        backend: Backend | None = None,
        sent: asyncio.Event | None = None,
        ask_fallbacks_again: bool = False,
        ahead: Ahead | None = None,
    ) -> dict[int, _Kept]:
        """The summaries of these chunks of a plan, all sent at once; from the chunk cache where it has them.
        If any chunk fails for good, the error propagates and the other requests are cancelled. `sent` is set
        once every chunk's prompt is in flight (another run of the same prompts then joins them);
        `ask_fallbacks_again` (a background run): a chunk that fell back (no model summary passed the checks) is
        asked again at once, both prompts together, and that answer kept; `ahead`: the plan is a guess at a later
        compaction's (a rolling run's), so its last chunk is kept as one that only ends a span (`ChunkCache.put`),
        and is given up once a later turn's supersedes it (`_newest_last`; "reply": the run of the last turn's
        history with its reply, which supersedes none)."""
        keys = list(routes) if routes is not None else [None] * len(plan.prompts)
        target = backend or self.backend
        wanted = list(chunks)
        reused = {k: hit for k in wanted if (hit := self._cached(plan, k)) is not None}
        last = len(plan.chunks) - 1 if ahead is not None else None
        if ahead == "turn":
            self._supersede(plan)
        try:
            async with asyncio.TaskGroup() as group:
                tasks = {
                    k: group.create_task(
                        self._summarise_and_keep(
                            target, plan, k, keys[k], ask_fallbacks_again, ahead if k == last else None
                        )
                    )
                    for k in wanted
                    if k not in reused
                }
                if sent is not None:
                    await asyncio.sleep(0)  # each task is in flight once it has run to its first await
                    sent.set()
        except ExceptionGroup as failed:  # one chunk failed for good; the others were cancelled
            raise failed.exceptions[0] from None
        done = {k: reused[k] if k in reused else tasks[k].result() for k in wanted}
        return {k: kept for k, kept in done.items() if kept is not None}

    def whole_chunks(self, plan: CompactionPlan, last: bool = False) -> list[int]:
        """The chunks that end at a border of B tokens, not at the span's end: every later compaction of the same
        history, grown at its end, cuts and prompts them the same (the rolling background summaries,
        `serving.background`); with `last`, the one that ends the span too (the same only for a compaction whose
        span ends there). Only with the prefix-exact layout (the other layouts' prompts move as it grows) and a
        chunk cache to keep them in."""
        kept = self.cache is not None and plan.options.reuse_chunks
        stable = kept and plan.options.strategy == "parallel" and plan.options.layout == "prefix_exact"
        return list(range(len(plan.chunks) - (0 if last else 1))) if stable else []

    async def _summarise_and_keep(
        self,
        backend: Backend,
        plan: CompactionPlan,
        k: int,
        route: str | None,
        ask_fallbacks_again: bool = False,
        last: Ahead | None = None,
    ) -> _Kept | None:
        """Chunk k's summary, put in the chunk cache the moment it is done: a run cancelled (its deadline, a
        client gone, a turn that escalates it) or failed in another chunk leaves its finished chunks reusable.

        The same prompt already being summarised (a rolling background run's, `serving.background`) is joined
        instead of sent again, and raised to this run's priority where it is whenever this run's is more urgent (a
        turn's compaction at the threshold, or a background run a turn waits for: `compaction.pacing.Escalation`);
        if that run fails or is cancelled, this one sends it. A rolling run's last chunk (`last`) is None once a
        later run's supersedes it (`_newest_last`)."""
        if self.cache is None or not plan.options.reuse_chunks:
            return await summarise_chunk(self.tokenizer, backend, plan, k, route)
        prompt = plan.prompts[k]
        key = self.cache.key(plan.scope, plan.history.token_ids, prompt.chunk, prompt.view)
        other = self._in_flight.get(key)
        if other is not None:
            await _join(other, backend)
            if not other.done.cancelled():
                return _as_reused(other.done.result(), k)  # fell back or not, it is what a compaction keeps
        elif (done := self._cached(plan, k)) is not None:
            return done  # another run finished it since this one was planned
        own = backend.prompt() if isinstance(backend, Escalation) else backend  # raised alone by a run joining it
        mine = _InFlight(own, asyncio.get_running_loop().create_future())
        self._in_flight[key] = mine
        try:
            both = self._fell_back.pop(key) is not None
            work = summarise_chunk(self.tokenizer, own, plan, k, route, both=both)
            if (kept := await (work if last is None else self._newest_last(key, work))) is None:
                return None
            # A background chunk that fell back is asked again at once, both its prompts together, as a compaction
            # would ask it, and that answer is kept, fallback or not: the tool gaps take the second asking, not the
            # threshold's wait. Raised to the agent's priority before it ended, a chunk was asked for the turn
            # waiting for it, as that turn's own compaction would: its fallback is that compaction's, kept too; so is
            # the fallback of one raised during its second asking (given up: the turn waits for no more than that).
            if ask_fallbacks_again and not both and urgency(own) > AGENT and kept[0].status in FALLBACKS:
                self._fell_back.put(key, True)  # this run cancelled first: the next one to ask sends both
                work = summarise_chunk(self.tokenizer, own, plan, k, route, both=True)
                again = asyncio.ensure_future(work if last is None else self._newest_last(key, work))
                if not await unless_raised(own, again):  # raised first: a turn waiting for it takes the fallback
                    kept = kept[0].model_copy(update={"given_up": True}), kept[1]
                elif (kept := again.result()) is None:
                    return None  # superseded
                self._fell_back.pop(key)
            stats, text = kept
            self.cache.put(plan.scope, plan.history.token_ids, prompt.chunk, prompt.view, text, stats, last is not None)
            mine.done.set_result((stats, text))
            return stats, text
        finally:
            mine.done.cancel()  # failed or cancelled: whoever waited for it sends its own (no-op once set)
            if self._in_flight.get(key) is mine:
                del self._in_flight[key]

    def _supersede(self, plan: CompactionPlan) -> None:
        """A later turn's rolling run: an earlier run's last chunk that starts where a chunk of this plan starts, and
        ends elsewhere, is given up, unless a compaction has joined and raised it (`_newest_last`)."""
        assert self.cache is not None  # rolling runs keep their summaries (`whole_chunks`)
        for prompt in plan.prompts:
            key = self.cache.key(plan.scope, plan.history.token_ids, prompt.chunk, prompt.view)
            for other, given_up in self._lasts.get(key[:2]) or []:
                joined = self._in_flight.get(other)
                if other != key and (joined is None or urgency(joined.backend) > AGENT):
                    given_up.set()

    async def _newest_last(self, key: tuple[str, ...], work: Coroutine[Any, Any, _Kept]) -> _Kept | None:
        """A rolling run's last chunk, given up (None) once a later turn's run supersedes it (`_supersede`): only the
        newest turn's (or its reply's run's) can be the one the compaction at the threshold takes, and background
        time is the agent's tool gaps. The reply's run supersedes none: the threshold takes its turn's last chunk
        when the reply's is not done (`serving.background`)."""
        start = key[:2]  # the options and the history before the chunk
        superseded = asyncio.Event()
        self._lasts.put(start, [*(self._lasts.get(start) or []), (key, superseded)])
        task = asyncio.ensure_future(work)
        try:
            await first_of(task, asyncio.ensure_future(superseded.wait()))
            return task.result() if task.done() else None
        finally:
            task.cancel()
            lasts = [last for last in self._lasts.get(start) or [] if last[1] is not superseded]
            if lasts:
                self._lasts.put(start, lasts)
            else:
                self._lasts.pop(start)

    def reusable(self, plan: CompactionPlan) -> frozenset[int]:
        """Chunks whose summary the chunk cache already holds: `run` sends no prompt for them."""
        return frozenset(k for k in range(len(plan.prompts)) if self._cached(plan, k) is not None)

    def _cached(self, plan: CompactionPlan, k: int) -> tuple[ChunkStats, str] | None:
        """Chunk k's summary from the cache, if this exact prompt was summarised before."""
        if self.cache is None or not plan.options.reuse_chunks:
            return None
        prompt = plan.prompts[k]
        hit = self.cache.get(plan.scope, plan.history.token_ids, prompt.chunk, prompt.view)
        return None if hit is None else _as_reused((hit.stats, hit.text), k)

    def _merge(self, plan: CompactionPlan, per_chunk: list[_Kept], latency: float) -> CompactionResult:
        return merge(plan, per_chunk, latency, self.tokenizer, self.context_window)
