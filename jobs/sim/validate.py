"""The same small workload on the real service and in the simulator, per placement policy.

Workload (per policy, on emptied prefix caches): an agent session on a LoCoMo history of `base_tokens`, `turns`
turns through `/v1/chat/completions` with `x-session-id` (each adds the next ~`turn_tokens` of the conversation and
gets `answer_tokens` back), then `POST /v1/compact` of the whole history naming the session, with the policy as
`placement`, at a forced decode volume (`fixed_output_tokens`) so both sides decode the same tokens.

The simulator replays it with the CPU profile: the same prompt lengths (the turns' reported prompt tokens; the chunk
prompts from `Compactor.plan` with the real tokenizer, as the coordinator builds them), the session's home replica
and each chunk's replica as the service reports them (round robin's phase is the router's counter, not a model
property). Compared: prompt tokens computed (engine-reported vs simulated cache) and compaction latency.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import simpy

from compaction.compactor import Compactor
from compaction.history import parse_messages
from compaction.options import CompactionOptions
from compaction.tokenizer import ChatTokenizer
from jobs.bench.common import MODEL
from jobs.sim.cluster import Cluster, CompactionJob, CompactionOutcome
from jobs.sim.profiles import EngineProfile
from jobs.sim.shapes import PromptLengths, SegmentIds
from serving.routing import PlacementMode

POLICIES: tuple[PlacementMode, ...] = ("pinned", "spread", "round_robin")


@dataclass(frozen=True)
class Workload:
    """The session the real service and the simulator both run."""

    base: list[dict[str, Any]]  # history before the agent's turns
    observations: list[str]  # the new user message of each turn
    answer_tokens: int = 16
    options: CompactionOptions = field(
        default_factory=lambda: CompactionOptions(
            strategy="parallel",
            chunk_tokens=512,
            max_chunk_summary_tokens=32,
            fixed_output_tokens=True,
            reuse_chunks=False,
        )
    )


@dataclass(frozen=True)
class Measured:
    """One policy's run, real or simulated."""

    turn_prompt_tokens: list[int]
    turn_computed_tokens: list[int]
    compaction_computed_tokens: int
    compaction_latency_s: float
    chunk_replicas: list[int]  # 0 = the session's home replica
    # the real compaction's report (None in the simulator): the placement its chunks got (pinned, spread,
    # round_robin), and the share of its history prompt tokens the engines served from their prefix caches
    placement: str | None = None
    history_cached_fraction: float | None = None


async def run_real(
    client: httpx.AsyncClient,
    workload: Workload,
    policy: PlacementMode,
    reset: Callable[[], Awaitable[None]],
    session: str,
) -> tuple[Measured, dict[str, Any], list[dict[str, Any]]]:
    """The workload on the live service: the measured figures, the compaction's stats, the messages compacted."""
    await reset()
    messages = list(workload.base)
    prompts, computed = [], []
    for text in workload.observations:
        messages.append({"role": "user", "content": text})
        body = {"model": MODEL, "messages": messages, "max_tokens": workload.answer_tokens, "temperature": 0.0}
        body["min_tokens"] = workload.answer_tokens
        reply = await client.post("/v1/chat/completions", json=body, headers={"x-session-id": session})
        reply.raise_for_status()
        usage = reply.json()["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        prompts.append(int(usage["prompt_tokens"]))
        computed.append(int(usage["prompt_tokens"]) - int(cached))
        messages.append({"role": "assistant", "content": reply.json()["choices"][0]["message"]["content"] or "ok"})
    request = {"model": MODEL, "messages": messages, "session_id": session, "placement": policy}
    request |= workload.options.model_dump(exclude_defaults=True)
    response = await client.post("/v1/compact", json=request)
    response.raise_for_status()
    stats = response.json()["stats"]
    measured = Measured(
        prompts, computed, stats["computed_prefill_tokens"], stats["latency_s"], [],
        stats["placement"]["kind"], stats["history_cached_fraction"],
    )  # fmt: skip
    return measured, stats, messages


def home_indices(replicas: Sequence[str], home: str) -> list[int]:
    """Chunk replicas as indices with the session's home replica first (0)."""
    return [0 if r == home else 1 for r in replicas]


def chunk_prompts(
    tokenizer: ChatTokenizer, messages: list[dict[str, Any]], workload: Workload, block: int
) -> list[PromptLengths]:
    """The coordinator's own plan of the compaction, as prompt lengths."""
    plan = Compactor(tokenizer, _NoBackend(), context_window=8192, block_size=block).plan(
        parse_messages(messages), workload.options
    )
    return [
        PromptLengths(len(p), p.raw_prefix, SegmentIds([("history", 0, p.raw_prefix), (("tail", k), 0, len(p.tail))]))
        for k, p in enumerate(plan.prompts)
    ]


class _NoBackend:
    async def generate(self, request: Any) -> Any:  # pragma: no cover - planning never generates
        raise RuntimeError("planning only")


def run_sim(
    profile: EngineProfile,
    turn_prompts: Sequence[int],
    answer_tokens: int,
    prompts: Sequence[PromptLengths],
    output_tokens: int,
    targets: Sequence[int],
) -> Measured:
    """The same turns and compaction on a simulated two-replica deployment (home = replica 0)."""
    env = simpy.Environment()
    cluster = Cluster(env, profile, 2, "pinned", homes={"validate": 0})
    turns = []
    result: dict[str, CompactionOutcome] = {}

    def agent() -> Generator[simpy.Event, Any, None]:
        for prompt in turn_prompts:
            turn = cluster.turn("validate", "history", prompt, answer_tokens)
            turns.append(turn)
            yield turn.done
        job = CompactionJob(
            "validate", "history", prompts, [output_tokens] * len(prompts), turn_prompts[-1],
            prompts[-1].history_prefix, targets,
        )  # fmt: skip
        result["outcome"] = yield env.process(cluster.compact(job))

    env.process(agent())
    env.run()
    outcome = result["outcome"]
    return Measured(
        [t.prompt_tokens for t in turns],
        [t.computed_tokens for t in turns],
        outcome.computed_tokens,
        outcome.latency_s,
        list(targets),
    )


async def validate(
    client: httpx.AsyncClient,
    tokenizer: ChatTokenizer,
    workload: Workload,
    calibrate: Callable[[], Awaitable[EngineProfile]],
    reset: Callable[[], Awaitable[None]],
    policies: Sequence[PlacementMode] = POLICIES,
) -> dict[str, tuple[Measured, Measured, EngineProfile]]:
    """Each policy on the service, then in the simulator; pinned first, since its chunks name the home replica.

    The profile is calibrated right before each policy's run, so a machine whose speed drifts (a shared one)
    is compared with its speed of the moment.
    """
    session = f"validate-{uuid.uuid4().hex[:8]}"
    home: str | None = None
    rows: dict[str, tuple[Measured, Measured, EngineProfile]] = {}
    for policy in policies:
        profile = await calibrate()
        real, stats, messages = await run_real(client, workload, policy, reset, session)
        home = home or stats["replicas"][-1]  # pinned: every chunk on home; spread: the last range on home
        targets = home_indices(stats["replicas"], home)
        prompts = chunk_prompts(tokenizer, messages, workload, profile.block_size)
        outputs = [c["output_tokens"] for c in stats["per_chunk"]]
        sim = run_sim(profile, real.turn_prompt_tokens, workload.answer_tokens, prompts, max(outputs), targets)
        rows[policy] = (dataclasses.replace(real, chunk_replicas=targets), sim, profile)
    return rows


def ratio(simulated: float, measured: float) -> float:
    return simulated / measured if measured else float("inf")


def table(rows: dict[str, tuple[Measured, Measured, EngineProfile]]) -> str:
    """Markdown: per policy, computed prefill and compaction latency, measured vs simulated."""
    lines = [
        "| policy | compaction prefill computed: real / sim | ratio | compaction latency: real / sim | ratio "
        "| agent turns computed: real / sim | calibrated prefill |",
        "|---|---|---|---|---|---|---|",
    ]
    for policy, (real, sim, profile) in rows.items():
        lines.append(
            f"| {policy} | {real.compaction_computed_tokens:,} / {sim.compaction_computed_tokens:,} | "
            f"{ratio(sim.compaction_computed_tokens, real.compaction_computed_tokens):.3f} | "
            f"{real.compaction_latency_s:.2f} s / {sim.compaction_latency_s:.2f} s | "
            f"{ratio(sim.compaction_latency_s, real.compaction_latency_s):.3f} | "
            f"{sum(real.turn_computed_tokens):,} / {sum(sim.turn_computed_tokens):,} | "
            f"{profile.prefill_tokens_per_s:.0f} tok/s |"
        )
    return "\n".join(lines)
