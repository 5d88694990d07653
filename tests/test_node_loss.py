"""A lost node survived: a whole Ray worker node, holding one of the CPU default model's two replicas, is killed
mid-compaction on a three-node cluster on this machine (tests/node_loss.py, in its own process: it starts its own
Ray cluster). The compaction in flight answers 200 (its chunks moved to the other replica) or 503 with Retry-After,
and the next one answers 200."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support import free_port

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.ray, pytest.mark.engine, pytest.mark.own_engine]


@pytest.fixture(scope="module")
def figures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("node-loss")
    out = work / "figures.json"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env |= {"RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT), "NODE_LOSS_PORT": str(free_port())}
    driver = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "node_loss.py"), "--out", str(out), "--work", str(work)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        start_new_session=True,
    )
    assert driver.returncode == 0, driver.stderr[-4000:]
    result: dict[str, Any] = json.loads(out.read_text())
    print(json.dumps(result, indent=2))  # the figures: status codes, failovers, time to recover
    return result


def test_the_two_replicas_ran_on_the_two_worker_nodes(figures: dict[str, Any]) -> None:
    assert len(figures["replica_nodes"]) == 2
    assert "replica" in figures["killed_node_held"] and "engine" in figures["killed_node_held"]
    # coordinators_per_node: 1 spreads the two coordinators, so the lost node took at most one of them.
    assert figures["killed_node_held"].count("coordinator") <= 1


def test_the_compaction_in_flight_answers_200_or_503_with_retry_after(figures: dict[str, Any]) -> None:
    assert figures["warm"]["status"] == 200
    assert figures["killed_mid_compaction"], figures["during"]
    during = figures["during"]
    assert during["status"] == 200 or (during["status"] == 503 and during["retry_after"]), during


def test_the_next_compaction_answers_200_on_the_surviving_replica(figures: dict[str, Any]) -> None:
    assert figures["probes"][-1] == 200 and figures["recovered_s"] is not None
    assert all(status in (200, 503) for status in figures["probes"]), figures["probes"]
    assert figures["after"]["status"] == 200, figures["after"]
