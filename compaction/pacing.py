"""Who computes in an engine step: the agent first, background compaction in what it leaves.

Pure rules (no vLLM import); `serving.scheduler` applies them inside vLLM's scheduler.

Priorities follow vLLM's convention, lower runs first: `AGENT` for the agent's own turns and for
blocking compactions (someone waits for them), `NEXT` for the work the agent's next turn will wait for
(a rolling session's last run before its threshold), `BACKGROUND` for other background compactions.

vLLM's `priority` policy alone orders only the waiting queue: a request already running keeps its
share of every step, and one step runs all its scheduled tokens in one forward pass, so an agent's
decode step waits behind a background prompt's prefill chunk (seconds on a CPU). Per step, here:
  - the step's lead is the most urgent priority on the engine (running or waiting);
  - requests of the lead priority are scheduled as vLLM would;
  - a less urgent request neither prefills nor is admitted from the waiting queue; it may decode its
    next token beside the lead (`decode_beside`: a batched decode step costs about what a single one
    does, so this keeps background work moving at almost no cost to the agent);
  - a step led by background work gets at most `background_step_tokens` tokens, so an agent request
    that arrives meanwhile waits one small step, not a whole `max_num_batched_tokens` of prefill;
  - `NEXT` work is never held in decode, and prefills beside the agent's running requests at most
    `next_step_tokens` tokens a step (held only while an agent request waits to be admitted): it is
    done beside the agent's own turn, at a bounded cost to it, instead of at the next turn;
  - other background work may do the same within `background_beside_tokens` a step (0 on the CPU, where
    a prefill step costs the agent a second): on a busy GPU engine, where some agent request is always
    decoding, holding its prefill would starve it.
Background work held back this way is never starved past the point it is needed: the turn that needs
its result raises what is left to the agent's priority, where it is (`serving.background`, `Escalation`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from dataclasses import dataclass, replace
from typing import Any, Literal

from compaction.backend import Backend, Generation, GenerationRequest
from compaction.errors import CompactionError

AGENT = 0
NEXT = 1
BACKGROUND = 2
Priority = Literal["agent", "background"]
PRIORITIES: dict[Priority, int] = {"agent": AGENT, "background": BACKGROUND}
CONFIG_KEY = "compaction_yield"  # the engine's additional_config entry that carries the rule


@dataclass(frozen=True)
class YieldRule:
    """How background work yields to the agent inside one engine."""

    background_step_tokens: int | None = None  # token budget of a step led by background work; None: the engine's
    decode_beside: bool = True  # background requests may decode beside the agent's
    next_step_tokens: int = 64  # what NEXT requests may prefill in a step led by agent requests
    background_beside_tokens: int = 0  # what background requests may prefill in such a step (0: none)

    def beside(self, priority: int) -> int:
        """Tokens a request of this priority, less urgent than the agent's, may prefill in a step the agent leads."""
        return self.next_step_tokens if priority == NEXT else self.background_beside_tokens

    def held(self, priority: int, lead: int, prefilling: bool, lead_waiting: bool = False) -> bool:
        """True when a request sits this step out (`lead_waiting`: a request of the lead priority waits to be
        admitted)."""
        if priority <= lead:
            return False
        if lead > AGENT:  # background work beside NEXT work, no agent on the engine
            return prefilling or not self.decode_beside
        if prefilling:
            return lead_waiting or self.beside(priority) <= 0
        return priority != NEXT and not self.decode_beside

    def budget(self, lead: int, engine_budget: int, lead_tokens: int | None = None, allowance: int = 0) -> int:
        """Token budget of a step whose most urgent request has priority `lead`; `lead_tokens`: what the lead's
        requests need this step when less urgent ones prefill beside them (None: none does), `allowance`: the most
        those may prefill."""
        if lead <= AGENT:
            return engine_budget if lead_tokens is None else min(engine_budget, lead_tokens + allowance)
        if self.background_step_tokens is None:
            return engine_budget
        return min(engine_budget, self.background_step_tokens)

    def config(self) -> dict[str, Any]:
        """The rule as the engine's `additional_config` entry."""
        return {CONFIG_KEY: dataclasses.asdict(self)}

    @classmethod
    def from_config(cls, additional_config: Any) -> YieldRule:
        entry = additional_config.get(CONFIG_KEY) if isinstance(additional_config, dict) else None
        return cls(**entry) if isinstance(entry, dict) else cls()


# The CPU engines' rule, measured with `python -m jobs.bench.yielding` (docs/placement.md): on one vLLM-CPU core a
# 256-token step takes about a second, and a decode step of 8 sequences costs 1.6x one of a single sequence,
# so background requests neither prefill nor decode beside the agent's there (NEXT work, a chunk or two, does).
CPU_RULE = YieldRule(background_step_tokens=256, decode_beside=False)


TAG_ARG = "compaction_tag"  # the engine request's extra args that carry GenerationRequest.tag ...
RAISE_ARG = "compaction_raise"  # ... and GenerationRequest.raises (`serving.scheduler`)


def engine_args(request: GenerationRequest) -> dict[str, Any]:
    """The request's tag and the tags it raises, as the engine request's extra args (vLLM's `extra_args`)."""
    tag = {TAG_ARG: request.tag} if request.tag else {}
    return {**tag, **({RAISE_ARG: list(request.raises)} if request.raises else {})}


class Escalation:
    """A backend that sends a compaction's prompts at `priority` until `urgent` is set; from then on at the
    agent's. What is still in flight then goes on at the agent's priority. `in_place` (engines that run
    `serving.scheduler`): each prompt goes out tagged, and a one-token request at the agent's priority names the tags
    to raise, so the engine raises them where they are and they keep what they prefilled and decoded; else (or if
    that request fails) the prompt is cancelled and sent again at the agent's priority (vLLM cannot change a running
    request's priority; the copy reads what was prefilled in whole cache blocks from the prefix cache, and decodes
    again). NEXT prompts in flight are left as they are: they are never held in decode."""

    def __init__(
        self,
        inner: Backend,
        priority: int,
        urgent: asyncio.Event | None = None,
        in_place: bool = False,
        run: Escalation | None = None,
    ):
        self.inner = inner
        self.priority = priority
        self.urgent = urgent or asyncio.Event()
        self.in_place = in_place
        self.run = run  # one prompt's escalation (`prompt`): raised with its run too
        self.escalated = 0  # prompts raised to the agent's priority while in flight

    def prompt(self) -> Escalation:
        """The escalation of one of this run's prompts: raised with the run (its `urgent`), or alone (`hurry`) when
        another run that needs its answer sooner joins it (`compaction.compactor`)."""
        return Escalation(self.inner, self.priority, None, self.in_place, run=self)

    def hurry(self) -> None:
        """Its prompts go on at the agent's priority from now on."""
        self.urgent.set()

    def raised(self) -> bool:
        return self.urgent.is_set() or (self.run is not None and self.run.raised())

    def current(self) -> int:
        """The priority its prompts go out at now."""
        return AGENT if self.raised() else self.priority

    async def until_raised(self) -> None:
        """Until its prompts go at the agent's priority."""
        events = [e.urgent for e in (self, self.run) if e is not None]
        waits = [asyncio.ensure_future(e.wait()) for e in events]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()

    async def generate(self, request: GenerationRequest) -> Generation:
        if self.priority <= AGENT or self.raised():
            return await self.inner.generate(replace(request, priority=AGENT))
        if self.priority == NEXT:
            return await self.inner.generate(replace(request, priority=NEXT))
        tag = uuid.uuid4().hex if self.in_place else None
        first = asyncio.ensure_future(self.inner.generate(replace(request, priority=self.priority, tag=tag)))
        try:
            await first_of(first, asyncio.ensure_future(self.until_raised()))
            if first.done():
                return first.result()
            for counted in (self, self.run):
                if counted is not None:
                    counted.escalated += 1
            if tag is not None and await self._raised(request, tag):
                return await first
            first.cancel()
            await asyncio.wait({first})
            if not first.cancelled():
                return first.result()
            return await self.inner.generate(replace(request, priority=AGENT))
        finally:
            first.cancel()

    async def _raised(self, request: GenerationRequest, tag: str) -> bool:
        """Whether the engine took the request that raises `tag` (sent where the prompt went: its routing key)."""
        marker = GenerationRequest(
            request.prompt_token_ids[:1], max_tokens=1, request_id=f"{request.request_id}-raise",
            routing_key=request.routing_key, priority=AGENT, cache_salt=request.cache_salt, raises=(tag,),
        )  # fmt: skip
        try:
            await self.inner.generate(marker)
        except CompactionError:
            return False
        return True


async def first_of(call: asyncio.Future[Any], other: asyncio.Future[Any]) -> None:
    """Until `call` or `other` is done; `other` is cancelled then."""
    try:
        await asyncio.wait({call, other}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        other.cancel()


def urgency(backend: Backend) -> int:
    """The priority a backend's prompts go out at now (lower is more urgent)."""
    return backend.current() if isinstance(backend, Escalation) else AGENT


async def unless_raised(backend: Backend, task: asyncio.Future[Any]) -> bool:
    """True once `task` is done; False, and `task` cancelled, if the backend's prompts go to the agent's priority
    first (a turn waits for them: what nobody waited for is asked no more)."""
    try:
        if isinstance(backend, Escalation) and urgency(backend) > AGENT:
            await first_of(task, asyncio.ensure_future(backend.until_raised()))
            if not task.done():
                task.cancel()
        await asyncio.wait({task})  # given up on the engine before the chunk settles
        return not task.cancelled()
    finally:
        task.cancel()  # no-op once done
