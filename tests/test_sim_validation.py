"""The simulator against the real two-replica CPU service: same workload, for the two placement policies that
bound the others (`python -m jobs.sim validate` runs all three).

The CPU profile is calibrated from the live service first (three requests), so the comparison holds on any
machine speed. Uses the shared service redeployed with two replicas (`two_replicas`); caches are emptied before
each policy's run.

Computed prefill is deterministic and must match; latency is a timing on a shared machine (one compaction of a few
seconds, beside the suite's other processes), so the test only bounds it to a factor of two, which a wrong model
of prefill, decode or placement breaks. The tight latency comparison is a benchmark: `python -m jobs.sim validate`.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from compaction.history import parse_messages
from compaction.render import render_history
from compaction.tokenizer import HFChatTokenizer
from jobs.bench.affinity import make_session
from jobs.data.conversations import locomo_messages
from jobs.sim.calibrate import calibrate, calibration_prompt, cpu_kv_tokens
from jobs.sim.validate import MODEL, Workload, ratio, table, validate
from serving.backends import OpenAIBackend
from serving.local import APP_NAME, LocalService
from serving.models import load_catalogue
from tests.support import auth

pytestmark = [pytest.mark.ray, pytest.mark.engine]


def test_the_simulator_matches_the_real_service_per_policy(
    two_replicas: LocalService, tokenizer: HFChatTokenizer, locomo: list[dict[str, Any]], model_path: Path
) -> None:
    from ray import serve

    conversation = locomo_messages(locomo[0])
    session = make_session(conversation, tokenizer, 800, turns=2, turn_tokens=120)
    workload = Workload(session.base, session.observations)
    coordinator = serve.get_deployment_handle("Coordinator", app_name=APP_NAME)
    spec = load_catalogue().get(MODEL)

    async def reset() -> None:
        await coordinator.reset_prefix_cache.remote(MODEL)

    history = render_history(parse_messages(conversation), tokenizer).token_ids

    async def run() -> Any:
        async with httpx.AsyncClient(base_url=two_replicas.url, headers=auth(), timeout=900) as client:
            profiles: list[Any] = []  # calibrated once: the latency bound is loose enough for the machine's drift

            async def profile() -> Any:
                if profiles:
                    return profiles[0]
                profiles.append(
                    await calibrate(
                        OpenAIBackend(two_replicas.url, MODEL, client=client),
                        calibration_prompt(tokenizer, history, 768),
                        model_path=model_path,
                        block_size=spec.block_size,
                        kv_tokens=cpu_kv_tokens(spec.kv_cache_gib, model_path),
                        where=two_replicas.url,
                        decode_tokens=24,
                        host_parallelism=spec.host_parallelism(len(os.sched_getaffinity(0)), replicas=2),
                    )
                )
                return profiles[0]

            return await validate(client, tokenizer, workload, profile, reset, policies=("pinned", "round_robin"))

    rows = asyncio.run(run())
    print(table(rows))
    for policy, (real, sim, profile) in rows.items():
        print(profile.summary())
        assert abs(ratio(sim.compaction_computed_tokens, real.compaction_computed_tokens) - 1) <= 0.05, policy
        assert 0.5 <= ratio(sim.compaction_latency_s, real.compaction_latency_s) <= 2.0, policy
    assert rows["pinned"][0].compaction_computed_tokens < rows["round_robin"][0].compaction_computed_tokens
