"""The compaction coordinator: partition -> layout -> route -> dispatch -> merge.

A plain class (no Ray import): `serving.app` wraps it in a Serve deployment. `Coordinator.compact` is
the one entry point every caller uses (the HTTP handler, background tasks): identical concurrent
jobs of a session run once (`serving.admission.SharedRuns`), each caller has its own deadline
(`timeout_s`), and a run is admitted by the model's `Gate` (bounded running sequences, bounded
queue, then `Overloaded`). Per compaction it
plans with `Compactor.plan` (render once, partition, lay out prompts; in a worker thread, inside the
deadline, so the event loop keeps serving other sessions and /healthz), decides the placement with
`serving.routing.place` (cost model: pin to the session's replica or spread contiguous ranges),
dispatches every chunk prompt at once with `Compactor.run` (one routing key per chunk), and adds
to the core's stats where the prompts went and how much of the history came from cache.

"History prompt tokens" (the affinity figure): for every chunk prompt, the leading tokens that
are a verbatim copy of the session's rendered history (`ChunkPrompt.raw_prefix`; for
`prefix_exact` that is history[0:end_k], for a sequential compaction the whole compacted span),
summed over the first attempts of the prompts sent (a chunk reused from the chunk cache sends
none). "History cached tokens": of those, the tokens vLLM reported as served from its prefix
cache (per prompt, min(cached tokens, raw prefix)). The cache may have been filled by the agent's
own turns or by the compaction's earlier prompts on the same replica; both are prefill the
compaction did not redo.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from compaction.backend import Backend, Generation, GenerationRequest
from compaction.chunk_summary import request_id
from compaction.compactor import Ahead, Compactor
from compaction.errors import (
    CompactionError,
    DeadlineExceeded,
    UnknownModel,
)
from compaction.history import Message, chat_view
from compaction.options import CompactionOptions
from compaction.pacing import BACKGROUND, NEXT, PRIORITIES, Escalation, Priority
from compaction.plan import CompactionPlan
from compaction.result import CompactionResult, CompactionStats
from serving.admission import Gate, Limits, SharedRuns
from serving.archive import Archive, stored, without_handles
from serving.errors import outcome_of
from serving.metrics import Outcome, OutcomeKind, Sink
from serving.routing import (
    CostModel,
    Placement,
    PlacementInput,
    PlacementMode,
    PromptShape,
    RouteKey,
    history_key,
    place,
)
from serving.tenants import DEFAULT_TENANT


class CompactJob(BaseModel):
    """One validated compaction request, as the ingress hands it to the coordinator."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    model: str
    messages: list[Message]
    options: CompactionOptions
    session_id: str | None = None
    placement: PlacementMode = "auto"
    timeout_s: float | None = None  # this caller's deadline; None: the service's admission.timeout_s
    priority: Priority = "agent"  # background: its prompts yield to agent turns on the engines (compaction.pacing)
    tenant: str = DEFAULT_TENANT  # whose it is: dedup, the chunk-summary cache and sessions are per tenant
    cache_salt: str | None = None  # the tenant's prefix-cache salt on the engines (serving.tenants); None: unsalted
    roll_last: bool = False  # a rolling run (`Coordinator.roll`) summarises the plan's last chunk too
    roll_reply: bool = False  # ... of a last run's history with the turn's reply: its last chunk replaces no other's
    prefer_tail_from: int | None = None  # the kept tail may start at this message instead (compaction.plan.kept_ends)
    tools: list[dict[str, Any]] | None = None  # the agent's tool list as the engine renders it (serving.wire.tools)

    def key(self) -> tuple[str, str, str | None, str]:
        """Identity for de-duplication: the same tenant's session asking for the same compaction (deadline aside)."""
        digest = hashlib.sha256(self.model_dump_json(exclude={"timeout_s"}).encode()).hexdigest()
        return self.model, self.tenant, self.session_id, digest


class ServiceStats(CompactionStats):
    """The core's stats plus the placement decision and the history-cache figure."""

    session_id: str | None = Field(description="The caller's session (its agent turns' x-session-id), if given.")
    placement: Placement = Field(description="Where the chunk prompts went and why.")
    history_prompt_tokens: int = Field(
        description="Sum over chunk prompts (first attempts) of their leading tokens copied verbatim from the history."
    )
    history_cached_tokens: int = Field(description="Of history_prompt_tokens, those vLLM served from its prefix cache.")
    history_cached_fraction: float = Field(description="history_cached_tokens / history_prompt_tokens.")
    queue_wait_s: float = Field(description="Time the compaction waited for admission; latency_s excludes it.")
    priority: Priority = Field("agent", description="The engine priority its prompts were sent at.")
    escalated_prompts: int = Field(
        0, description="Background prompts re-sent at the agent's priority because a turn needed the result."
    )
    coordinator: str | None = Field(None, description="The coordinator replica that ran it.")
    shared: bool = Field(
        False, description="True when this request joined an identical running compaction of the same session."
    )


class ServiceResult(BaseModel):
    model_config = ConfigDict(frozen=True)
    messages: list[Message] = Field(description="The compacted history: kept system turns, summary, recent turns.")
    summary: str = Field(description="The merged chunk summaries, in chunk order.")
    kept_head: int = Field(
        description="Leading input messages kept verbatim before the summary (system messages, carried summaries)."
    )
    replaces_through: int = Field(
        description="Index of the first input message kept as it was sent: "
        "messages == messages[:head_messages] + input[replaces_through:]."
    )
    head_messages: int = Field(
        description="Leading messages that stand for input[:replaces_through]: the kept head, the summary, and the "
        "turns kept with their tool output cleared (clearing): messages[:kept_head] == input[:kept_head]."
    )
    stats: ServiceStats


@dataclass
class Recorder:
    """Passes requests through and keeps the first Generation of every request id (`chunk_summary.request_id`)."""

    inner: Backend
    first: dict[str, Generation] = field(default_factory=dict)

    async def generate(self, request: GenerationRequest) -> Generation:
        generation = await self.inner.generate(request)
        self.first.setdefault(request.request_id, generation)
        return generation


@dataclass(frozen=True)
class Salted:
    """Sends every prompt with the tenant's prefix-cache salt, so it reads and fills only that tenant's blocks."""

    inner: Backend
    cache_salt: str | None

    async def generate(self, request: GenerationRequest) -> Generation:
        salted = replace(request, cache_salt=self.cache_salt) if self.cache_salt else request
        return await self.inner.generate(salted)


@dataclass(frozen=True)
class ModelRuntime:
    """What the coordinator holds per hosted model."""

    compactor: Compactor  # tokenizer + the replica backend + context window + block size
    replicas: Callable[[], Awaitable[int]]  # running replicas of the model, right now
    cost: CostModel = field(default_factory=CostModel)
    batch_sequences: int = 128  # sequences one model replica batches that this coordinator may fill (its share)
    next_beside: bool = True  # its engines let NEXT work prefill beside the agent's (YieldRule.next_step_tokens)


class AdmissionConfig(BaseModel):
    """The coordinator's limits, per model and coordinator replica (the app's `admission` args)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    max_running: int | None = Field(
        None,
        ge=1,
        le=16_384,
        description="Compactions running at once. None: as many as the engines batch (each compaction holds one "
        "sequence per chunk; capacity = running model replicas x max_num_seqs / coordinator_replicas). More wait "
        "in the queue.",
    )
    max_queued: int = Field(
        64, ge=0, le=100_000, description="Compactions waiting for admission; more get 429 with Retry-After."
    )
    timeout_s: float = Field(
        600.0, gt=0, le=86_400, description="Deadline of a compaction that names no timeout_s; past it 504."
    )


def _plan(compactor: Compactor, job: CompactJob) -> tuple[CompactionPlan, int]:
    """The job's plan and how many of its chunks the chunk cache already holds (run in a worker thread)."""
    plan = compactor.plan(job.messages, job.options, job.tenant, job.prefer_tail_from, job.tools)
    return plan, len(compactor.reusable(plan))


def _whole_chunks_to_do(compactor: Compactor, job: CompactJob) -> tuple[CompactionPlan, list[int]]:
    """The job's plan and its whole chunks that the chunk cache does not hold yet, run in a worker thread."""
    plan = compactor.plan(job.messages, job.options, namespace=job.tenant, tools=job.tools)
    done = compactor.reusable(plan)
    return plan, [k for k in compactor.whole_chunks(plan, job.roll_last) if k not in done]


class Coordinator:
    """Runs compactions for several models: shared identical runs, admission, deadlines, metrics."""

    def __init__(
        self,
        models: Mapping[str, ModelRuntime],
        admission: AdmissionConfig | None = None,
        metrics: Sink | None = None,
        name: str | None = None,
        archive: Archive | None = None,
    ) -> None:
        self.models = dict(models)
        self.archive = archive  # where compactions with archive: true keep their chunks (serving.archive)
        self.name = name  # this coordinator replica, named in the stats
        self.admission = admission or AdmissionConfig()
        self.metrics = metrics
        self._shared: SharedRuns[ServiceResult] = SharedRuns()
        self._gates = {name: self._gate(name, runtime) for name, runtime in self.models.items()}

    def _gate(self, model: str, runtime: ModelRuntime) -> Gate:
        limits = Limits(runtime.batch_sequences, self.admission.max_queued, self.admission.max_running)
        metrics = self.metrics
        return Gate(limits, on_change=(lambda state: metrics.queue(model, state)) if metrics else None)

    def gate(self, model: str) -> Gate:
        self.runtime(model)
        return self._gates[model]

    def runtime(self, model: str) -> ModelRuntime:
        if model not in self.models:
            raise UnknownModel("model", f"unknown model {model!r}; this service hosts {sorted(self.models)}")
        return self.models[model]

    async def compact(self, job: CompactJob, urgent: asyncio.Event | None = None) -> ServiceResult:
        """Compact one history. Raises a CompactionError; the caller's messages are never modified.

        Past the job's deadline: DeadlineExceeded, and the run is cancelled unless another caller
        still waits for it (likewise when the caller is cancelled, e.g. its client disconnected).
        A background job's prompts go out at the agent's priority from the moment `urgent` is set.
        """
        runtime = self.runtime(job.model)
        timeout = job.timeout_s or self.admission.timeout_s
        try:
            async with asyncio.timeout(timeout):
                start = lambda: self._admit_and_run(runtime, job, urgent)  # noqa: E731
                result, joined = await self._shared.run(job.key(), start)
        except TimeoutError as exc:
            self._report(job, "timeout")
            raise DeadlineExceeded(
                f"the compaction did not finish within timeout_s = {timeout:g} s and was cancelled; "
                "raise timeout_s, compact a shorter history, or retry when the service is less busy",
                timeout,
            ) from exc
        except asyncio.CancelledError:
            self._report(job, "cancelled")
            raise
        except CompactionError as exc:
            self._report(job, outcome_of(exc))
            raise
        if joined:
            result = result.model_copy(update={"stats": result.stats.model_copy(update={"shared": True})})
        self._report(job, "ok", result.stats, joined)
        return result

    async def roll(
        self, job: CompactJob, urgent: asyncio.Event | None = None, sent: asyncio.Event | None = None
    ) -> int:
        """Summarise the whole chunks of the job's history into the chunk cache (with `roll_last`, its last chunk
        too), at the job's priority, and merge nothing: a rolling background run, whose summaries the compaction at
        the threshold takes from the cache, or joins while in flight (`sent` is set once they are), raising the
        prompts it joins to the agent's priority; `urgent` set admits a run still queued at once. Returns how many
        chunks it summarised; raises a CompactionError like `compact`."""
        runtime = self.runtime(job.model)
        timeout = job.timeout_s or self.admission.timeout_s
        try:
            async with asyncio.timeout(timeout):
                return await self._admit_and_roll(runtime, job, urgent, sent)
        except TimeoutError as exc:
            raise DeadlineExceeded(f"the rolling summaries did not finish within {timeout:g} s", timeout) from exc

    async def _admit_and_roll(
        self, runtime: ModelRuntime, job: CompactJob, urgent: asyncio.Event | None, sent: asyncio.Event | None
    ) -> int:
        compactor = runtime.compactor
        plan, todo = await asyncio.to_thread(_whole_chunks_to_do, compactor, job)
        if not todo:
            return 0
        replicas = max(1, await runtime.replicas())
        gate = self._gates[job.model]
        gate.resize(runtime.batch_sequences * replicas)
        async with gate.admitted(len(todo), job.tenant, background=job.priority == "background", urgent=urgent):
            shape = self._placement_input(plan, job, replicas, compactor)
            placement = await asyncio.to_thread(place, shape, job.placement, runtime.cost)
            # The last run before the threshold is what the agent's next turn waits for: beside its turn where the
            # engines allow (never starved, never re-sent), else in its tool gaps as other background work.
            last = job.roll_last and job.priority == "background" and runtime.next_beside
            priority = NEXT if last else PRIORITIES[job.priority]
            # Its prompts are raised one by one, by the compaction that joins them (`compaction.compactor`): `urgent`
            # only admits it at once.
            backend = Escalation(Salted(compactor.backend, job.cache_salt), priority, in_place=True)
            # A chunk whose summary fell back is asked again at once, both prompts together, and that answer kept
            # (greedy answers differ with the batch a prompt decodes in: a first fallback is not kept as final).
            routes = placement.routes()
            ahead: Ahead | None = "reply" if job.roll_reply else "turn" if job.roll_last else None
            await compactor.summarise(plan, todo, routes, backend, sent=sent, ask_fallbacks_again=True, ahead=ahead)
        return len(todo)

    def refresh_gauges(self) -> None:
        """Set every model's queue gauges again (Ray drops a gauge left unset for two export intervals)."""
        if self.metrics is not None:
            for model, gate in self._gates.items():
                self.metrics.queue(model, gate.state())

    async def warm(self, model: str, messages: list[Message], session_id: str, cache_salt: str | None = None) -> int:
        """Prefill `messages` on the session's home replica at background priority, so the agent's next turn
        reads them from the prefix cache (a compacted prompt before it is first sent). Returns the tokens."""
        compactor = self.runtime(model).compactor
        tokenizer = compactor.tokenizer
        ids = tuple(tokenizer.encode(tokenizer.render([chat_view(m) for m in messages])))  # as the turn renders it
        route = RouteKey(session_id).encode()
        request = GenerationRequest(
            ids, max_tokens=1, request_id="warm", routing_key=route, priority=BACKGROUND, cache_salt=cache_salt
        )
        await compactor.backend.generate(request)
        return len(ids)

    async def _admit_and_run(
        self, runtime: ModelRuntime, job: CompactJob, urgent: asyncio.Event | None = None
    ) -> ServiceResult:
        compactor = runtime.compactor
        # Off the event loop (other sessions' turns and /healthz go on meanwhile) and inside the deadline;
        # bad input fails here, before it queues.
        plan, reusable = await asyncio.to_thread(_plan, compactor, job)
        replicas = max(1, await runtime.replicas())
        gate = self._gates[job.model]
        gate.resize(runtime.batch_sequences * replicas)
        sequences = len(plan.prompts) - reusable  # chunks from the cache send no prompt
        background = job.priority == "background"  # in the agent lane once `urgent` is set
        async with gate.admitted(sequences, job.tenant, background=background, urgent=urgent) as waited:
            result = await self._run(runtime, plan, job, replicas, urgent)
        return result.model_copy(update={"stats": result.stats.model_copy(update={"queue_wait_s": round(waited, 4)})})

    async def _run(
        self, runtime: ModelRuntime, plan: CompactionPlan, job: CompactJob, replicas: int, urgent: asyncio.Event | None
    ) -> ServiceResult:
        compactor = runtime.compactor
        shape = self._placement_input(plan, job, replicas, compactor)
        placement = await asyncio.to_thread(place, shape, job.placement, runtime.cost)  # compares the prompts
        recorder = Recorder(Salted(compactor.backend, job.cache_salt))
        backend = Escalation(recorder, PRIORITIES[job.priority], urgent, in_place=True)
        result = await compactor.run(plan, routes=placement.routes(), backend=backend)
        if plan.options.archive:  # its chunks stored, or the result without their handles and why
            note = await asyncio.to_thread(stored, self.archive, job.tenant, job.session_id, result.archived)
            result = result if note is None else without_handles(result, note)
        out = self._result(plan, placement, result, recorder, job.session_id)
        update = {"coordinator": self.name, "priority": job.priority, "escalated_prompts": backend.escalated}
        return out.model_copy(update={"stats": out.stats.model_copy(update=update)})

    def _report(
        self, job: CompactJob, outcome: OutcomeKind, stats: ServiceStats | None = None, joined: bool = False
    ) -> None:
        if self.metrics is None:
            return
        wait = stats.queue_wait_s if stats is not None else None
        self.metrics.compaction(Outcome(job.model, job.options.strategy, outcome, wait, stats, joined))

    @staticmethod
    def _placement_input(plan: CompactionPlan, job: CompactJob, replicas: int, compactor: Compactor) -> PlacementInput:
        history = plan.history
        return PlacementInput(
            prompts=tuple(PromptShape(p.view, p.raw_prefix) for p in plan.prompts),  # views: nothing copied
            session=job.session_id or history_key(history.token_ids, compactor.block_size),
            has_session=job.session_id is not None,
            # The agent's last turn sent every message before the newest one.
            assumed_cached_tokens=history.message_starts[-1],
            replicas=max(1, replicas),
            max_tokens=plan.options.max_chunk_summary_tokens,
            block_size=compactor.block_size,
        )

    @staticmethod
    def _result(
        plan: CompactionPlan, placement: Placement, result: CompactionResult, recorder: Recorder, session: str | None
    ) -> ServiceResult:
        firsts = ((p, recorder.first.get(request_id(k))) for k, p in enumerate(plan.prompts))
        sent = [(p, generation) for p, generation in firsts if generation is not None]  # prompts sent
        history_prompt = sum(p.raw_prefix for p, _ in sent)
        history_cached = sum(min(generation.cached_prompt_tokens, p.raw_prefix) for p, generation in sent)
        extra: dict[str, Any] = {
            "session_id": session,
            "placement": placement,
            "history_prompt_tokens": history_prompt,
            "history_cached_tokens": history_cached,
            "history_cached_fraction": round(history_cached / history_prompt, 4) if history_prompt else 0.0,
            "queue_wait_s": 0.0,
        }
        stats = ServiceStats.model_validate({**dict(result.stats), **extra})
        return ServiceResult(
            messages=result.messages,
            summary=result.summary,
            kept_head=result.kept_head,
            replaces_through=result.replaces_through,
            head_messages=result.head_messages,
            stats=stats,
        )
