"""The compaction coordinator: partition -> layout -> route -> dispatch -> merge.

A plain class (no Ray import): `serving.app` wraps it in a Serve deployment. Per compaction it
plans with `Compactor.plan` (render once, partition, lay out prompts), decides the placement with
`serving.routing.place` (cost model: pin to the session's replica or spread contiguous ranges),
dispatches every chunk prompt at once with `Compactor.run` (one routing key per chunk), and adds
to the core's stats where the prompts went and how much of the history came from cache.

"History prompt tokens" (the affinity figure): for every chunk prompt, the leading tokens that
are a verbatim copy of the session's rendered history (`ChunkPrompt.raw_prefix`; for
`prefix_exact` that is history[0:end_k], for a sequential compaction the whole compacted span),
summed over the chunks' first attempts. "History cached tokens": of those, the tokens vLLM
reported as served from its prefix cache (per prompt, min(cached tokens, raw prefix)). The cache
may have been filled by the agent's own turns or by the compaction's earlier prompts on the
same replica; both are prefill the compaction did not redo.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from compaction.backend import Backend, Generation, GenerationRequest
from compaction.compactor import CompactionPlan, Compactor
from compaction.errors import (
    BackendError,
    CompactionError,
    ContextOverflow,
    InvalidInput,
    InvalidOutput,
    ModelNotAvailable,
    Overloaded,
    UnknownModel,
)
from compaction.history import Message
from compaction.options import CompactionOptions
from compaction.result import CompactionResult, CompactionStats
from serving.routing import CostModel, Placement, PlacementInput, PlacementMode, PromptShape, history_key, place


class CompactJob(BaseModel):
    """One validated compaction request, as the ingress hands it to the coordinator."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    model: str
    messages: list[Message]
    options: CompactionOptions
    session_id: str | None = None
    placement: PlacementMode = "auto"


class ServiceStats(CompactionStats):
    """The core's stats plus the placement decision and the history-cache figure."""

    session_id: str | None = Field(description="The caller's session (its agent turns' x-session-id), if given.")
    placement: Placement = Field(description="Where the chunk prompts went and why.")
    history_prompt_tokens: int = Field(
        description="Sum over chunk prompts (first attempts) of their leading tokens copied verbatim from the history."
    )
    history_cached_tokens: int = Field(description="Of history_prompt_tokens, those vLLM served from its prefix cache.")
    history_cached_fraction: float = Field(description="history_cached_tokens / history_prompt_tokens.")


class ServiceResult(BaseModel):
    model_config = ConfigDict(frozen=True)
    messages: list[Message] = Field(description="The compacted history: kept system turns, summary, recent turns.")
    summary: str = Field(description="The merged chunk summaries, in chunk order.")
    stats: ServiceStats


ErrorKind = Literal[
    "UnknownModel", "ContextOverflow", "InvalidInput", "Overloaded", "BackendError", "ModelNotAvailable",
    "InvalidOutput",
]  # fmt: skip
_KINDS: tuple[type[CompactionError], ...] = (
    UnknownModel, ContextOverflow, InvalidInput, Overloaded, BackendError, ModelNotAvailable, InvalidOutput,
)  # fmt: skip


class Failure(BaseModel):
    """A CompactionError as plain data, so it crosses a Ray call with its field and retry hint intact."""

    model_config = ConfigDict(frozen=True)
    kind: ErrorKind
    message: str
    field: str | None = None
    retry_after_s: float | None = None

    @classmethod
    def of(cls, exc: CompactionError) -> Failure:
        kind = next(k for k in _KINDS if isinstance(exc, k))
        if isinstance(exc, InvalidInput):
            return cls(kind=kind.__name__, message=exc.message, field=exc.field)
        retry = exc.retry_after_s if isinstance(exc, Overloaded) else None
        return cls(kind=kind.__name__, message=str(exc), retry_after_s=retry)

    def exception(self) -> CompactionError:
        kind = next(k for k in _KINDS if k.__name__ == self.kind)
        if issubclass(kind, InvalidInput):
            return kind(self.field or "request", self.message)
        if issubclass(kind, Overloaded):
            return kind(self.message, self.retry_after_s or 1.0)
        return kind(self.message)


@dataclass
class Recorder:
    """Passes requests through and keeps the first Generation of every distinct prompt."""

    inner: Backend
    first: dict[tuple[int, ...], Generation] = field(default_factory=dict)

    async def generate(self, request: GenerationRequest) -> Generation:
        generation = await self.inner.generate(request)
        self.first.setdefault(request.prompt_token_ids, generation)
        return generation


@dataclass(frozen=True)
class ModelRuntime:
    """What the coordinator holds per hosted model."""

    compactor: Compactor  # tokenizer + the replica backend + context window + block size
    replicas: Callable[[], Awaitable[int]]  # running replicas of the model, right now
    cost: CostModel = field(default_factory=CostModel)


class Coordinator:
    """Runs compactions for several models; bounded concurrency, bounded time."""

    def __init__(self, models: Mapping[str, ModelRuntime], *, max_concurrent: int = 4, timeout_s: float = 600) -> None:
        self.models = dict(models)
        self.max_concurrent = max_concurrent
        self.timeout_s = timeout_s
        self._active = 0

    def runtime(self, model: str) -> ModelRuntime:
        if model not in self.models:
            raise UnknownModel("model", f"unknown model {model!r}; this service hosts {sorted(self.models)}")
        return self.models[model]

    async def compact(self, job: CompactJob) -> ServiceResult:
        """Compact one history. Raises a CompactionError; the caller's messages are never modified."""
        runtime = self.runtime(job.model)
        if self._active >= self.max_concurrent:
            raise Overloaded(f"{self._active} compactions are running (the limit); retry shortly", 5.0)
        self._active += 1
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self._compact(runtime, job)
        except TimeoutError as exc:
            raise BackendError(f"the compaction did not finish within {self.timeout_s:.0f} s") from exc
        finally:
            self._active -= 1

    async def _compact(self, runtime: ModelRuntime, job: CompactJob) -> ServiceResult:
        compactor = runtime.compactor
        plan = compactor.plan(job.messages, job.options)
        shape = self._placement_input(plan, job, await runtime.replicas(), compactor)
        placement = place(shape, job.placement, runtime.cost)
        recorder = Recorder(compactor.backend)
        result = await compactor.run(plan, routes=placement.routes(), backend=recorder)
        return self._result(plan, placement, result, recorder, job.session_id)

    @staticmethod
    def _placement_input(plan: CompactionPlan, job: CompactJob, replicas: int, compactor: Compactor) -> PlacementInput:
        history = plan.history
        return PlacementInput(
            prompts=tuple(PromptShape(p.token_ids, p.raw_prefix) for p in plan.prompts),
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
        history_prompt = sum(p.raw_prefix for p in plan.prompts)
        history_cached = sum(
            min(recorder.first[p.token_ids].cached_prompt_tokens, p.raw_prefix)
            for p in plan.prompts
            if p.token_ids in recorder.first
        )
        extra: dict[str, Any] = {
            "session_id": session,
            "placement": placement,
            "history_prompt_tokens": history_prompt,
            "history_cached_tokens": history_cached,
            "history_cached_fraction": round(history_cached / history_prompt, 4) if history_prompt else 0.0,
        }
        stats = ServiceStats.model_validate({**dict(result.stats), **extra})
        return ServiceResult(messages=result.messages, summary=result.summary, stats=stats)
