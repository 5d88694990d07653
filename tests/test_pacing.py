"""Background work yields to the agent: the step rule and the escalation of a background run (pure)."""

from __future__ import annotations

import asyncio

import pytest

from compaction.backend import Generation, GenerationRequest
from compaction.errors import BackendError
from compaction.pacing import AGENT, BACKGROUND, CONFIG_KEY, CPU_RULE, NEXT, Escalation, YieldRule
from tests.support import until


def test_only_the_most_urgent_requests_prefill_and_background_steps_are_small() -> None:
    rule = YieldRule(background_step_tokens=256, decode_beside=True)
    assert not rule.held(AGENT, AGENT, prefilling=True)
    assert rule.held(BACKGROUND, AGENT, prefilling=True)  # no background prefill beside an agent request
    assert not rule.held(BACKGROUND, AGENT, prefilling=False)  # its decode rides along
    assert not rule.held(BACKGROUND, BACKGROUND, prefilling=True)  # alone, background work runs
    assert YieldRule(256, decode_beside=False).held(BACKGROUND, AGENT, prefilling=False)
    assert rule.budget(AGENT, 2048) == 2048 and rule.budget(BACKGROUND, 2048) == 256
    assert YieldRule().budget(BACKGROUND, 2048) == 2048 and rule.budget(BACKGROUND, 128) == 128


def test_the_next_turns_work_goes_beside_the_agents_turn_within_a_small_budget() -> None:
    rule = CPU_RULE  # background held in decode too
    assert rule.held(BACKGROUND, AGENT, prefilling=False) and rule.held(BACKGROUND, NEXT, prefilling=False)
    assert not rule.held(NEXT, AGENT, prefilling=False)  # decodes beside the agent
    assert not rule.held(NEXT, AGENT, prefilling=True)  # prefills beside the agent's running requests...
    assert rule.held(NEXT, AGENT, prefilling=True, lead_waiting=True)  # ...never before an agent request is admitted
    assert rule.budget(AGENT, 2048, 3, rule.beside(NEXT)) == 3 + rule.next_step_tokens  # at most that beside them
    assert rule.budget(AGENT, 2048, 4000, rule.beside(NEXT)) == 2048  # an agent prefill takes the whole step
    assert rule.budget(NEXT, 2048) == 256  # alone, it runs in background steps


def test_on_a_gpu_background_work_prefills_beside_agent_decode_within_its_allowance() -> None:
    rule = YieldRule(background_step_tokens=2048, decode_beside=True, background_beside_tokens=256)
    assert not rule.held(BACKGROUND, AGENT, prefilling=True) and rule.beside(BACKGROUND) == 256
    assert rule.held(BACKGROUND, AGENT, prefilling=True, lead_waiting=True)  # never before an agent is admitted
    assert rule.held(BACKGROUND, NEXT, prefilling=True)  # behind NEXT work, as before
    assert rule.budget(AGENT, 8192, 40, 256) == 296 and CPU_RULE.beside(BACKGROUND) == 0


def test_the_rule_travels_in_the_engines_additional_config() -> None:
    assert YieldRule.from_config(CPU_RULE.config()) == CPU_RULE
    assert YieldRule.from_config({}) == YieldRule() == YieldRule.from_config(None)
    assert YieldRule.from_config({CONFIG_KEY: {"next_step_tokens": 32}}).next_step_tokens == 32
    assert set(CPU_RULE.config()) == {CONFIG_KEY}


class Parked:
    """A backend whose calls wait until released, recording the priority of every call and of what completed."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.sent: list[int] = []
        self.done: list[int] = []
        self.fail = False

    async def generate(self, request: GenerationRequest) -> Generation:
        self.sent.append(request.priority)
        await self.release.wait()
        if self.fail:
            raise BackendError("replica died")
        self.done.append(request.priority)
        return Generation("ok", 1, len(request.prompt_token_ids), 0, "stop", 0.0)


async def test_a_background_call_is_resent_at_the_agents_priority_when_a_turn_needs_it() -> None:
    inner, urgent = Parked(), asyncio.Event()
    backend = Escalation(inner, BACKGROUND, urgent)
    calls = [asyncio.create_task(backend.generate(GenerationRequest((1, 2, 3), 4))) for _ in range(3)]
    await until(lambda: len(inner.sent) == 3)
    assert inner.sent == [BACKGROUND] * 3
    urgent.set()
    await until(lambda: len(inner.sent) == 6)
    assert inner.sent == [BACKGROUND] * 3 + [AGENT] * 3  # the parked calls were cancelled and sent again
    inner.release.set()
    assert [g.text for g in await asyncio.gather(*calls)] == ["ok"] * 3
    assert inner.done == [AGENT] * 3 and backend.escalated == 3
    assert (await backend.generate(GenerationRequest((1,), 1))).text == "ok" and inner.sent[-1] == AGENT


async def test_next_calls_in_flight_are_not_resent_when_a_turn_needs_them() -> None:
    inner, urgent = Parked(), asyncio.Event()
    backend = Escalation(inner, NEXT, urgent)
    call = asyncio.create_task(backend.generate(GenerationRequest((1, 2, 3), 4)))
    await until(lambda: inner.sent)
    urgent.set()
    await asyncio.sleep(0.01)  # room for a wrong resend to happen
    assert inner.sent == [NEXT]  # never held in decode: what it decoded is kept
    later = asyncio.create_task(backend.generate(GenerationRequest((4,), 4)))
    inner.release.set()
    await asyncio.gather(call, later)
    assert inner.sent == [NEXT, AGENT] and len(inner.done) == 2 and backend.escalated == 0  # a later call: agent


async def test_agent_priority_calls_go_straight_through_and_failures_propagate() -> None:
    inner = Parked()
    inner.release.set()
    assert (await Escalation(inner, AGENT).generate(GenerationRequest((1,), 1))).text == "ok"
    assert inner.sent == [AGENT]
    inner.fail = True
    with pytest.raises(BackendError):
        await Escalation(inner, BACKGROUND).generate(GenerationRequest((1,), 1))


async def test_a_cancelled_caller_cancels_its_call() -> None:
    inner = Parked()
    call = asyncio.create_task(Escalation(inner, BACKGROUND).generate(GenerationRequest((1,), 1)))
    await until(lambda: inner.sent)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    inner.release.set()
    await asyncio.sleep(0.01)
    assert inner.done == []  # nothing completed behind the caller's back


class Marked(Parked):
    """Parked, plus the requests that raise tags (answered at once, or failing when `refuse`)."""

    def __init__(self, refuse: bool = False) -> None:
        super().__init__()
        self.refuse = refuse
        self.raised: list[GenerationRequest] = []
        self.tags: list[str | None] = []

    async def generate(self, request: GenerationRequest) -> Generation:
        if request.raises:
            self.raised.append(request)
            if self.refuse:
                raise BackendError("no such engine extension")
            return Generation("", 1, 1, 0, "length", 0.0)
        self.tags.append(request.tag)
        return await super().generate(request)


async def test_in_place_an_escalated_prompt_is_raised_on_the_engine_not_sent_again() -> None:
    inner, urgent = Marked(), asyncio.Event()
    backend = Escalation(inner, BACKGROUND, urgent, in_place=True)
    request = GenerationRequest((7, 8, 9), 4, request_id="chunk-0-first", routing_key="s1", cache_salt="t")
    call = asyncio.create_task(backend.generate(request))
    await until(lambda: inner.sent)
    urgent.set()
    await until(lambda: inner.raised)
    (marker,) = inner.raised
    assert marker.raises == (inner.tags[0],) and inner.tags[0]  # the prompt went out tagged; the marker names it
    assert marker.priority == AGENT and marker.routing_key == "s1" and marker.cache_salt == "t"  # where it went
    assert marker.prompt_token_ids == (7,) and marker.max_tokens == 1
    assert inner.sent == [BACKGROUND]  # not sent again: what it prefilled and decoded is kept
    inner.release.set()
    assert (await call).text == "ok" and backend.escalated == 1


async def test_an_engine_that_refuses_the_raise_gets_the_prompt_again_at_the_agents_priority() -> None:
    inner, urgent = Marked(refuse=True), asyncio.Event()
    backend = Escalation(inner, BACKGROUND, urgent, in_place=True)
    call = asyncio.create_task(backend.generate(GenerationRequest((1,), 1)))
    await until(lambda: inner.sent)
    urgent.set()
    await until(lambda: len(inner.sent) == 2)
    assert len(inner.raised) == 1 and inner.sent == [BACKGROUND, AGENT]
    inner.release.set()
    assert (await call).text == "ok" and inner.done == [AGENT]


async def test_one_prompt_of_a_run_is_raised_alone_and_the_run_raises_all_of_them() -> None:
    """Another run that needs one prompt's answer now raises that prompt alone; a turn waiting for the run raises
    every prompt it still has in flight (and counts them on the run)."""
    inner = Marked()
    run = Escalation(inner, BACKGROUND, in_place=True)
    needed, other = run.prompt(), run.prompt()
    calls = [asyncio.create_task(p.generate(GenerationRequest((k,), 1))) for k, p in enumerate((needed, other))]
    await until(lambda: len(inner.sent) == 2)
    needed.hurry()
    await until(lambda: inner.raised)
    assert [m.raises for m in inner.raised] == [(inner.tags[0],)] and other.current() == BACKGROUND
    assert needed.current() == AGENT and run.escalated == 1
    run.hurry()
    await until(lambda: len(inner.raised) == 2)
    assert [m.raises for m in inner.raised] == [(inner.tags[0],), (inner.tags[1],)] and other.current() == AGENT
    inner.release.set()
    assert [(await c).text for c in calls] == ["ok", "ok"] and inner.sent == [BACKGROUND] * 2 and run.escalated == 2
