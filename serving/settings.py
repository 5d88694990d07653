"""The Serve application's `args` (`AppArgs`), apart from the application: the coordinator replicas unpickle them
without importing ray.serve.llm (and vLLM with it)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from compaction.chunk_cache import DEFAULT_MAX_BYTES as CHUNK_CACHE_BYTES
from compaction.errors import InvalidInput
from compaction.turn_policy import parse_context_management
from serving.archive import ArchiveConfig
from serving.background import DEFAULT_MAX_BYTES as SESSION_BYTES
from serving.coordinator import AdmissionConfig
from serving.models import DEFAULT_MODEL, Replicas
from serving.routing import CostModel
from serving.tenants import TenancyConfig


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


def parse_args(args: dict[str, Any] | AppArgs | None) -> AppArgs:
    if isinstance(args, AppArgs):
        return args
    try:
        return AppArgs.model_validate(args or {})
    except ValidationError as exc:
        raise ValueError(f"invalid serving.app args: {exc}") from exc
