"""Admission of compactions into a model's engines: run what they can batch, queue a bounded number, shed the rest.

Pure (asyncio only; no Ray import). The coordinator holds one `Gate` per model and one `SharedRuns`.

Gate
    Capacity is counted in sequences, the unit an engine batches: a compaction of N chunks keeps up
    to N chunk prompts in flight, so it holds N of the model's `capacity` sequences while it runs.
    A compaction larger than the whole capacity starts alone once nothing else runs. `max_running`
    optionally caps the number of compactions running at once.
    An agent-lane compaction counts only the agent-lane sequences running: background runs yield to it
    inside the engine (`serving.scheduler`), so a background run that fills the capacity does not make an
    agent's compaction wait for it.
    Waiting is fair, in lanes: an agent is waiting on a compaction of the agent lane (blocking), or on a
    background run whose `urgent` event its turn set; those go before background runs. Within a lane
    the tenant with the fewest compactions running goes first, then the one served longest ago (round
    robin), then the oldest. The chosen head starts as soon as it fits, and nothing overtakes it (a
    large compaction is not starved by small ones).
    Beyond `max_queued` waiting compactions, `Overloaded` with a Retry-After estimated from how long
    recent compactions took and how many are ahead, unless the newcomer outranks a waiter: a full queue
    makes room for the agent lane by refusing a background run, and for a tenant by refusing a waiter
    of a tenant queuing more (its youngest, in the same lane): one tenant alone may fill the queue, and
    cannot shut the others out of it.

SharedRuns
    Identical concurrent requests (same session, same job) run once and every caller gets the
    result. The shared run belongs to no single caller: it runs in a fresh context (so a framework
    that cancels a request's child calls with the request does not cancel it for the others) and is
    cancelled when its last caller leaves (client disconnect, deadline).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import itertools
import math
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from compaction.bounded import BoundedLRU
from compaction.errors import Overloaded

T = TypeVar("T")


@dataclass(frozen=True)
class Limits:
    """One model's admission limits on one coordinator replica."""

    capacity: int  # sequences (chunk prompts) that may run at once: what the engines batch, this replica's share
    max_queued: int  # compactions that may wait; more are refused with Retry-After
    max_running: int | None = None  # optional cap on compactions running at once


@dataclass(eq=False)
class _Waiter:
    sequences: int  # what the waiting compaction will hold once admitted
    tenant: str
    background: bool
    urgent: asyncio.Event | None  # set when an agent's turn waits for this background run: it joins the agent lane
    arrived: int
    granted: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    @property
    def agent_lane(self) -> bool:
        return not self.background or (self.urgent is not None and self.urgent.is_set())


@dataclass(frozen=True)
class GateState:
    """A snapshot for metrics and tests."""

    running: int  # compactions running
    running_sequences: int  # sequences they hold
    queued: int  # compactions waiting
    capacity: int  # sequences allowed at once


class Gate:
    """Bounded running (in sequences) plus a bounded FIFO queue, for one model."""

    def __init__(
        self, limits: Limits, *, typical_s: float = 30.0, on_change: Callable[[GateState], None] | None = None
    ) -> None:
        self.limits = limits
        self.on_change = on_change  # told every new state (metrics)
        self._holders: set[_Waiter] = set()  # the running compactions
        self._queue: list[_Waiter] = []
        self._arrivals = itertools.count()
        self._by_tenant: Counter[str] = Counter()  # compactions running per tenant
        self._served: BoundedLRU[str, int] = BoundedLRU(4096)  # tenant -> when it was last admitted (round robin)
        self._typical_s = typical_s  # moving estimate of one compaction's run time, for Retry-After

    def state(self) -> GateState:
        sequences = sum(w.sequences for w in self._holders)
        return GateState(len(self._holders), sequences, len(self._queue), self.limits.capacity)

    def resize(self, capacity: int) -> None:
        """New sequence capacity (replicas came or went); waiting compactions that now fit start."""
        self.limits = dataclasses.replace(self.limits, capacity=max(1, capacity))
        self._wake()

    def retry_after_s(self) -> float:
        """Seconds until a slot is likely free: the queue ahead drains at `running` compactions per typical run."""
        waves = (len(self._queue) + 1) / max(1, len(self._holders))
        return float(min(120, max(1, math.ceil(waves * self._typical_s))))

    @asynccontextmanager
    async def admitted(
        self, sequences: int, tenant: str = "", *, background: bool = False, urgent: asyncio.Event | None = None
    ) -> AsyncIterator[float]:
        """Hold `sequences` while the body runs; yields the seconds spent waiting. Raises Overloaded when full."""
        began = time.perf_counter()
        waiter = _Waiter(max(1, sequences), tenant, background, urgent, next(self._arrivals))
        if not self._fits(waiter) or any(w.agent_lane or not waiter.agent_lane for w in self._queue):
            await self._wait(waiter)  # behind the queue, unless an agent's compaction that fits passes background runs
        else:
            self._take(waiter)
        waited = time.perf_counter() - began
        try:
            yield waited
        finally:
            self._release(waiter, time.perf_counter() - began - waited)

    def _fits(self, waiter: _Waiter) -> bool:
        if self.limits.max_running is not None and len(self._holders) >= self.limits.max_running:
            return False
        rivals = [w.sequences for w in self._holders if w.agent_lane or not waiter.agent_lane]
        return not rivals or sum(rivals) + waiter.sequences <= self.limits.capacity

    def _take(self, waiter: _Waiter) -> None:
        self._holders.add(waiter)
        self._by_tenant[waiter.tenant] += 1
        self._served.put(waiter.tenant, waiter.arrived)
        self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self.state())

    def _overloaded(self, why: str) -> Overloaded:
        return Overloaded(
            f"{len(self._holders)} compactions are running and {len(self._queue)} are queued for this model ({why}); "
            "retry after the Retry-After seconds",
            self.retry_after_s(),
        )

    def _make_room(self, waiter: _Waiter) -> None:
        """Raises Overloaded unless `waiter` may queue, refusing a waiter it outranks when the queue is full."""
        if len(self._queue) < self.limits.max_queued:
            return
        queued = Counter(w.tenant for w in self._queue)

        def outranked(w: _Waiter) -> bool:
            if w.agent_lane != waiter.agent_lane:
                return waiter.agent_lane
            return queued[w.tenant] > queued[waiter.tenant] + 1

        displaceable = [w for w in self._queue if outranked(w)]
        if not displaceable:
            raise self._overloaded(f"admission.max_queued = {self.limits.max_queued}")
        victim = max(displaceable, key=lambda w: (not w.agent_lane, queued[w.tenant], w.arrived))
        self._queue.remove(victim)
        victim.granted.set_exception(self._overloaded("an agent's compaction or a tenant queuing less took its place"))

    async def _wait(self, waiter: _Waiter) -> None:
        self._make_room(waiter)
        self._queue.append(waiter)
        self._wake()  # an agent-lane newcomer may start past background runs that wait
        self._changed()
        try:
            await waiter.granted
        except BaseException:
            if waiter.granted.done() and not waiter.granted.cancelled() and waiter.granted.exception() is None:
                self._release(waiter, None)  # granted just as the caller left: give the slot back
            else:
                if waiter in self._queue:
                    self._queue.remove(waiter)
                self._wake()  # the head may have changed
                self._changed()
            raise

    def _release(self, waiter: _Waiter, ran_s: float | None) -> None:
        self._holders.discard(waiter)
        self._by_tenant[waiter.tenant] -= 1
        if self._by_tenant[waiter.tenant] <= 0:
            del self._by_tenant[waiter.tenant]
        if ran_s is not None:
            self._typical_s = 0.8 * self._typical_s + 0.2 * ran_s
        self._wake()
        self._changed()

    def _head(self) -> _Waiter:
        """Agent lane first, then the tenant with the fewest running, then the one served longest ago, then the
        oldest."""

        def rank(w: _Waiter) -> tuple[bool, int, int, int]:
            served = self._served.peek(w.tenant)
            return not w.agent_lane, self._by_tenant[w.tenant], -1 if served is None else served, w.arrived

        return min(self._queue, key=rank)

    def _wake(self) -> None:
        for gone in [w for w in self._queue if w.granted.done()]:  # their callers left and will not take a slot
            self._queue.remove(gone)
        while self._queue and self._fits(head := self._head()):
            self._queue.remove(head)
            self._take(head)
            head.granted.set_result(None)


@dataclass(eq=False)
class _Run(Generic[T]):
    task: asyncio.Task[T]
    callers: int = 0


class SharedRuns(Generic[T]):
    """Runs identical concurrent requests once; cancels a run when its last caller leaves."""

    def __init__(self) -> None:
        self._runs: dict[Hashable, _Run[T]] = {}

    def __len__(self) -> int:
        return len(self._runs)

    async def run(self, key: Hashable, start: Callable[[], Awaitable[T]]) -> tuple[T, bool]:
        """(result, joined): `joined` is True when this caller shared a run another caller started."""
        entry = self._runs.get(key)
        joined = entry is not None
        if entry is None:
            entry = _Run(asyncio.create_task(self._body(start), context=contextvars.Context()))
            self._runs[key] = entry
            entry.task.add_done_callback(lambda _: self._forget(key, entry))
        entry.callers += 1
        try:
            return await asyncio.shield(entry.task), joined
        finally:
            entry.callers -= 1
            if entry.callers == 0 and not entry.task.done():
                self._forget(key, entry)
                entry.task.cancel()
                await asyncio.wait({entry.task})  # the caller hears back once the work has stopped

    @staticmethod
    async def _body(start: Callable[[], Awaitable[T]]) -> T:
        return await start()

    def _forget(self, key: Hashable, entry: _Run[T]) -> None:
        if self._runs.get(key) is entry:
            del self._runs[key]
        if entry.task.done() and not entry.task.cancelled():
            entry.task.exception()  # retrieved, so a run whose callers all left logs no "never retrieved"
