"""Background requests yield to the agent's on the real engine (the shared in-process vLLM-CPU engine runs
serving.scheduler.YieldingScheduler with compaction.pacing.CPU_RULE)."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import pytest

from compaction.backend import GenerationRequest
from compaction.pacing import AGENT, BACKGROUND, NEXT

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
    long = GenerationRequest(prompt(1, 2400), max_tokens=4, min_tokens=4, request_id="bg", priority=BACKGROUND)
    short = GenerationRequest(prompt(2, 128), max_tokens=8, min_tokens=8, request_id="agent", priority=AGENT)
    await engine.reset_prefix_cache()
    alone = (await engine.generate(long)).latency_s  # what the background request takes on this machine, alone
    await engine.reset_prefix_cache()
    began = time.perf_counter()
    background = asyncio.create_task(timed(engine, long))
    await asyncio.sleep(alone / 10)  # its prefill is under way (in steps of at most 256 tokens), far from done
    agent_done, agent = await timed(engine, short)
    background_done, behind = await background
    assert agent.output_tokens == 8 and behind.output_tokens == 4  # both complete, nothing lost
    assert agent_done < background_done  # the agent's turn did not wait for the 2,400-token prefill
    assert agent_done - began < 0.6 * (background_done - began)
    assert behind.prompt_tokens == 2400 and behind.cached_prompt_tokens == 0


async def test_the_next_turns_work_is_done_beside_an_agents_decode_and_background_work_after_it(engine: Any) -> None:
    """Counted in engine steps, not seconds: the agent decodes 96 tokens; a NEXT request (200 prompt tokens at most
    64 a step beside it, then 8 tokens) needs about a dozen of those steps, a background one none until it is done."""
    await engine.reset_prefix_cache()
    agent = GenerationRequest(prompt(3, 64), max_tokens=96, min_tokens=96, request_id="agent", priority=AGENT)
    first = asyncio.create_task(timed(engine, agent))  # sent first: tasks start in the order they were made
    beside = [
        GenerationRequest(prompt(4 + k, 200), max_tokens=8, min_tokens=8, request_id=f"{name}", priority=priority)
        for k, (name, priority) in enumerate((("next", NEXT), ("background", BACKGROUND)))
    ]
    (next_done, nxt), (background_done, bg) = await asyncio.gather(*(timed(engine, r) for r in beside))
    agent_done, generation = await first
    assert generation.output_tokens == 96 and nxt.output_tokens == 8 and bg.output_tokens == 8
    assert next_done < agent_done < background_done


async def test_a_background_request_raised_where_it_is_finishes_beside_the_agent_and_its_twin_after(
    engine: Any,
) -> None:
    """`compaction.pacing.Escalation` in place, counted in engine steps: an agent decodes 96 tokens; two background
    requests (200 prompt tokens, 16 out) are held behind it; a one-token agent request naming one's tag raises that
    one where it is, so it is done within the agent's decode, its twin after it, each prompt sent once."""
    await engine.reset_prefix_cache()
    agent = GenerationRequest(prompt(10, 64), max_tokens=96, min_tokens=96, request_id="agent", priority=AGENT)
    first = asyncio.create_task(timed(engine, agent))  # sent first: tasks start in the order they were made
    held = [
        GenerationRequest(prompt(11 + k, 200), 16, 16, request_id=tag, priority=BACKGROUND, tag=tag)
        for k, tag in enumerate(("raised", "twin"))
    ]
    tasks = [asyncio.create_task(timed(engine, r)) for r in held]
    marker = GenerationRequest(prompt(13, 1), max_tokens=1, request_id="raise", priority=AGENT, raises=("raised",))
    await engine.generate(marker)
    (raised_done, raised), (twin_done, twin) = await asyncio.gather(*tasks)
    agent_done, generation = await first
    assert generation.output_tokens == 96 and raised.output_tokens == 16 and twin.output_tokens == 16
    assert raised_done < agent_done < twin_done
    assert raised.cached_prompt_tokens == 0  # prefilled once, where it was: no copy read it back from the cache
