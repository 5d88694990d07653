"""`POST /v1/compact`: the compaction options, plus what to compact and where to run it, as the coordinator's job."""

from __future__ import annotations

from pydantic import ConfigDict, Field

from compaction.history import Message
from compaction.options import CompactionOptions
from compaction.pacing import Priority
from serving.coordinator import CompactJob
from serving.routing import PlacementMode
from serving.tenants import ANONYMOUS, Tenant
from serving.wire.tools import MAX_TOOLS, ToolSpec


class CompactRequest(CompactionOptions):
    """`POST /v1/compact`: the compaction options, plus what to compact and where to run it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    model: str = Field(min_length=1, max_length=256, description="A hosted model (GET /v1/models).")
    messages: list[Message] = Field(
        min_length=1, max_length=100_000, description="The history to compact: OpenAI-style chat messages."
    )
    session_id: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        pattern=r"^[^\x00-\x1f]+$",
        description="The agent's session (the x-session-id of its /v1/chat/completions turns); the header "
        "is used when this is absent. Compactions of a session go to the replica caching its history.",
    )
    placement: PlacementMode = Field(
        "auto",
        description="auto: the cost model decides; pinned: every chunk on the session's replica; spread: "
        "contiguous chunk ranges over replicas; round_robin: no affinity (for comparison).",
    )
    timeout_s: float | None = Field(
        None,
        gt=0,
        le=86_400,
        description="Deadline in seconds, queue wait included; past it the answer is 504 and the work is "
        "cancelled. Default: the service's admission.timeout_s.",
    )
    tools: list[ToolSpec] | None = Field(
        None,
        max_length=MAX_TOOLS,
        description="The agent's tool list, as its /v1/chat/completions turns send it: the chunk prompts then start "
        "with the tokens of the agent's own prompts and reuse what its turns left in the prefix cache.",
    )
    priority: Priority = Field(
        "agent",
        description="agent: the caller waits for it, its prompts run beside agent turns; background: its prompts "
        "yield to agent turns on the engines (prefill only when no agent request is running).",
    )

    def job(self, header_session: str | None, tenant: Tenant = ANONYMOUS) -> CompactJob:
        return CompactJob(
            model=self.model,
            messages=self.messages,
            options=self.options(),
            session_id=self.session_id or header_session or None,
            placement=self.placement,
            timeout_s=self.timeout_s,
            priority=self.priority,
            tools=[tool.engine_form() for tool in self.tools] if self.tools else None,
            tenant=tenant.id,
            cache_salt=tenant.cache_salt,
        )
