"""Multi-node rehearsal on one machine: a CPU head plus two `ray start --address` worker nodes that declare the GPU
node types' resources of cluster/gcp-h100.yaml (GPUs logically, `accelerator_type:H100`, `single_h100` /
`nvlink_pair`). Stand-in replicas with the catalogue's own placement groups, and their chunk tasks, must land on
the node type the config asks for and never on the head. No GPU and no vLLM engine are needed.

CPU counts are scaled down to this machine; GPU and custom resources are the cluster YAML's, as declared.
Every node is started in its own process group and killed by group once the driver is done (never `ray stop`,
which would stop every Ray cluster on the machine). The rehearsal starts as the session begins, beside the other
programs with engines or clusters of their own (tests/conftest.py `Ahead`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from jobs.sweep import RAY_START_TIMEOUT
from tests.cluster_rehearsal import NODES_MISSING

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))
GCS_PORT = 18200
# Per node: (node-manager, object-manager, dashboard-agent http, dashboard-agent grpc, runtime-env agent, metrics,
# first worker port, last worker port). All inside 18200-18299.
NODE_PORTS = {
    "head": (18202, 18203, 18204, 18205, 18206, 18207, 18220, 18239),
    "gpu-h100x2-nvlink": (18240, 18241, 18242, 18243, 18244, 18245, 18250, 18269),
    "gpu-h100x1": (18270, 18271, 18272, 18273, 18274, 18275, 18280, 18299),
}
REHEARSAL_CPUS = {"head": 1, "gpu-h100x2-nvlink": 4, "gpu-h100x1": 3}
KIND_OF_NODE_TYPE = {"head": "head", "gpu-h100x2-nvlink": "nvlink_pair", "gpu-h100x1": "single_h100"}


def node_args(node_type: str, declared: dict[str, int]) -> list[str]:
    manager, objects, agent, agent_grpc, runtime_env, metrics, first, last = NODE_PORTS[node_type]
    custom = {k: v for k, v in declared.items() if k not in {"CPU", "GPU"}}
    return [
        f"--node-manager-port={manager}",
        f"--object-manager-port={objects}",
        f"--dashboard-agent-listen-port={agent}",
        f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--runtime-env-agent-port={runtime_env}",
        f"--metrics-export-port={metrics}",
        f"--min-worker-port={first}",
        f"--max-worker-port={last}",
        f"--num-cpus={REHEARSAL_CPUS[node_type]}",
        f"--num-gpus={declared.get('GPU', 0)}",
        f"--resources={json.dumps(custom)}",
        "--disable-usage-stats",
    ]


def kill_group(pgid: int) -> None:
    """SIGKILL the node's process group (a rehearsal keeps nothing) and wait until it is gone."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)


def leftover_pids(temp_dir: str) -> list[int]:
    """Processes whose command line names this rehearsal's temp dir (all of them are ours)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if temp_dir.encode() in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def start_ahead(work: Path) -> Callable[[], dict[str, Any]]:
    """The rehearsal, started as the session begins (tests/conftest.py `Ahead`): the three nodes started, the driver
    run on them, the nodes killed; the placements the driver wrote."""
    types = yaml.safe_load((ROOT / "cluster" / "gcp-h100.yaml").read_text())["available_node_types"]
    env = os.environ | {"RAY_AUTH_MODE": "disabled"}
    driver_env = env | {"PYTHONPATH": str(ROOT)}
    out = work / "placements.json"

    def start_node(node_type: str, temp_dir: str) -> int:
        """`ray start` for one node in a process group of its own (returned); its output appended to its log."""
        if node_type == "head":
            where = [f"--port={GCS_PORT}", "--head", "--include-dashboard=false", f"--temp-dir={temp_dir}"]
            where += ["--ray-client-server-port=18201", "--dashboard-port=18208"]
        else:
            where = [f"--address=127.0.0.1:{GCS_PORT}"]
        log = Path(temp_dir) / f"{node_type}.log"
        with log.open("a") as written:
            proc = subprocess.Popen(
                [RAY, "start", *where, *node_args(node_type, types[node_type]["resources"])],
                stdout=written,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        # A worker's `ray start` gives up after Ray's fixed 30 s when the GCS is slow to answer (a loaded machine)
        # and leaves its raylet starting: the driver waits for every node kind (`--kinds`).
        if proc.wait(timeout=180) != 0 and (node_type == "head" or RAY_START_TIMEOUT not in log.read_text()):
            raise RuntimeError(f"ray start for {node_type} failed: {log.read_text()}")
        return proc.pid

    def run() -> dict[str, Any]:
        temp_dir = tempfile.mkdtemp(prefix="rcl", dir="/tmp")
        groups: dict[str, int] = {}
        try:
            for node_type in NODE_PORTS:  # one at a time: at once overloads the GCS
                groups[node_type] = start_node(node_type, temp_dir)
            command = [
                sys.executable,
                str(ROOT / "tests" / "cluster_rehearsal.py"),
                "--address",
                f"127.0.0.1:{GCS_PORT}",
            ]
            command += ["--kinds", ",".join(KIND_OF_NODE_TYPE.values()), "--nodes-wait-s", "150", "--out", str(out)]
            for attempt in range(3):
                driver = subprocess.run(command, cwd=ROOT, env=driver_env, capture_output=True, text=True, timeout=600)
                if driver.returncode != NODES_MISSING:
                    break
                # A worker whose raylet never registered (or was given up for dead) on a loaded machine: once its
                # process group is gone, a new `ray start` brings a new node of its type.
                missing = json.loads(out.read_text())["missing"]
                restart = [node_type for node_type, kind in KIND_OF_NODE_TYPE.items() if kind in missing]
                if attempt == 2 or "head" in restart:
                    logs = {
                        node_type: (Path(temp_dir) / f"{node_type}.log").read_text()[-2000:] for node_type in restart
                    }
                    raise RuntimeError(f"rehearsal nodes {missing} not alive after three starts: {logs}")
                for node_type in restart:
                    kill_group(groups[node_type])
                    groups[node_type] = start_node(node_type, temp_dir)
            if driver.returncode != 0:
                raise RuntimeError(f"the rehearsal's driver failed: {driver.stderr[-4000:]}")
            result: dict[str, Any] = json.loads(out.read_text())
            return result
        finally:
            for pgid in reversed(groups.values()):
                kill_group(pgid)
            for pid in leftover_pids(temp_dir):
                os.kill(pid, signal.SIGKILL)
            shutil.rmtree(temp_dir, ignore_errors=True)

    return run


@pytest.fixture(scope="module")
def placements(own_program: dict[str, Any]) -> dict[str, Any]:
    return own_program


def test_the_rehearsal_cluster_has_the_three_node_types(placements: dict[str, Any]) -> None:
    assert sorted(placements["nodes"].values()) == sorted(KIND_OF_NODE_TYPE.values())


def test_replicas_and_chunk_tasks_land_on_the_node_type_each_model_asks_for(placements: dict[str, Any]) -> None:
    from serving.models import load_catalogue

    catalogue = load_catalogue()
    kinds = placements["nodes"]
    chunks = placements["chunks"]
    assert sorted(c["chunk"] for c in chunks) == list(range(len(chunks)))
    for chunk in chunks:
        spec = catalogue.get(chunk["model"])
        (wanted,) = spec.replica_resources  # the node-type resource of the model
        assert kinds[chunk["replica_node"]] == wanted, chunk
        assert len(chunk["ranks"]) == spec.tensor_parallel_size
        # Every tensor-parallel rank runs on the replica's own node (STRICT_PACK), each on its own GPU.
        assert {rank["node"] for rank in chunk["ranks"]} == {chunk["replica_node"]}, chunk
        gpus = [gpu for rank in chunk["ranks"] for gpu in rank["gpus"]]
        assert len(gpus) == len(set(gpus)) == spec.tensor_parallel_size, chunk
    assert {c["model"] for c in chunks} == {"llama-3.1-8b-instruct", "llama-3.3-70b-instruct"}
    assert not any(kinds[c["replica_node"]] == "head" for c in chunks)


def test_a_one_gpu_model_does_not_take_half_of_an_idle_nvlink_pair(placements: dict[str, Any]) -> None:
    # With the only single-H100 node busy, gpt-oss-20b's placement group waits for a new 1g node (the autoscaler's
    # job) although the pair node's two GPUs are free: the 70B deployed right after takes both of them.
    assert placements["second_single_gpu_model_pending"] is True
