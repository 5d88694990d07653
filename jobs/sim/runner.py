"""Run one simulated configuration and summarise it as one result row."""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

import simpy

from jobs.sim.cluster import Admission, Cluster
from jobs.sim.config import SimConfig, dataset_stream, synthetic_stream
from jobs.sim.profiles import EngineProfile, load_profile
from jobs.sim.workload import Recorder, Session


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def simulate(config: SimConfig, profile: EngineProfile | None = None) -> dict[str, Any]:
    """Run `config` to its duration; one row of figures (see `summarise`)."""
    began = time.perf_counter()
    profile = profile or load_profile(config.profile)
    rng = random.Random(config.seed)
    stream = tuple(synthetic_stream(rng)) if config.dataset == "synthetic" else dataset_stream(config.dataset)
    env = simpy.Environment()
    admission = Admission(config.max_running_compactions, config.max_queued_compactions)
    cluster = Cluster(
        env,
        profile,
        config.replicas,
        config.policy,
        admission=admission,
        yielding=config.yielding,
        beside_tokens=config.background_beside_tokens,
    )
    recorder = Recorder()
    for index in range(config.sessions):
        session = Session(index, config, cluster, stream, random.Random(rng.getrandbits(64)))
        env.process(session.run(recorder))
    env.run(until=config.duration_s)
    return summarise(config, profile, cluster, recorder, time.perf_counter() - began)


def summarise(
    config: SimConfig, profile: EngineProfile, cluster: Cluster, recorder: Recorder, wall_s: float
) -> dict[str, Any]:
    """Per-run figures: compaction latency and throughput, agent stall, cache hits, replica utilisation."""
    turns = [t for t in cluster.turns if t.finished == t.finished]  # finished (not NaN)
    done = [o for o in cluster.outcomes if o.admitted and o.kind == "compaction"]
    prompt = sum(t.prompt_tokens for t in turns) + sum(o.prompt_tokens for o in done)
    cached = sum(t.cached_tokens for t in turns) + sum(o.cached_tokens for o in done)
    chunk_prompt = sum(o.prompt_tokens for o in done)
    latencies = [o.latency_s for o in done]
    stalls = recorder.stalls
    duration = config.duration_s
    replicas = cluster.replicas
    kinds = [o.placement for o in done]
    return {
        **config.model_dump(),
        "model": profile.model,
        "hardware": profile.hardware,
        "turns": len(turns),
        "turn_latency_mean_s": mean([t.finished - t.submitted for t in turns]),
        "turn_latency_p50_s": percentile([t.finished - t.submitted for t in turns], 0.5),
        "turn_latency_p95_s": percentile([t.finished - t.submitted for t in turns], 0.95),
        "compactions": len(recorder.stalls),  # applied (a rolling one may have sent nothing of its own)
        "refused": recorder.refused,
        "background_used": recorder.background_used,
        "rolled_chunks": recorder.rolled_chunks,
        "rolled_taken": recorder.rolled_taken,
        "compaction_latency_mean_s": mean(latencies),
        "compaction_latency_p50_s": percentile(latencies, 0.5),
        "compaction_latency_p95_s": percentile(latencies, 0.95),
        "queue_wait_mean_s": mean([o.queued_s for o in done]),
        "stall_total_s": sum(stalls),
        "stall_mean_s": mean(stalls),
        "stall_p95_s": percentile(stalls, 0.95),
        "compaction_share": sum(stalls) / recorder.session_s if recorder.session_s else 0.0,
        "e2e_per_turn_s": recorder.session_s / len(turns) if turns else 0.0,
        "compaction_throughput_tok_s": sum(o.input_tokens for o in done) / duration,
        "prompt_tokens": prompt,
        "computed_prefill_tokens": prompt - cached,
        "cache_hit_share": cached / prompt if prompt else 0.0,
        "compaction_cache_hit_share": sum(o.cached_tokens for o in done) / chunk_prompt if chunk_prompt else 0.0,
        "replica_utilisation": sum(r.stats.busy_s for r in replicas) / (len(replicas) * duration),
        "mean_batch": sum(r.stats.batch_s for r in replicas) / (len(replicas) * duration),
        "spread_share": kinds.count("spread") / len(kinds) if kinds else 0.0,
        "evicted_tokens": sum(r.cache.evicted for r in replicas),
        "sim_wall_s": wall_s,
    }
