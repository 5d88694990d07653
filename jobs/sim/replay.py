"""The simulator against `jobs.bench.agent`: every mode of one benchmark run replayed turn by turn.

    python -m jobs.sim replay results/bench-agent/bench_agent.json [--profile cpu-smollm2]

A benchmark run records, per mode, every turn: the prompt the client sent and the one the model answered, the
tokens it decoded, the tool time after it, and each compaction's stats. The replay plays the same turns through one
simulated session (`jobs.sim.workload.Script`: what each turn added to the history, the same tool gaps, the same
answer lengths) under the mode's context_management entry, on an engine profile (calibrated on the machine the
benchmark ran on: `python -m jobs.sim calibrate`). It compares what the service's turn policy decided and what that
cost: compactions, the mean prompt a turn was answered from, and the agent's wait for compaction. A compaction's
size is the run's own (the mean summary tokens it decoded and kept), and so is the share of its chunks whose
first summary failed the checks and was asked again (`SimConfig.retry_share`, drawn per chunk prompt): the
simulator decides when and what to compact and how long it takes, not what the model writes.
"""

from __future__ import annotations

import json
import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import simpy

from compaction.turn_policy import keep_recent_default
from jobs.sim.cluster import Cluster
from jobs.sim.config import SimConfig
from jobs.sim.profiles import EngineProfile
from jobs.sim.workload import END_OF_TURN_TOKENS, GENERATION_PROMPT_TOKENS, Recorder, Script, Session

MODES = ("blocking_sequential", "blocking_parallel", "background_parallel", "rolling_parallel")
# The validation's bounds (issue: compactions equal, mean prompt within 10 %, the wait within 25 %).
MEAN_PROMPT_WITHIN = 0.10
STALL_WITHIN = 0.25


@dataclass(frozen=True)
class Figures:
    """One mode's run, real or simulated."""

    compactions: int
    compacted_at: tuple[int, ...]  # turn indexes
    mean_prompt_tokens: float
    stall_s: float
    e2e_s: float


def script(turns: Sequence[Mapping[str, Any]], system_tokens: int) -> Script:
    """What each recorded turn added to the history: the prompt it sent less the history before it (the prompt the
    previous turn was answered from, its answer and the end of that turn)."""
    observations, before = [], system_tokens + GENERATION_PROMPT_TOKENS
    for turn in turns:
        observations.append(max(1, turn["sent_tokens"] - before))
        before = turn["answered_tokens"] + turn["output_tokens"] + END_OF_TURN_TOKENS + GENERATION_PROMPT_TOKENS
    gaps = (0.0, *(t["tool_s"] for t in turns[:-1]))
    return Script(tuple(observations), gaps, tuple(max(1, t["output_tokens"]) for t in turns))


def config(mode: str, record: Mapping[str, Any], profile: str) -> SimConfig:
    """The simulated session of one mode: the run's thresholds and budgets, its compactions' mean sizes."""
    settings = record["settings"]
    tau, soft = settings["compact_threshold"], settings["background_threshold"]
    background = mode in ("background_parallel", "rolling_parallel")
    apply_background = "rolling" if mode == "rolling_parallel" else "ready"
    stats = [t["compaction"] for t in record["turns"][mode] if t["compaction"]]
    asked = [s["output_tokens"] / max(1, s["chunks"] - s.get("reused_chunks", 0) + s.get("retries", 0)) for s in stats]
    decoded = [per_attempt * s["chunks"] for per_attempt, s in zip(asked, stats, strict=True)]
    chunks = [c for s in stats for c in s.get("per_chunk", ())]  # a record trimmed to the totals: none asked again
    again = sum(c["retries"] > 0 or (c["reused"] and _asked_again(c)) for c in chunks)
    return SimConfig(
        profile=profile, replicas=1, sessions=1, duration_s=7 * 86_400, warm_start=False, ramp_s=0,
        mode="background" if background else "blocking", tau=tau, background_share=soft / tau,
        apply_background=apply_background,
        strategy="sequential" if mode == "blocking_sequential" else "parallel", chunk_tokens=settings["chunk_tokens"],
        summary_tokens=max(16, round(statistics.fmean(decoded))) if decoded else settings["summary_tokens"],
        summary_text_tokens=round(statistics.fmean(s["summary_tokens"] for s in stats)) if stats else None,
        keep_recent_tokens=record.get("keep_recent_tokens", {}).get(
            mode, keep_recent_default(tau, soft if background else None, apply_background)
        ),
        system_tokens=record["system_tokens"], policy="pinned", retry_share=again / len(chunks) if chunks else 0.0,
    )  # fmt: skip


def _asked_again(chunk: Mapping[str, Any]) -> bool:
    """A chunk taken from the chunk cache (its work not counted) was asked twice if what it kept says so: a retry's
    status, or a fallback whose first summary was not an echo (one the agent waited for keeps its extractive text
    at once, `compaction.checks.settle`)."""
    return chunk["status"] != "ok" and (chunk["status"] != "extractive_fallback" or chunk["first_verdict"] != "echo")


def simulate(mode: str, record: Mapping[str, Any], profile: EngineProfile) -> Figures:
    """One mode of the run, replayed in the simulator."""
    turns = record["turns"][mode]
    cfg = config(mode, record, profile.name)
    env = simpy.Environment()
    cluster = Cluster(env, profile, 1, cfg.policy, homes={"session-0": 0})
    recorder = Recorder()
    session = Session(0, cfg, cluster, (1,), random.Random(0), script(turns, record["system_tokens"]))
    env.run(until=env.process(session.run(recorder)))
    prompts = [t.prompt_tokens for t in cluster.turns]
    return Figures(
        len(recorder.stalls),
        tuple(recorder.compacted_at),
        statistics.fmean(prompts),
        sum(recorder.stalls),
        recorder.ended_s[0],
    )


def measured(mode: str, record: Mapping[str, Any]) -> Figures:
    """One mode of the run as the benchmark measured it."""
    totals, turns = record["totals"][mode], record["turns"][mode]
    at = tuple(t["index"] for t in turns if t["status"] == "applied")
    return Figures(totals["compactions"], at, totals["mean_prompt_tokens"], totals["stall_s"], totals["e2e_s"])


def compare(record: Mapping[str, Any], profile: EngineProfile) -> list[dict[str, Any]]:
    """Per mode of the run: the real and simulated figures, their ratios and whether the simulator is within the
    validation's bounds."""
    rows = []
    for mode in (m for m in MODES if m in record["turns"]):
        real, sim = measured(mode, record), simulate(mode, record, profile)
        prompt = sim.mean_prompt_tokens / real.mean_prompt_tokens
        stall = sim.stall_s / real.stall_s if real.stall_s else float("inf") if sim.stall_s else 1.0
        rows.append({
            "mode": mode, "compactions": f"{real.compactions} / {sim.compactions}",
            "compacted at (turns)": f"{_turns(real.compacted_at)} / {_turns(sim.compacted_at)}",
            "mean prompt": f"{real.mean_prompt_tokens:,.0f} / {sim.mean_prompt_tokens:,.0f} ({prompt:.3f}x)",
            "wait s": f"{real.stall_s:.2f} / {sim.stall_s:.2f} ({stall:.2f}x)",
            "e2e s": f"{real.e2e_s:.1f} / {sim.e2e_s:.1f} ({sim.e2e_s / real.e2e_s:.2f}x)",
            "asked again": f"{config(mode, record, profile.name).retry_share:.0%}",
            "within": real.compactions == sim.compactions and abs(prompt - 1) <= MEAN_PROMPT_WITHIN
            and abs(stall - 1) <= STALL_WITHIN,
        })  # fmt: skip
    return rows


def _turns(at: Sequence[int]) -> str:
    return ",".join(map(str, at)) or "-"


def load(path: Path) -> dict[str, Any]:
    """A `jobs.bench.agent` record; ValueError naming what it lacks."""
    record: dict[str, Any] = json.loads(path.read_text())
    if not isinstance(record, dict) or not {"settings", "totals", "turns"} <= set(record):
        raise ValueError(f"{path} is not a bench_agent.json written by python -m jobs.bench.agent")
    if "system_tokens" not in record:
        raise ValueError(f"{path} has no system_tokens: record it again with this version of jobs.bench.agent")
    return record
