"""One replica as a vLLM-like engine: FCFS chunked prefill beside a decoding batch, as a fluid model.

vLLM runs engine steps; each step decodes one token for every running sequence and spends the rest of its token
budget (`max_batched_tokens`) on the prefill at the head of the queue. Simulating steps one by one would cost an
event per step per replica (millions per simulated hour), so between two events (a request arrives, a prefill ends,
a sequence ends) the replica runs at constant rates:

    step s = decode_step(batch, context) + w,   w = prefill seconds of one step's chunk (0 when nothing prefills)
    every decoding sequence gains 1/s tokens per second; the head prefill loses w/s seconds of work per second

Replicas that share one host's compute (the CPU profile: every engine's threads span the same cores) run at
1 / max(1, busy / host_parallelism) of their calibrated speed while `busy` of them have work; a replica's change of
state re-times its peers.

Priorities follow the engines' yield rule (`compaction.pacing`, `serving.scheduler`): a background request (a background
compaction's chunk prompt, the prefill of its compacted prompt) prefills only while no agent-priority request is on
the replica, or beside agent decode at most `background_beside_tokens` a step, and its own steps are at most
`background_step_tokens`; an agent request that arrives takes over the prefill
at once (in the engine it waits for one such step). Background sequences decode beside agent ones where the rule
lets them (`decode_beside`, the GPU rule); where it does not (the CPU rule) they pause while any agent request is on
the replica and go on from where they were. A background request a waiting turn raises to the agent's priority
goes on where it is, with what it prefilled and decoded (`compaction.pacing.Escalation` raises it on the engine).
`yielding=False` gives every request the same priority, as vLLM's FCFS scheduler does.

Decode progress is one shared clock `v` (tokens decoded per sequence since start): a sequence that joins at v0 with
n tokens to go finishes at v0 + n, so events cost O(log batch). A request's cache lookup happens when it reaches the
head of the prefill queue (vLLM looks prefixes up when it first schedules a request), so chunk prompts queued behind
each other reuse what the earlier ones computed.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Literal

import simpy

from compaction.pacing import AGENT, YieldRule
from jobs.sim.cache import PrefixCache
from jobs.sim.profiles import EngineProfile

RequestKind = Literal["turn", "chunk", "warm"]
_EPS = 1e-9


@dataclass(eq=False, slots=True)
class Request:
    """One prompt on one replica. The first fields are its shape; the rest is filled in as it runs."""

    prompt_tokens: int  # tokens in the prompt
    output_tokens: int  # tokens it decodes (forced: the simulator has no early stop)
    namespace: Hashable | None  # the history chain its prompt starts with (None: shares nothing)
    history_prefix: int  # leading prompt tokens that belong to that chain
    keeps_output: bool  # the output continues the chain (an agent turn's answer is its next history)
    kind: RequestKind  # agent turn or compaction chunk, for the statistics
    done: simpy.Event  # succeeds when the last token is out
    priority: int = AGENT  # compaction.pacing: AGENT or BACKGROUND
    replica: int = -1
    submitted: float = math.nan
    started: float = math.nan  # prefill began (cache looked up)
    finished: float = math.nan
    cached_tokens: int = 0  # prompt tokens read from the prefix cache
    work: float = 0.0  # prefill seconds still to do
    reserved: int = 0  # KV tokens held beyond the cache

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


@dataclass
class ReplicaStats:
    """Integrals over the run: how busy one replica was."""

    busy_s: float = 0.0  # time with any prefill or decode work
    batch_s: float = 0.0  # integral of the decoding batch size over time
    prefill_s: float = 0.0  # time with a prefill running
    requests: int = 0


@dataclass(eq=False)
class Replica:
    env: simpy.Environment
    index: int
    profile: EngineProfile
    peers: list[Replica] = field(default_factory=list)  # every replica on this one's host, itself included
    rule: YieldRule | None = None  # the engine's yield rule; None: FCFS, every priority equal
    cache: PrefixCache = field(init=False)
    stats: ReplicaStats = field(default_factory=ReplicaStats)

    def __post_init__(self) -> None:
        self.cache = PrefixCache(self.profile.kv_tokens, self.profile.block_size)
        self.waiting: deque[Request] = deque()  # agent priority (every request when not yielding)
        self.held: deque[Request] = deque()  # background priority, waiting or preempted mid-prefill
        self.prefilling: Request | None = None
        self.agent_decoding = 0
        self.decoding: list[tuple[float, int, Request]] = []  # (finish on the decode clock, tie-break, request)
        self.paused: list[tuple[float, int, Request]] = []  # (tokens left, tie-break, request): held background decode
        self.v = 0.0  # decode clock: tokens each running sequence has decoded since the start
        self.context = 0.0  # context tokens of the decoding batch
        self._last = self.env.now
        self._rate = (0.0, 0.0)  # _rates() as of the last change of state
        self._generation = 0
        self._count = 0

    @property
    def load(self) -> int:
        waiting = len(self.waiting) + len(self.held) + len(self.paused)
        return waiting + len(self.decoding) + (self.prefilling is not None)

    @property
    def busy(self) -> bool:
        return self.prefilling is not None or bool(self.decoding)

    def submit(self, request: Request) -> None:
        self._changing()
        request.replica, request.submitted = self.index, self.env.now
        self.stats.requests += 1
        self._queue(request).append(request)
        self._settle()
        self._changed()

    def escalate(self, request: Request) -> None:
        """Raise a request to the agent's priority where it is (a turn waits for its compaction,
        `compaction.pacing.Escalation`): it keeps what it prefilled and decoded."""
        if request.priority <= AGENT:
            return
        self._changing()
        paused = next((e for e in self.paused if e[2] is request), None)
        if request in self.held:
            self.held.remove(request)
            self.waiting.append(request)
        elif paused is not None:  # held in decode: it goes on from the tokens it had
            self.paused.remove(paused)
            heapq.heappush(self.decoding, (self.v + paused[0], paused[1], request))
            self.context += request.prompt_tokens + request.output_tokens / 2
            self.agent_decoding += 1
        elif any(r is request for _, _, r in self.decoding):
            self.agent_decoding += 1
        request.priority = AGENT
        self._settle()
        self._changed()

    def cancel(self, request: Request) -> None:
        """Drop a request no one will take (a rolling run's last chunk a later turn's run supersedes, what a session's
        runs still have in flight once its compaction is done), as the service cancels it: what it holds is freed,
        and it ends now (`done` fires, nothing more decoded)."""
        if request.finished == request.finished or request.replica != self.index:
            return
        self._changing()
        if self.prefilling is request:
            self.prefilling = None
        for queue in (self.waiting, self.held):
            if request in queue:
                queue.remove(request)
        self.paused = [e for e in self.paused if e[2] is not request]  # its context was taken off when it paused
        if any(e[2] is request for e in self.decoding):
            self.decoding = [e for e in self.decoding if e[2] is not request]
            heapq.heapify(self.decoding)
            self.context -= request.prompt_tokens + request.output_tokens / 2
            self.agent_decoding -= request.priority <= AGENT
        if not self.decoding:
            self.context = 0.0
        if request.started == request.started:  # it reserved its KV when its prefill began
            self.cache.release(request.namespace, request.reserved)
            request.reserved = 0
        request.finished = self.env.now
        request.done.succeed(request)
        self._settle()
        self._changed()

    def _queue(self, request: Request) -> deque[Request]:
        return self.held if self.rule is not None and request.priority > AGENT else self.waiting

    def _agent_busy(self) -> bool:
        head = self.prefilling
        return bool(self.waiting) or self.agent_decoding > 0 or (head is not None and head.priority <= AGENT)

    def _changing(self) -> None:
        """Bring this replica (and its host's peers, whose speed may change with it) up to now."""
        for replica in self.peers or (self,):
            replica._advance()

    def _changed(self) -> None:
        for replica in self.peers or (self,):
            replica._schedule()

    def _slowdown(self) -> float:
        parallel = self.profile.host_parallelism
        if parallel is None or not self.peers:
            return 1.0
        return max(1.0, sum(r.busy for r in self.peers) / parallel)

    def _rates(self) -> tuple[float, float]:
        """(seconds per step, prefill work seconds done per step)."""
        batch = len(self.decoding)
        slow = self._slowdown()
        decode = self.profile.decode_step_s(batch, self.context) * slow if batch else 0.0
        if self.prefilling is None:
            return decode, 0.0
        step = self.profile.max_batched_tokens
        if self.rule is not None and self.prefilling.priority > AGENT:
            if self._agent_busy():  # agent requests decode (one waiting would have taken the prefill over)
                allowance = self.rule.beside(self.prefilling.priority)
                if allowance <= 0:
                    return decode, 0.0  # held: no background prefill beside agent work
                work = allowance / self.profile.prefill_tokens_per_s
                return decode + work * slow, work
            step = self.rule.budget(self.prefilling.priority, step)
        chunk = max(self.profile.block_size, step - batch)
        work = chunk / self.profile.prefill_tokens_per_s
        return decode + work * slow, work

    def _advance(self) -> None:
        now = self.env.now
        dt = now - self._last
        self._last = now
        if dt <= 0:
            return
        step, work = self._rate
        if step <= 0:
            return
        self.stats.busy_s += dt
        if self.decoding:
            self.v += dt / step
            self.stats.batch_s += dt * len(self.decoding)
        if self.prefilling is not None:
            self.prefilling.work -= dt * work / step
            self.stats.prefill_s += dt

    def _settle(self) -> None:
        """Finish what is due, start the next prefill; repeat until nothing changes."""
        changed = True
        while changed:
            changed = False
            head = self.prefilling
            if head is not None and head.work <= _EPS:
                self._prefilled(head)
                changed = True
            while self.decoding and self.decoding[0][0] <= self.v + _EPS:
                self._finish(heapq.heappop(self.decoding)[2])
                changed = True
            head = self.prefilling
            if self.rule is not None and head is not None and head.priority > AGENT and self.waiting:  # agent first
                self.held.appendleft(head)
                self.prefilling = None
                changed = True
            queue = self.waiting or self.held
            if self.prefilling is None and queue and len(self.decoding) < self.profile.max_num_seqs:
                changed = self._start(queue) or changed
        self._hold_decode()

    def _hold_decode(self) -> None:
        """Background sequences pause while agent work is on the replica, where the rule holds their decode."""
        if self.rule is None or self.rule.decode_beside:
            return
        if self._agent_busy():
            running = [e for e in self.decoding if e[2].priority > AGENT]
            for finish, count, request in running:
                self.paused.append((finish - self.v, count, request))
                self.context -= request.prompt_tokens + request.output_tokens / 2
            if running:
                self.decoding = [e for e in self.decoding if e[2].priority <= AGENT]
                heapq.heapify(self.decoding)
        elif self.paused:
            for left, count, request in self.paused:
                heapq.heappush(self.decoding, (self.v + left, count, request))
                self.context += request.prompt_tokens + request.output_tokens / 2
            self.paused.clear()

    def _start(self, queue: deque[Request]) -> bool:
        request = queue[0]
        if request.started == request.started:  # resumed after an agent request took over its prefill
            self.prefilling = queue.popleft()
            return True
        cache = self.cache
        reuse = cache.lookup(request.namespace, request.history_prefix, request.prompt_tokens)
        need = request.prompt_tokens - reuse + request.output_tokens
        reserved = cache.reserve(request.namespace, need)
        if not reserved:
            if not self.decoding and need > cache.capacity:
                raise ValueError(
                    f"a {request.prompt_tokens}-token prompt (+{request.output_tokens} out) can never fit "
                    f"{cache.capacity} tokens of KV on {self.profile.name}; lower tau or the chunk size"
                )
            return False  # waits until a decoding sequence frees memory
        queue.popleft()
        request.cached_tokens, request.reserved, request.started = reuse, reserved, self.env.now
        request.work = self.profile.prefill_seconds(reuse, request.prompt_tokens)
        self.prefilling = request
        return True

    def _prefilled(self, request: Request) -> None:
        self.prefilling = None
        request.reserved -= self.cache.extend(request.namespace, request.history_prefix, request.reserved)
        if request.output_tokens <= 0:
            self._finish(request)
            return
        self._count += 1
        self.agent_decoding += request.priority <= AGENT
        self.context += request.prompt_tokens + request.output_tokens / 2
        heapq.heappush(self.decoding, (self.v + request.output_tokens, self._count, request))

    def _finish(self, request: Request) -> None:
        if request.output_tokens > 0:
            self.context -= request.prompt_tokens + request.output_tokens / 2
            self.agent_decoding -= request.priority <= AGENT
        if not self.decoding:
            self.context = 0.0  # no drift from float sums
        if request.keeps_output:
            extent = request.prompt_tokens + request.output_tokens
            request.reserved -= self.cache.extend(request.namespace, extent, request.reserved)
        self.cache.release(request.namespace, request.reserved)
        request.finished = self.env.now
        request.done.succeed(request)

    def _schedule(self) -> None:
        step, work = self._rate = self._rates()
        due = math.inf
        if self.prefilling is not None and work > 0:
            due = max(0.0, self.prefilling.work) * step / work
        if self.decoding:
            due = min(due, max(0.0, self.decoding[0][0] - self.v) * step)
        self._generation += 1
        if math.isfinite(due):
            generation = self._generation
            timer = self.env.timeout(due)
            timer.callbacks.append(lambda _event: self._wake(generation))

    def _wake(self, generation: int) -> None:
        if generation != self._generation:
            return  # superseded by a later event on this replica
        self._changing()
        self._settle()
        self._changed()
