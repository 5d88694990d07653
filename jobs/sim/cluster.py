"""The deployment of one model: R replicas, the agents' session affinity, and the coordinator's compactions.

Placement is `serving.routing.place` itself (pinned / spread / round_robin / auto with its cost model); the prompts
it compares are `jobs.sim.shapes` lengths. A session's home replica is a stable hash of its id (the consistent-hash
ring of `serving.ray_router.SessionRouter` spreads sessions the same way); spread slot s goes to the s-th replica
after home, and round robin continues one counter over all chunk prompts, as the router's counter does.
Admission follows the coordinator with a bounded queue: at most `max_running` compactions run, at most
`max_queued` wait; beyond that a compaction is refused (HTTP 429) and the caller decides what to do.
"""

from __future__ import annotations

import zlib
from collections.abc import Generator, Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import simpy

from compaction.pacing import AGENT, YieldRule
from jobs.sim.engine import Replica, Request, RequestKind
from jobs.sim.profiles import EngineProfile
from jobs.sim.shapes import PromptLengths
from serving.routing import CostModel, PlacementInput, PlacementMode, PromptShape, place

JobKind = Literal["compaction", "roll"]


def cost_model(profile: EngineProfile, context_tokens: int = 8192) -> CostModel:
    """The coordinator's cost-model figures for a profile (decode priced at `context_tokens` per sequence)."""
    single = profile.decode_step_s(1, context_tokens)
    growth = (profile.decode_step_s(2, 2 * context_tokens) - single) / single
    return CostModel(
        prefill_tokens_per_s=round(profile.prefill_tokens_per_s, 1),
        decode_step_s=round(single, 5),
        batch_growth=round(min(10.0, max(0.0, growth)), 4),
    )


def yield_rule(profile: EngineProfile, beside_tokens: int | None = None) -> YieldRule:
    """The yield rule the catalogue gives the profile's model (the GPU default where it names none); `beside_tokens`
    replaces its background_beside_tokens."""
    from serving.models import load_catalogue

    spec = load_catalogue().by_name.get(profile.model)
    rule = spec.yield_rule() if spec else YieldRule()
    return rule if beside_tokens is None else replace(rule, background_beside_tokens=beside_tokens)


@dataclass(frozen=True)
class Admission:
    """The coordinator's limits (issue 9): None means unbounded."""

    max_running: int | None = None  # compactions running at once per model
    max_queued: int | None = None  # compactions waiting for a slot; more are refused (429)


@dataclass(frozen=True)
class CompactionJob:
    """One compaction as the session asks for it, already laid out in token counts."""

    session: str  # the session id (its home replica)
    namespace: Hashable  # the history chain being compacted
    prompts: Sequence[PromptLengths]  # chunk prompts in chunk order
    output_tokens: Sequence[int]  # decode volume of each chunk
    assumed_cached_tokens: int  # history tokens the home replica holds (the agent's last turn)
    input_tokens: int  # tokens compacted
    targets: Sequence[int] | None = None  # replica of each chunk when already decided (validation replays)
    priority: int = AGENT  # BACKGROUND for a background compaction (compaction.pacing)
    kind: JobKind = "compaction"  # roll: a rolling run's chunk summaries (nothing merged)
    dispatched: list[Request] = field(default_factory=list)  # its chunk prompts, once sent


@dataclass
class CompactionOutcome:
    """What one compaction cost."""

    admitted: bool  # False: refused at admission (429)
    kind: JobKind = "compaction"
    queued_s: float = 0.0  # waiting for a coordinator slot
    latency_s: float = 0.0  # first chunk dispatched -> last chunk done
    placement: str = ""  # pinned / spread / round_robin
    chunks: int = 0
    input_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    replicas: list[int] = field(default_factory=list)

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


class Cluster:
    def __init__(
        self,
        env: simpy.Environment,
        profile: EngineProfile,
        replicas: int,
        policy: PlacementMode,
        *,
        cost: CostModel | None = None,
        admission: Admission = Admission(),
        homes: dict[str, int] | None = None,
        yielding: bool = True,
        beside_tokens: int | None = None,
    ) -> None:
        self.env = env
        self.profile = profile
        rule = yield_rule(profile, beside_tokens) if yielding else None
        self.replicas = [Replica(env, i, profile, rule=rule) for i in range(replicas)]
        if profile.host_parallelism is not None:  # one shared host (the CPU service); GPUs are each their own
            for replica in self.replicas:
                replica.peers = self.replicas
        self.policy = policy
        self.cost = cost or cost_model(profile)
        self.admission = admission
        self.slots = simpy.Resource(env, capacity=admission.max_running) if admission.max_running else None
        self.round_robin = 0
        self.homes = homes or {}  # sessions whose home replica is known (validation replays)
        self.outcomes: list[CompactionOutcome] = []
        self.turns: list[Request] = []
        self._chunks: dict[int, list[Request]] = {}  # running compactions' chunk prompts, by id(job)

    def home(self, session: str) -> int:
        if session in self.homes:
            return self.homes[session]
        return zlib.crc32(session.encode()) % len(self.replicas)

    def submit(
        self,
        replica: int,
        prompt: int,
        output: int,
        namespace: Hashable | None,
        prefix: int,
        *,
        kind: RequestKind,
        keeps_output: bool = False,
        priority: int = AGENT,
    ) -> Request:
        request = Request(prompt, output, namespace, prefix, keeps_output, kind, self.env.event(), priority)
        self.replicas[replica].submit(request)
        return request

    def turn(self, session: str, namespace: Hashable, prompt: int, output: int) -> Request:
        """An agent turn on its home replica; its prompt is its history, its answer continues it."""
        request = self.submit(self.home(session), prompt, output, namespace, prompt, kind="turn", keeps_output=True)
        self.turns.append(request)
        return request

    def compact(self, job: CompactionJob) -> Generator[simpy.Event, Any, CompactionOutcome]:
        """A simpy process: admission, placement, every chunk prompt at once, done when the last one is."""
        arrived = self.env.now
        slot = None
        if self.slots is not None:
            limit = self.admission.max_queued
            if limit is not None and len(self.slots.queue) >= limit and self.slots.count >= self.slots.capacity:
                outcome = CompactionOutcome(admitted=False, kind=job.kind, input_tokens=job.input_tokens)
                self.outcomes.append(outcome)
                return outcome
            slot = self.slots.request()
            yield slot
        began = self.env.now
        targets, kind = (list(job.targets), "given") if job.targets is not None else self._targets(job)
        requests = [
            self.submit(r, p.tokens, out, self._namespace(job, p), p.cached_prefix, kind="chunk", priority=job.priority)
            for r, p, out in zip(targets, job.prompts, job.output_tokens, strict=True)
        ]
        self._chunks[id(job)] = requests
        job.dispatched.extend(requests)
        yield simpy.AllOf(self.env, [r.done for r in requests])
        del self._chunks[id(job)]
        if slot is not None and self.slots is not None:
            self.slots.release(slot)
        outcome = CompactionOutcome(
            admitted=True,
            kind=job.kind,
            queued_s=began - arrived,
            latency_s=self.env.now - began,
            placement=kind,
            chunks=len(requests),
            input_tokens=job.input_tokens,
            prompt_tokens=sum(r.prompt_tokens for r in requests),
            cached_tokens=sum(r.cached_tokens for r in requests),
            output_tokens=sum(r.output_tokens for r in requests),
            replicas=targets,
        )
        self.outcomes.append(outcome)
        return outcome

    def escalate(self, job: CompactionJob) -> None:
        """A turn waits for this compaction: what is left of it runs at the agent's priority."""
        for request in self._chunks.get(id(job), []):
            if request.finished != request.finished:  # not finished (NaN)
                self.replicas[request.replica].escalate(request)

    @staticmethod
    def _namespace(job: CompactionJob, prompt: PromptLengths) -> Hashable | None:
        if prompt.chain == "history":
            return job.namespace
        if prompt.chain == "compaction":
            return (job.namespace, "compaction", id(job))
        return None

    def _targets(self, job: CompactionJob) -> tuple[list[int], str]:
        """The replica of every chunk prompt, decided by `serving.routing.place`."""
        count = len(self.replicas)
        shapes = tuple(PromptShape(p.ids, p.history_prefix) for p in job.prompts)
        decision = place(
            PlacementInput(
                prompts=shapes,
                session=job.session,
                has_session=True,
                assumed_cached_tokens=job.assumed_cached_tokens,
                replicas=count,
                max_tokens=max(job.output_tokens),
                block_size=self.profile.block_size,
            ),
            self.policy,
            self.cost,
        )
        if decision.kind == "round_robin":
            first, self.round_robin = self.round_robin, self.round_robin + len(shapes)
            return [(first + k) % count for k in range(len(shapes))], decision.kind
        home = self.home(job.session)
        return [(home + slot) % count for slot in decision.slots], decision.kind
