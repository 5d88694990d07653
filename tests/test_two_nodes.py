"""Two model replicas on two Ray worker nodes of this machine, each on its own half of the cores (tests/two_nodes.py,
in its own process, started as the session begins: it starts its own Ray cluster), as a service deployed on two
hosts runs:

- affinity: an agent's compaction is served from the cache its turns filled, and not without affinity;
- the simulator matches the live service per placement policy (the same runs);
- a lost node: a whole worker node, holding one replica, is killed mid-compaction with agent turns in flight. The
  compaction answers 200 (its chunks moved to the other replica) or 503 with Retry-After, every turn is answered,
  and the next compaction answers 200.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support import free_port

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.ray, pytest.mark.engine, pytest.mark.own_engine]


def start_ahead(work: Path) -> Callable[[], dict[str, Any]]:
    """The driver, started as the session begins (tests/conftest.py `Ahead`), beside the other programs with engines
    or clusters of their own: nothing here is a timing. Its figures, once it has run."""
    out = work / "figures.json"
    env = {k: v for k, v in os.environ.items() if k not in {"RAY_ADDRESS", "COMPACTION_API_KEY"}}
    env |= {"RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT), "TWO_NODES_PORT": str(free_port())}

    def run() -> dict[str, Any]:
        driver = subprocess.run(
            [sys.executable, str(ROOT / "tests" / "two_nodes.py"), "--out", str(out), "--work", str(work)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=1500,
            start_new_session=True,
        )
        assert driver.returncode == 0, driver.stderr[-4000:]
        result: dict[str, Any] = json.loads(out.read_text())
        return result

    return run


@pytest.fixture(scope="module")
def figures(model_path: Path, own_program: dict[str, Any]) -> dict[str, Any]:
    print(json.dumps(own_program, indent=2))  # the figures: placement, status codes, failovers, time to recover
    return own_program


def ran(figures: dict[str, Any], phase: str) -> dict[str, Any]:
    """A phase's figures; it failed if it raised, and skips if the shared data is missing."""
    got: dict[str, Any] = figures[phase]
    assert "error" not in got, got["error"]
    if "skipped" in got:
        pytest.skip(got["skipped"])
    return got


def test_the_two_replicas_ran_on_the_two_worker_nodes_each_on_its_own_cores(figures: dict[str, Any]) -> None:
    assert len(figures["replica_nodes"]) == 2
    cores = figures["engine_cores"]
    if len(os.sched_getaffinity(0)) > 1:  # each worker node a host of its own
        assert len(cores) == 2 and not set(cores[0]) & set(cores[1]), cores
    held = ran(figures, "node_loss")["killed_node_held"]
    assert "replica" in held and "engine" in held
    # coordinators_per_node: 1 spreads the two coordinators, so the lost node took at most one of them.
    assert held.count("coordinator") <= 1


def test_affinity_serves_the_history_from_the_agents_cache(figures: dict[str, Any]) -> None:
    """The simulator phase's real runs: the same agent session, its compaction pinned to the session's replica, then
    round robin (jobs.bench.affinity also measures a session without affinity anywhere)."""
    rows = ran(figures, "simulator")["policies"]
    on, off = rows["pinned"]["real"], rows["round_robin"]["real"]
    assert on["placement"] == "pinned" and set(on["chunk_replicas"]) == {0}
    assert on["history_cached_fraction"] >= 0.8
    assert off["placement"] == "round_robin" and set(off["chunk_replicas"]) == {0, 1}
    # The same turns, on the session's replica both times; without affinity the compaction's chunk prompts on the
    # other replica miss the cache the turns filled.
    assert off["history_cached_fraction"] < on["history_cached_fraction"]
    assert off["compaction_computed_tokens"] > on["compaction_computed_tokens"]


def test_the_simulator_matches_the_real_service_per_policy(figures: dict[str, Any]) -> None:
    """Computed prefill is deterministic (what each replica's cache held, chunk by chunk) and must match. Latency is
    one timing of a compaction of a second or two on a shared machine: it is printed here, and compared by the
    benchmark that repeats it (`python -m jobs.sim validate`); the latency model itself is tested in test_sim.py."""
    got = ran(figures, "simulator")
    print(got["table"], *got["profiles"], sep="\n")
    rows = got["policies"]
    assert set(rows) == {"pinned", "round_robin"}
    for policy, row in rows.items():
        real, sim = row["real"], row["sim"]
        assert abs(sim["compaction_computed_tokens"] / real["compaction_computed_tokens"] - 1) <= 0.05, policy
        assert sim["turn_computed_tokens"] == real["turn_computed_tokens"], policy


def test_the_compaction_in_flight_answers_200_or_503_with_retry_after(figures: dict[str, Any]) -> None:
    loss = ran(figures, "node_loss")
    assert loss["warm"]["status"] == 200
    assert loss["killed_mid_compaction"], loss["during"]
    during = loss["during"]
    # 200: its chunks on the lost replica were sent again (`failovers`), or the ingress retried it whole on the
    # other coordinator when its own was on the lost node.
    assert during["status"] == 200 or (during["status"] == 503 and during["retry_after"]), during


def test_the_agent_turns_in_flight_are_all_answered(figures: dict[str, Any]) -> None:
    assert ran(figures, "node_loss")["turns"] == [200] * 6


def test_the_next_compaction_answers_200_on_the_surviving_replica(figures: dict[str, Any]) -> None:
    loss = ran(figures, "node_loss")
    assert loss["probes"][-1] == 200 and loss["recovered_s"] is not None
    assert all(status in (200, 503) for status in loss["probes"]), loss["probes"]
    assert loss["after"]["status"] == 200, loss["after"]
