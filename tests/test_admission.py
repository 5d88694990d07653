"""The admission gate's lanes (serving/admission.py): the agent lane before background runs, a waiting turn's run
joining it, the tenant with the fewest running first, and a full queue that one tenant cannot hold against others.
Pure: the gate alone, with compactions that hold their slot until told to finish (the coordinator's use of it:
tests/test_coordinator.py; through the real service: tests/test_tenancy_service.py)."""

from __future__ import annotations

import asyncio

import pytest

from compaction.errors import Overloaded
from serving.admission import Gate, GateState, Limits


class Runs:
    """Compactions through one gate, each holding its sequences until `finish(name)`; `order` is who got in."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self.order: list[str] = []
        self.done: dict[str, asyncio.Event] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}

    def start(
        self, name: str, tenant: str = "t", *, background: bool = False, urgent: asyncio.Event | None = None
    ) -> asyncio.Task[None]:
        self.done[name] = asyncio.Event()

        async def run() -> None:
            async with self.gate.admitted(1, tenant, background=background, urgent=urgent):
                self.order.append(name)
                await self.done[name].wait()

        self.tasks[name] = asyncio.create_task(run())
        return self.tasks[name]

    async def settle(self) -> None:
        for _ in range(5):
            await asyncio.sleep(0)

    async def finish(self, name: str) -> None:
        self.done[name].set()
        await self.tasks[name]
        await self.settle()


def one_at_a_time(max_queued: int = 8) -> Runs:
    return Runs(Gate(Limits(capacity=1, max_queued=max_queued)))


async def test_an_agents_compaction_goes_before_background_runs_that_queued_first() -> None:
    runs = one_at_a_time()
    runs.start("running")
    await runs.settle()
    runs.start("bg1", background=True)
    runs.start("bg2", background=True)
    runs.start("agent")
    await runs.settle()
    for name in ("running", "agent", "bg1", "bg2"):
        await runs.finish(name)
    assert runs.order == ["running", "agent", "bg1", "bg2"]


async def test_a_background_run_an_agent_waits_for_joins_the_agent_lane() -> None:
    runs, waited_for = one_at_a_time(), asyncio.Event()
    runs.start("running")
    await runs.settle()
    runs.start("bg1", background=True)
    runs.start("bg2", background=True, urgent=waited_for)
    await runs.settle()
    waited_for.set()  # the agent's turn now waits for bg2
    for name in ("running", "bg2", "bg1"):
        await runs.finish(name)
    assert runs.order == ["running", "bg2", "bg1"]


async def test_background_runs_that_fill_the_capacity_do_not_hold_an_agents_compaction_back() -> None:
    """Background runs yield inside the engine, so the agent lane counts only its own sequences; another
    background run still waits for them, and agents still wait for each other."""
    runs = one_at_a_time()
    runs.start("bg", background=True)
    await runs.settle()
    runs.start("bg-next", background=True)
    runs.start("agent")
    await runs.settle()
    assert runs.order == ["bg", "agent"]
    runs.start("agent-next")
    await runs.settle()
    assert runs.order == ["bg", "agent"] and runs.gate.state() == GateState(2, 2, 2, 1)
    await runs.finish("agent")
    assert runs.order == ["bg", "agent", "agent-next"]
    await runs.finish("bg")
    assert runs.order == ["bg", "agent", "agent-next"]  # agent-next still holds the capacity
    await runs.finish("agent-next")
    await runs.finish("bg-next")
    assert runs.order == ["bg", "agent", "agent-next", "bg-next"] and runs.gate.state() == GateState(0, 0, 0, 1)


async def test_the_tenant_with_the_fewest_running_goes_first() -> None:
    runs = Runs(Gate(Limits(capacity=2, max_queued=8)))
    runs.start("a1", "a")
    runs.start("a2", "a")
    await runs.settle()
    for name in ("a3", "a4"):
        runs.start(name, "a")
    runs.start("b1", "b")
    await runs.settle()
    await runs.finish("a1")  # one slot: b has none running, a has one
    assert runs.order[-1] == "b1"
    for name in ("a2", "b1", "a3", "a4"):
        await runs.finish(name)
    assert runs.order == ["a1", "a2", "b1", "a3", "a4"]


async def test_one_tenant_fills_the_queue_alone_but_cannot_shut_another_out() -> None:
    runs = one_at_a_time(max_queued=3)
    runs.start("a0", "a")
    await runs.settle()
    for name in ("a1", "a2", "a3"):
        runs.start(name, "a")
    await runs.settle()
    assert runs.gate.state() == GateState(running=1, running_sequences=1, queued=3, capacity=1)
    with pytest.raises(Overloaded, match=r"admission\.max_queued = 3"):
        await runs.start("a4", "a")  # the tenant alone: the queue is its to fill, and full
    runs.start("b1", "b")  # another tenant takes the place of a's youngest
    await runs.settle()
    with pytest.raises(Overloaded, match="took its place"):
        await runs.tasks["a3"]
    assert runs.gate.state().queued == 3
    for name in ("a0", "b1", "a1", "a2"):
        await runs.finish(name)
    assert runs.order == ["a0", "b1", "a1", "a2"]
    assert runs.gate.state() == GateState(0, 0, 0, 1)


async def test_a_full_queue_of_background_runs_makes_room_for_an_agent() -> None:
    runs = one_at_a_time(max_queued=2)
    runs.start("running")
    await runs.settle()
    runs.start("bg1", background=True)
    runs.start("bg2", background=True)
    await runs.settle()
    runs.start("agent")
    await runs.settle()
    with pytest.raises(Overloaded) as refused:
        await runs.tasks["bg2"]
    assert refused.value.retry_after_s >= 1
    with pytest.raises(Overloaded, match=r"admission\.max_queued = 2"):
        await runs.start("bg3", background=True)  # a background run outranks no one here
    for name in ("running", "agent", "bg1"):
        await runs.finish(name)
    assert runs.order == ["running", "agent", "bg1"]


async def test_an_agent_that_fits_past_a_full_queue_of_background_runs_refuses_none_of_them() -> None:
    """Only a newcomer that has to queue takes a queued run's place; one admitted on arrival displaces nobody."""
    runs = one_at_a_time(max_queued=2)
    runs.start("bg", background=True)
    await runs.settle()
    runs.start("bg1", background=True)
    runs.start("bg2", background=True)
    runs.start("agent")
    await runs.settle()
    assert runs.order == ["bg", "agent"] and runs.gate.state().queued == 2
    for name in ("agent", "bg", "bg1", "bg2"):
        await runs.finish(name)
    assert runs.order == ["bg", "agent", "bg1", "bg2"]


async def test_a_caller_that_leaves_the_queue_gives_its_place_back() -> None:
    runs = one_at_a_time()
    runs.start("running")
    await runs.settle()
    leaving = runs.start("leaving")
    runs.start("next", background=True)
    await runs.settle()
    leaving.cancel()
    await runs.settle()
    assert runs.gate.state().queued == 1
    await runs.finish("running")
    await runs.finish("next")
    assert runs.order == ["running", "next"] and runs.gate.state() == GateState(0, 0, 0, 1)
