"""The simulator's CPU engine rule and rolling sessions: background decode held while an agent is on the replica and
raised where it is when a turn needs it, rolling sessions compacting as blocking ones do from chunks rolled in the
tool gaps, and each mode of a recorded `jobs.bench.agent` run replayed."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import simpy

from compaction.pacing import BACKGROUND, CPU_RULE, YieldRule
from jobs.sim.config import SimConfig
from jobs.sim.engine import Replica, Request
from jobs.sim.profiles import load_profile
from jobs.sim.replay import MEAN_PROMPT_WITHIN, MODES, config, measured, simulate
from jobs.sim.workload import Recorder, Script, Session
from tests.test_sim import toy_profile

RECORD = Path(__file__).parent / "data" / "bench-agent-seed0.json"


def replica(rule: YieldRule) -> tuple[simpy.Environment, Replica]:
    env = simpy.Environment()
    return env, Replica(env, 0, toy_profile(), rule=rule)


def request(env: simpy.Environment, output: int, namespace: str, priority: int = 0) -> Request:
    return Request(8, output, namespace, 8, False, "chunk", env.event(), priority)


@pytest.mark.parametrize("rule", [CPU_RULE, YieldRule()], ids=["cpu", "gpu"])
def test_background_decode_waits_for_the_agent_on_the_cpu_and_goes_on_beside_it_on_gpus(rule: YieldRule) -> None:
    env, engine = replica(rule)
    background, agent = request(env, 100, "b", BACKGROUND), request(env, 50, "a")
    engine.submit(background)
    env.run(until=0.2)
    engine.submit(agent)
    env.run()
    decoded = (0.2 - 0.008) / 0.011  # toy: 8 ms of prefill, then 11 ms steps alone
    alone = 0.2 + 0.008 + 50 * 0.011  # the agent's prefill and 50 steps by itself
    held = alone + (100 - decoded) * 0.011  # the background's last tokens after it
    if rule.decode_beside:  # one batch of two (12 ms steps): the background decodes 50 tokens beside the agent
        assert agent.finished > alone
        assert background.finished == pytest.approx(held - 50 * 0.011 + 50 * 0.001, rel=0.01)
    else:  # paused for the agent's prefill and its 50 steps, then its own last tokens alone
        assert agent.finished == pytest.approx(alone, rel=0.01)
        assert background.finished == pytest.approx(held, rel=0.01)


def test_a_held_background_decode_raised_to_the_agents_priority_goes_on_from_where_it_was() -> None:
    env, engine = replica(CPU_RULE)
    background, agent = request(env, 100, "b", BACKGROUND), request(env, 200, "a")
    engine.submit(background)
    env.run(until=0.2)
    engine.submit(agent)  # the background's decode pauses for it
    env.run(until=0.5)
    engine.escalate(background)  # raised where it is: it decodes beside the agent from the tokens it had
    env.run()
    decoded = (0.2 - 0.008) / 0.011
    assert background.finished == pytest.approx(0.5 + (100 - decoded) * 0.012, rel=0.02)
    assert background.finished < agent.finished


def test_a_cancelled_background_request_frees_the_engine_for_the_next_and_ends_at_once() -> None:
    """A rolling run's last chunk a later turn's run supersedes is cancelled where it is (`serving.background`):
    it ends then, its memory goes back, and the request queued behind it runs as if it had never been sent."""
    env, engine = replica(CPU_RULE)
    superseded, needed = request(env, 100, "b", BACKGROUND), request(env, 100, "c", BACKGROUND)
    engine.submit(superseded)
    engine.submit(needed)  # one decode batch of two (12 ms steps)
    env.run(until=0.2)
    engine.cancel(superseded)
    assert superseded.done.triggered and superseded.finished == pytest.approx(0.2)
    env.run()
    decoded = (0.2 - 2 * 0.008) / 0.012  # toy: two 8 ms prefills, then 12 ms steps for two
    assert needed.finished == pytest.approx(0.2 + (100 - decoded) * 0.011, rel=0.01)  # then 11 ms steps alone
    assert engine.cache.allocated == 0 and not engine.busy


def play(config: SimConfig, turns: int = 30) -> tuple[Recorder, list[int]]:
    env = simpy.Environment()
    from jobs.sim.cluster import Cluster

    cluster = Cluster(env, toy_profile(kv_tokens=100_000), 1, "pinned", homes={"session-0": 0})
    script = Script((300,) * turns, (0.0, *(5.0,) * (turns - 1)), (20,) * turns)
    recorder = Recorder()
    env.run(until=env.process(Session(0, config, cluster, (1,), random.Random(0), script).run(recorder)))
    return recorder, [t.prompt_tokens for t in cluster.turns]


def test_a_rolling_session_compacts_as_blocking_does_from_chunks_rolled_in_its_tool_gaps() -> None:
    base = SimConfig(
        profile="toy", sessions=1, replicas=1, tau=4096, chunk_tokens=256, summary_tokens=96, keep_recent_tokens=512,
        system_tokens=64, warm_start=False, ramp_s=0, background_share=0.6,
    )  # fmt: skip
    blocking, blocking_prompts = play(base)
    rolling, rolling_prompts = play(base.model_copy(update={"mode": "background", "apply_background": "rolling"}))
    assert len(blocking.compacted_at) >= 2
    assert rolling.compacted_at == blocking.compacted_at  # the same compactions, at the same turns
    assert rolling_prompts == pytest.approx(blocking_prompts, rel=0.02)  # the same prompts, give or take a reply
    assert rolling.rolled_taken > 0 and rolling.rolled_chunks >= rolling.rolled_taken
    assert sum(rolling.stalls) < 0.5 * sum(blocking.stalls)  # the rolled chunks were done in the 5 s gaps


def test_chunk_prompts_asked_again_decode_twice_and_a_blocking_compaction_waits_for_both_attempts() -> None:
    base = SimConfig(
        profile="toy", sessions=1, replicas=1, tau=4096, chunk_tokens=256, summary_tokens=96, keep_recent_tokens=512,
        system_tokens=64, warm_start=False, ramp_s=0,
    )  # fmt: skip
    first, _ = play(base)
    again, prompts = play(base.model_copy(update={"retry_share": 1.0}))
    assert again.compacted_at == first.compacted_at and len(first.compacted_at) >= 2
    assert prompts == play(base)[1]  # the same prompts: a retry changes what a compaction costs, not its size
    per_chunk = 16  # the floor of summary_tokens split over a compaction's ~14 chunks
    for waited, once in zip(again.stalls, first.stalls, strict=True):  # every chunk decoded twice, one after the other
        assert waited - once >= per_chunk * 0.011  # at least that many more decode steps (toy: 11 ms alone)


@pytest.mark.parametrize("mode", MODES)
def test_the_replay_of_a_recorded_agent_loop_compacts_as_often_and_answers_from_prompts_as_long(mode: str) -> None:
    """The simulator's sessions follow the service's turn policy: a recorded `jobs.bench.agent` run (LoCoMo, Codex
    tool time, seed 0) replayed turn by turn makes as many compactions per mode, and its turns are answered from
    prompts within 10 % as long on the mean. The wait is the benchmark's to compare (`python -m jobs.sim replay`):
    it needs the profile of the machine that recorded the run."""
    record = json.loads(RECORD.read_text())
    real, sim = measured(mode, record), simulate(mode, record, load_profile("cpu-smollm2"))
    assert sim.compactions == real.compactions
    assert sim.mean_prompt_tokens == pytest.approx(real.mean_prompt_tokens, rel=MEAN_PROMPT_WITHIN)


def test_a_replay_asks_again_the_share_of_chunks_the_run_did_and_waits_longer_for_it() -> None:
    record = json.loads(RECORD.read_text())
    profile = load_profile("cpu-smollm2")
    before = simulate("blocking_parallel", record, profile)
    for turn in record["turns"]["blocking_parallel"]:
        if stats := turn["compaction"]:  # per compaction: one chunk retried, one rolled chunk that was (its status
            # says so), one rolled echo the agent waited for (its extractive text at once), one asked once
            stats["per_chunk"] = [
                {"retries": 1, "status": "retried", "reused": False, "first_verdict": "empty"},
                {"retries": 0, "status": "retried", "reused": True, "first_verdict": "ok"},
                {"retries": 0, "status": "extractive_fallback", "reused": True, "first_verdict": "echo"},
                {"retries": 0, "status": "ok", "reused": False, "first_verdict": "ok"},
            ]
            stats["chunks"], stats["reused_chunks"], stats["retries"] = 4, 2, 1
    assert config("blocking_parallel", record, profile.name).retry_share == 0.5
    after = simulate("blocking_parallel", record, profile)
    assert after.compactions == before.compactions and after.stall_s > before.stall_s


def test_a_replay_keeps_the_window_of_recent_turns_the_recorded_run_had() -> None:
    record = json.loads(RECORD.read_text())
    assert config("rolling_parallel", record, "cpu-smollm2").keep_recent_tokens == 640  # the service's default then
    del record["keep_recent_tokens"]  # a record without them: the service's defaults now
    assert config("rolling_parallel", record, "cpu-smollm2").keep_recent_tokens == 1024
    assert config("background_parallel", record, "cpu-smollm2").keep_recent_tokens == 640


def test_a_replay_of_a_file_that_is_not_a_benchmark_record_says_what_it_lacks(tmp_path: Path) -> None:
    from jobs.sim.__main__ import main

    other, old = tmp_path / "other.json", tmp_path / "old.json"
    other.write_text(json.dumps({"rows": []}))
    record = json.loads(RECORD.read_text())
    del record["system_tokens"]
    old.write_text(json.dumps(record))
    assert main(["replay", str(other)]) == 2 and main(["replay", str(old)]) == 2
    assert main(["replay", str(tmp_path / "missing.json")]) == 2
