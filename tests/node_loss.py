"""Driver of the node-loss test (tests/test_node_loss.py), run in its own process: it starts its own Ray cluster.

Three Ray nodes on this machine (`ray.cluster_utils.Cluster`): a head without the model, and two worker nodes that
each declare one `model_node` slot. The CPU default model runs two replicas that ask for that slot, hence one per
node (a catalogue copy with `replica_resources`), so each worker node holds one replica.
Then, while a compaction whose chunks are spread over both replicas runs (long by construction: every chunk summary
is forced to 400 tokens), the whole worker node of one replica (its raylet, its replica and engine, whatever
coordinator landed there) is killed without warning. Writes one JSON object to --out: status codes, failovers,
recovery time and what the killed node held. (A sweep resuming after its driver stopped: tests/test_sweep.py.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

from jobs.bench.processes import raylet_of, service_processes

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
SLOT = "model_node"
HISTORY_TURNS = 24


def history(turns: int, tag: str) -> list[dict[str, str]]:
    messages = []
    for i in range(turns):
        messages.append(
            {"role": "user", "content": f"[{tag}] Step {i}: open src/module_{i}.py and report what f_{i} returns."}
        )
        messages.append(
            {
                "role": "assistant",
                "content": f"f_{i} in src/module_{i}.py returns {i * 7} after checking key_{i}; "
                f"it is called from handler_{i % 5} and its test test_f_{i} passes.",
            }
        )
    return messages


def compact_body(messages: list[dict[str, str]], placement: str, forced: int = 0) -> dict[str, Any]:
    """A compaction; `forced`: every chunk summary decodes exactly that many tokens (long work by construction)."""
    body = {
        "model": MODEL,
        "messages": messages,
        "strategy": "parallel",
        "chunk_tokens": 256,
        "max_chunk_summary_tokens": forced or 24,
        "placement": placement,
        "timeout_s": 300,
    }
    return body | ({"fixed_output_tokens": True, "pinned_share": 0.0, "reuse_chunks": False} if forced else {})


def catalogue_copy(path: Path) -> None:
    """The packaged catalogue's CPU default entry, with two replicas that each take a node's one `model_node` slot
    (Serve refuses max_replicas_per_node beside placement-group bundles: the slot is what spreads them)."""
    from serving.models import load_catalogue

    spec = load_catalogue().get(MODEL)
    entry = spec.model_dump(mode="json", exclude_none=True)
    entry.update(
        replicas={"min": 2, "max": 2, "initial": 2},
        replica_resources={SLOT: 1},
        kv_cache_gib=1,
        cpu_binding="nobind",
    )
    path.write_text(yaml.safe_dump({"models": [entry]}))


def post(client: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    began = time.monotonic()
    try:
        response = client.post("/v1/compact", json=body)
    except httpx.HTTPError as exc:
        return {"status": None, "error": type(exc).__name__, "began": began, "ended": time.monotonic()}
    payload = response.json() if response.headers.get("content-type", "").startswith("application/json") else {}
    stats = payload.get("stats", {}) if response.status_code == 200 else {}
    return {
        "status": response.status_code,
        "retry_after": response.headers.get("Retry-After"),
        "failovers": stats.get("failovers"),
        "error": None if response.status_code == 200 else response.text[:300],
        "began": began,
        "ended": time.monotonic(),
    }


def held_by(node_id: str) -> list[str]:
    return sorted(p.role for p in service_processes() if p.node_id == node_id)


def kill_node(cluster: Any, node: Any) -> list[str]:
    """Remove the node without warning, then kill what its raylet's death left running: the machine is gone."""
    raylet = raylet_of(node.node_id)
    assert raylet is not None, f"no raylet for node {node.node_id}"
    doomed = [raylet, *raylet.children(recursive=True)]
    held = held_by(node.node_id)
    cluster.remove_node(node, allow_graceful=False)
    for proc in doomed:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    return held


def run(out: Path, work: Path) -> dict[str, Any]:
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from serving.local import LocalService, worker_env

    catalogue = work / "catalogue.yaml"
    catalogue_copy(catalogue)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    workers = [cluster.add_node(num_cpus=2, resources={SLOT: 1}) for _ in range(2)]
    ray.init(address=cluster.address, runtime_env={"env_vars": worker_env(True)}, log_to_driver=False)
    port = int(os.environ.get("NODE_LOSS_PORT", "18480"))
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    args = {"models": [MODEL], "catalogue": str(catalogue), "coordinator_replicas": 2, "coordinators_per_node": 1}
    service = LocalService(port, args)
    figures: dict[str, Any] = {}
    try:
        began = time.monotonic()
        service.start()
        figures["service_up_s"] = round(time.monotonic() - began, 1)
        figures["replica_nodes"] = sorted(
            {p.node_id for p in service_processes() if p.role == "replica"} & {w.node_id for w in workers}
        )
        figures.update(kill_and_measure(cluster, workers, service.url))
    finally:
        service.stop()
        ray.shutdown()
        cluster.shutdown()
    out.write_text(json.dumps(figures, indent=2))
    return figures


def probe_until_200(client: httpx.Client, since: float, limit_s: float = 120) -> list[dict[str, Any]]:
    """Small compactions one after another until one answers 200."""
    probes: list[dict[str, Any]] = []
    while time.monotonic() - since < limit_s:
        probes.append(post(client, compact_body(history(3, f"probe{len(probes)}"), "auto")))
        if probes[-1]["status"] == 200:
            break
        time.sleep(0.5)
    return probes


def kill_and_measure(cluster: Any, workers: list[Any], url: str) -> dict[str, Any]:
    outcome: dict[str, Any] = {}
    with httpx.Client(base_url=url, timeout=400) as client:
        warm = post(client, compact_body(history(HISTORY_TURNS, "warm"), "spread"))
        big = threading.Thread(
            target=lambda: outcome.update(post(client, compact_body(history(HISTORY_TURNS, "a"), "spread", 400)))
        )
        big.start()
        time.sleep(2.0)  # the compaction is planned and on the engines: 400 decode steps a chunk take far longer
        ingress_nodes = {p.node_id for p in service_processes() if p.role == "ingress"}
        victim = next((w for w in workers if w.node_id not in ingress_nodes), workers[0])
        killed_at = time.monotonic()
        held = kill_node(cluster, victim)
        probes = probe_until_200(client, killed_at)
        big.join()
        after = post(client, compact_body(history(HISTORY_TURNS, "b"), "spread"))
    return {
        "warm": warm,
        "killed_node_held": held,
        "killed_mid_compaction": outcome.get("ended", 0) > killed_at > outcome.get("began", 0),
        "during": outcome,
        "probes": [p["status"] for p in probes],
        "recovered_s": round(probes[-1]["ended"] - killed_at, 2) if probes and probes[-1]["status"] == 200 else None,
        "after": after,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    options = parser.parse_args()
    print(json.dumps(run(options.out, options.work), indent=2))
