"""The coordinator's Serve replica: `Coordinator` and the chat sessions' background work, built in the replica.

Apart from `serving.app` so that a coordinator replica imports neither ray.serve.llm nor vLLM (about 12 s of CPU
and 500 MB each): it sends chunk prompts as plain dicts (serving.replica_backend).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from typing import Any

from pydantic import ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle

from compaction.chunk_cache import ChunkCache
from compaction.compactor import Compactor
from compaction.errors import CompactionError
from compaction.history import Message
from compaction.tokenizer import HFChatTokenizer
from serving.archive import Archive
from serving.background import SessionCompactions
from serving.coordinator import CompactJob, Coordinator, ModelRuntime, ServiceResult
from serving.errors import Failure
from serving.metrics import RayMetrics, record_stall
from serving.models import ModelSpec
from serving.replica_backend import ReplicaBackend
from serving.routing import CostModel
from serving.settings import AppArgs
from serving.turns import ChatTurn, TurnCompaction

GAUGE_REFRESH_S = 1.0  # Ray keeps a gauge value for two export intervals (1 s each at the least)


class RunningReplicas:
    """Running replicas of a deployment, from the Serve controller (off the event loop), cached briefly:
    every compaction asks, and a burst of them should not become a burst of controller calls."""

    def __init__(self, handle: DeploymentHandle, ttl_s: float = 2.0) -> None:
        self.handle = handle
        self.ttl_s = ttl_s
        self._cached: tuple[float, int] | None = None

    async def __call__(self) -> int:
        now = time.monotonic()
        if self._cached is None or now - self._cached[0] > self.ttl_s:
            self._cached = (now, await asyncio.to_thread(self._count))
        return self._cached[1]

    def _count(self) -> int:
        status = serve.status()
        app = status.applications.get(self.handle.app_name)
        deployment = app.deployments.get(self.handle.deployment_name) if app else None
        if deployment is None:
            return 1
        return int(deployment.replica_states.get("RUNNING", 0))  # type: ignore[call-overload]


class CoordinatorDeployment:
    """Serve adapter over `Coordinator`: builds it in the replica and returns failures as data."""

    def __init__(self, llm_deployments: dict[str, DeploymentHandle], specs: list[ModelSpec], args: AppArgs) -> None:
        runtimes = {}
        self._backends = {}
        for spec in specs:
            handle = llm_deployments[spec.name]
            backend = ReplicaBackend(handle, spec.name, max_failovers=args.max_failovers)
            tokenizer = HFChatTokenizer.from_path(spec.resolved_source())
            cache = (
                ChunkCache(args.chunk_cache_entries, max_bytes=args.chunk_cache_bytes)
                if args.chunk_cache_entries
                else None
            )
            compactor = Compactor(
                tokenizer,
                backend,
                context_window=spec.max_model_len,
                block_size=spec.block_size,
                cache=cache,
                limits=spec.plan_limits(),
            )
            runtimes[spec.name] = ModelRuntime(
                compactor,
                RunningReplicas(handle),
                args.cost.get(spec.name, CostModel()),
                batch_sequences=math.ceil(spec.batch_sequences() / args.coordinator_replicas),
                next_beside=spec.next_step_tokens > 0,
            )
            self._backends[spec.name] = backend
        name = serve.get_replica_context().replica_id.unique_id
        self._coordinator = Coordinator(runtimes, args.admission, RayMetrics(), name, Archive(args.archive))
        coordinator = self._coordinator
        self._sessions = SessionCompactions(
            coordinator.compact,
            roll=coordinator.roll,
            warm=coordinator.warm,
            max_sessions=args.chat_sessions,
            max_bytes=args.chat_session_bytes,
            max_running_per_tenant=args.chat_background_per_tenant,
            tenant_cap=lambda tenant: args.tenancy.limits_of(tenant).max_concurrent_requests,
        )
        self._gauges: asyncio.Task[None] | None = None

    def _keep_gauges(self) -> None:
        """From the first call on, the queue gauges are set every second, so an idle coordinator still shows 0."""
        if self._gauges is None:
            self._gauges = asyncio.get_running_loop().create_task(self._refresh_gauges())

    async def _refresh_gauges(self) -> None:
        while True:
            self._coordinator.refresh_gauges()
            await asyncio.sleep(GAUGE_REFRESH_S)

    async def compact(self, job: CompactJob) -> ServiceResult | Failure:
        self._keep_gauges()
        try:
            return await self._coordinator.compact(job)
        except CompactionError as exc:
            return Failure.of(exc)

    async def chat_turn(self, turn: ChatTurn) -> TurnCompaction | Failure:
        """The compaction outcome of one chat turn with context_management (serving.background)."""
        self._keep_gauges()
        try:
            runtime = self._coordinator.runtime(turn.model)
            outcome = await self._sessions.turn(turn, runtime.compactor.tokenizer)
        except CompactionError as exc:
            return Failure.of(exc)
        if outcome.status == "applied":
            record_stall(turn.model, outcome.stall_s)
        return outcome

    async def chat_reply(self, model: str, tenant: str, session: str, messages: int, reply: dict[str, Any]) -> None:
        """A turn's reply, sent: the session's last run before its threshold summarises it too
        (serving.background)."""
        with contextlib.suppress(CompactionError, ValidationError):  # a head start only
            self._sessions.replied(model, tenant, session, messages, Message.model_validate(reply))

    async def settled(self, tenant: str, session: str, timeout_s: float = 60.0) -> bool:
        """Whether the session's background work on this coordinator ended within `timeout_s` (waiting for it)."""
        return await self._sessions.settled(tenant, session, timeout_s)

    async def replicas(self) -> dict[str, int]:
        """Running replicas of every hosted model."""
        runtimes = self._coordinator.models
        counts = await asyncio.gather(*(runtimes[name].replicas() for name in sorted(runtimes)))
        return dict(zip(sorted(runtimes), counts, strict=True))

    async def reset_prefix_cache(self, model: str) -> None:
        """Empty the prefix cache of every replica of `model` (demos and benchmarks start cold)."""
        self._coordinator.runtime(model)
        await self._backends[model].reset_prefix_cache()
