"""The Serve application: model deployments, the compaction coordinator, and the HTTP ingress.

    build_app(args) -> ray.serve.Application        (Serve config: import_path: serving.app:build_app)

Graph: `CompactionIngress` (FastAPI; OpenAI endpoints + /v1/compact) -> `Coordinator`
(`coordinator_replicas` replicas, 2 by default, so none is a single point of failure; calls that
carry a session id reach the session's coordinator replica through `SessionRouter`; admits, plans,
places, dispatches) -> one ray.serve.llm `LLMServer` deployment per model, routed by `SessionRouter`
(consistent hash on the session id, placement keys from the coordinator).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from typing import Any, cast

import ray
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from ray import serve
from ray.serve.deployment import Application, Deployment
from ray.serve.handle import DeploymentHandle
from ray.serve.llm import build_llm_deployment
from ray.serve.llm.ingress import OpenAiIngress

from compaction.chunk_cache import DEFAULT_MAX_BYTES as CHUNK_CACHE_BYTES
from compaction.chunk_cache import ChunkCache
from compaction.compactor import Compactor
from compaction.errors import CompactionError, InvalidInput
from compaction.history import Message
from compaction.tokenizer import HFChatTokenizer
from compaction.turn_policy import parse_context_management
from serving.api import make_ingress
from serving.archive import Archive, ArchiveConfig
from serving.background import DEFAULT_MAX_BYTES as SESSION_BYTES
from serving.background import SessionCompactions
from serving.coordinator import AdmissionConfig, CompactJob, Coordinator, ModelRuntime, ServiceResult
from serving.errors import Failure
from serving.metrics import RayMetrics, record_stall
from serving.models import DEFAULT_MODEL, ModelSpec, Replicas, load_catalogue
from serving.ray_adapter import ROUTER_CLASS, model_card, router_kwargs
from serving.replica_backend import ReplicaBackend
from serving.routing import CostModel
from serving.tenants import TenancyConfig
from serving.turns import ChatTurn, TurnCompaction

COORDINATOR_MAX_ONGOING = 100_000
GAUGE_REFRESH_S = 1.0  # Ray keeps a gauge value for two export intervals (1 s each at the least)


class AppArgs(BaseModel):
    """The `args` of the Serve application."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    models: list[str] = Field(
        default_factory=lambda: [DEFAULT_MODEL], min_length=1, description="Catalogue names of the models to host."
    )
    catalogue: str | None = Field(None, description="Path of a catalogue YAML; default: the packaged one.")
    tenancy: TenancyConfig = Field(
        default_factory=TenancyConfig, description="Where the ingress finds its keys, and the tenants' limits."
    )
    allow_unauthenticated: bool = Field(
        False,
        description="Serve without any API key even when Serve listens beyond loopback (otherwise the ingress "
        "refuses to start).",
    )
    cors_origins: list[str] = Field(
        default_factory=list,
        max_length=256,
        description="Origins a browser may call the service from (CORS); empty: no CORS headers at all.",
    )
    max_request_bytes: int = Field(16 * 1024 * 1024, ge=1024, le=1 << 30, description="Bodies above this size get 413.")
    admission: AdmissionConfig = Field(
        default_factory=AdmissionConfig, description="Compaction admission, per model and coordinator replica."
    )
    coordinator_replicas: int = Field(
        2, ge=1, le=64, description="Coordinator replicas; a compaction whose replica dies is retried on another."
    )
    coordinators_per_node: int | None = Field(
        None,
        ge=1,
        le=64,
        description="At most this many coordinator replicas on one Ray node (Serve's max_replicas_per_node): 1 "
        "spreads them, so a lost node takes at most one. None: Serve places them (it may put all on one node).",
    )
    max_failovers: int = Field(2, ge=0, le=16, description="Times a chunk prompt moves to another replica on failure.")
    chunk_cache_entries: int = Field(
        4096,
        ge=0,
        le=10_000_000,
        description="Chunk summaries kept per model for reuse by later compactions of a grown history (0: off).",
    )
    chat_sessions: int = Field(
        4096,
        ge=1,
        le=10_000_000,
        description="Chat sessions per coordinator replica whose background compaction is kept until used.",
    )
    chat_session_bytes: int = Field(
        SESSION_BYTES,
        ge=1 << 20,
        le=1 << 40,
        description="Bytes per coordinator replica the kept background compactions may hold (a running one: its "
        "job; a finished one: its result); the least recently started go first. Default 512 MiB.",
    )
    chat_background_per_tenant: int = Field(
        8,
        ge=1,
        le=100_000,
        description="Background compactions one tenant may have running at once per coordinator replica; past it, "
        "a turn starts none (its session compacts blocking at its threshold), so one tenant's flood of cheap "
        "turns cannot hold the admission every other tenant's compactions need. Never more than the tenant's "
        "own max_concurrent_requests.",
    )
    archive: ArchiveConfig = Field(
        default_factory=ArchiveConfig,
        description="Where compactions sent with archive: true keep their chunks verbatim, per tenant, for the "
        "agents' recall through /mcp (serving.archive, serving.recall).",
    )
    chunk_cache_bytes: int = Field(
        CHUNK_CACHE_BYTES,
        ge=1 << 16,
        le=1 << 40,
        description="Bytes per model and coordinator replica the chunk-summary cache may hold (summaries and "
        "their stats); the least recently used go first. Default 64 MiB.",
    )
    cost: dict[str, CostModel] = Field(
        default_factory=dict, description="Cost-model figures per model name (defaults: vLLM-CPU SmolLM2)."
    )
    replicas: dict[str, Replicas] = Field(
        default_factory=dict, description="Replica bounds per model name, replacing the catalogue's."
    )
    default_compaction: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description='Per model or alias: the compaction entry ({"type": "compaction", "compact_threshold": N, ...}) '
        "of chat completions and Messages turns that send none, so an agent that cannot send one (Claude Code, "
        "OpenCode) is compacted at the operator's threshold; on Responses, the options of Codex's in-band "
        "compaction_trigger.",
    )
    model_aliases: dict[str, str] = Field(
        default_factory=dict,
        description="Other names every route accepts for a hosted model, e.g. "
        '{"gpt-smollm2": "smollm2-135m-instruct"} for clients that want an OpenAI-style name (the OpenAI Agents '
        "SDK's compaction session takes only gpt-* and o* models).",
    )

    @model_validator(mode="after")
    def _known_cost_models(self) -> AppArgs:
        for field, named in (("cost", self.cost), ("replicas", self.replicas)):
            unknown = sorted(set(named) - set(self.models))
            if unknown:
                raise ValueError(f"{field} names models that are not hosted: {unknown}")
        for name, entry in self.default_compaction.items():
            if name not in self.models and name not in self.model_aliases:
                raise ValueError(f"default_compaction names neither a hosted model nor an alias: {name}")
            try:
                parse_context_management([entry], f"default_compaction.{name}")
            except InvalidInput as exc:
                raise ValueError(str(exc)) from exc
        unknown = sorted(name for name in self.model_aliases.values() if name not in self.models)
        if unknown:
            raise ValueError(f"model_aliases points at models that are not hosted: {unknown}")
        if len(set(self.models)) != len(self.models):
            raise ValueError(f"models lists a name twice: {self.models}")
        return self


def as_deployment(cls: type) -> Deployment:
    return cast(Deployment, serve.deployment(cls))


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


def parse_args(args: dict[str, Any] | AppArgs | None) -> AppArgs:
    if isinstance(args, AppArgs):
        return args
    try:
        return AppArgs.model_validate(args or {})
    except ValidationError as exc:
        raise ValueError(f"invalid serving.app args: {exc}") from exc


def actor_options(env_vars: dict[str, str] | None = None) -> dict[str, Any]:
    """Zero logical CPUs (they wait on the replicas) and the caller's runtime env, as LLMServer gets it."""
    runtime_env = dict(ray.get_runtime_context().runtime_env)
    if env_vars:
        runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), **env_vars}
    return {"num_cpus": 0, "runtime_env": runtime_env}


def hosted_specs(opts: AppArgs) -> list[ModelSpec]:
    """The catalogue entries of the hosted models, with the args' replica bounds applied."""
    catalogue = load_catalogue(opts.catalogue)
    try:
        specs = [catalogue.get(name) for name in opts.models]
    except CompactionError as exc:
        raise ValueError(str(exc)) from exc
    return [s.model_copy(update={"replicas": opts.replicas[s.name]}) if s.name in opts.replicas else s for s in specs]


def model_deployment(spec: ModelSpec, config: Any, routing: dict[str, Any]) -> Application:
    """One model's ray.serve.llm deployment; CPU replicas bound to their own cores (serving.placement)."""
    if spec.device != "cpu":
        return build_llm_deployment(config, override_serve_options={"request_router_config": routing})
    from serving.placement import PlacedLLMServer

    return build_llm_deployment(
        config,
        name_prefix="LLMServer:",
        bind_kwargs=spec.server_kwargs(),
        override_serve_options={"request_router_config": routing},
        deployment_cls=PlacedLLMServer,
    )


def build_app(args: dict[str, Any]) -> Application:
    """The whole application for the catalogue models named in `args` (see `AppArgs`)."""
    opts = parse_args(args)
    specs = hosted_specs(opts)
    configs = {spec.name: spec.llm_config() for spec in specs}
    routing = {"request_router_class": ROUTER_CLASS, "request_router_kwargs": router_kwargs()}
    llms = {spec.name: model_deployment(spec, configs[spec.name], routing) for spec in specs}
    coordinator = (
        as_deployment(CoordinatorDeployment)
        .options(
            name="Coordinator",
            num_replicas=opts.coordinator_replicas,
            ray_actor_options=actor_options(),
            max_ongoing_requests=COORDINATOR_MAX_ONGOING,  # its own Gate queues and sheds, not Serve
            request_router_config=routing,
            max_replicas_per_node=opts.coordinators_per_node,  # type: ignore[arg-type]  # None: no bound
        )
        .bind(llms, specs, opts)
    )
    options = OpenAiIngress.get_deployment_options(list(configs.values()))
    ingress = make_ingress(opts.max_request_bytes, opts.tenancy, opts.cors_origins, opts.archive)
    actor = actor_options()  # no key in it: the ingress reads its keys from its own environment or file
    deployment = as_deployment(ingress).options(name="CompactionIngress", ray_actor_options=actor, **options)
    return deployment.bind(
        llm_deployments=llms,
        model_cards={name: model_card(config) for name, config in configs.items()},
        coordinator=coordinator,
        tokenizer_sources={spec.name: spec.resolved_source() for spec in specs},
        windows={spec.name: spec.max_model_len for spec in specs},
        aliases=dict(opts.model_aliases),
        tenancy=opts.tenancy,
        allow_unauthenticated=opts.allow_unauthenticated,
        default_compaction=dict(opts.default_compaction),
        reply_budgets={s.name: s.default_max_tokens for s in specs if s.default_max_tokens is not None},
        history_limits={spec.name: spec.plan_limits() for spec in specs},
    )
