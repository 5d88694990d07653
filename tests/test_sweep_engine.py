"""Sweeps on the real CPU model: the whole CLI through a local Ray with the engine actor (the first sweep started
as the session begins, beside the other programs with engines of their own).

The service path (cells against an OpenAI-compatible server) runs in tests/test_chat_sweep.py and
tests/test_openai_backend.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from jobs.experiments.results import ResultStore, integrity
from jobs.report import write_report
from jobs.sweep import RAY_START_TIMEOUT, REPO_ROOT
from tests.support import SERVED_MODEL

MODEL = SERVED_MODEL
MC = {
    "name": "engine-mc",
    "models": [MODEL],
    "judges": [MODEL],
    "backend": {"kind": "engine", "max_model_len": 4096, "kv_cache_gib": 1},
    "experiments": [
        {
            "name": "mc",
            "kind": "agent",
            "datasets": ["locomo_mc"],
            "chunk_tokens": [128],
            "taus": [200],
            "summary_tokens": 16,
            "answer_tokens": 8,
        }
    ],
}


def sweep_cli(work: Path, *extra: str) -> Callable[[], None]:
    """`python jobs/sweep.py` on the MC config as a user runs it: its own local Ray, whatever this test process
    holds (the environment is read now)."""
    config = work / "mc.yaml"
    config.write_text(yaml.safe_dump(MC))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [sys.executable, "jobs/sweep.py", "--config", str(config), "--results", str(work / "results"), *extra]

    def run() -> None:
        deadline = time.monotonic() + 900
        while True:
            done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1200)
            # Its local Ray may miss Ray's fixed 30 s start-up wait beside the other programs starting as the session
            # begins (its processes end with it): as the error advises, it is run again, until their start-up is over
            # (a CI run missed the 30 s on three attempts in a row, six minutes).
            if done.returncode == 0 or RAY_START_TIMEOUT not in done.stderr or time.monotonic() > deadline:
                break
        if done.returncode != 0:  # started as the session begins, its output is no test's: it goes with the error
            raise RuntimeError(f"the sweep exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-6000:]}")

    return run


def start_ahead(work: Path) -> Callable[[], tuple[Path, float]]:
    """The first sweep, started as the session begins (tests/conftest.py `Ahead`): its folder and its seconds once it
    has run."""
    first = sweep_cli(work, "--num-cpus", "2")

    def run() -> tuple[Path, float]:
        began = time.perf_counter()
        first()
        return work, time.perf_counter() - began

    return run


@pytest.mark.ray
@pytest.mark.engine
@pytest.mark.own_engine
def test_cli_runs_cells_on_the_engine_actor_and_skips_them_next_time(
    model_path: Path, own_program: tuple[Path, float]
) -> None:
    work, seconds = own_program
    print(f"\nsweep of 1 MC cell on the real engine: {seconds:.0f} s (beside the other programs of their own)")
    results = work / "results"
    table = ResultStore(results).read()
    counts = integrity(table)
    assert counts["cells"] == 1 and counts["duplicate_rows"] == 0 and counts["agent_cells_with_turn_gaps"] == 0
    rows = table.to_pylist()
    episodes = [r for r in rows if r["event"] == "episode"]
    assert [r["questions"] for r in episodes] == [3] and all(r["backend"] == "engine actor (cpu)" for r in rows)
    assert max(r["compaction_count"] for r in episodes) >= 1 and all(r["cold_start"] for r in rows)
    answers = [r for r in rows if r["step"] == "question"]
    assert all(r["answer_output_tokens"] > 0 and r["mc_correct"] is not None for r in answers)
    sweep_cli(work)()  # nothing left to run: no Ray, no engine
    assert ResultStore(results).read().num_rows == table.num_rows
    assert (write_report(results, work / "report")).exists()
