"""Driver of the node-loss test (tests/test_node_loss.py), run in its own process: it starts its own Ray cluster.

Three Ray nodes on this machine (`ray.cluster_utils.Cluster`): a head without the model, and two worker nodes that
each declare one `model_node` slot. The CPU default model runs two replicas that ask for that slot, hence one per
node (a catalogue copy with `replica_resources`), so each worker node holds one replica.
Then, while a compaction whose chunks are spread over both replicas runs on the engines (the victim node's vLLM
gauge shows its requests running; every chunk summary is forced to a length that doubles until the compaction is
still running when the gauge shows it, so it is long by measurement on any CPU), the whole worker node of one replica
(its raylet, its replica and engine, whatever coordinator landed there) is killed without warning. Writes one JSON
object to --out: status codes, failovers, recovery time and what the killed node held. (A sweep resuming after its
driver stopped: tests/test_sweep.py.)
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
from tests.support import samples, scrape

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
SLOT = "model_node"
HISTORY_TURNS = 24
METRICS_INTERVAL_MS = 1000  # the gauge the kill waits on is fresh within a second


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
    os.environ["RAY_metrics_report_interval_ms"] = str(METRICS_INTERVAL_MS)  # noqa: SIM112 (Ray reads this name)
    head = {
        "num_cpus": 2,
        "include_dashboard": False,
        "_system_config": {"metrics_report_interval_ms": METRICS_INTERVAL_MS},
    }
    cluster = Cluster(initialize_head=True, head_node_args=head)
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


def running_on(node_id: str) -> float:
    """Requests the engine on that node is running (vLLM's gauge on the node's own metrics endpoint; 0 if gone)."""
    import ray

    ports = [n["MetricsExportPort"] for n in ray.nodes() if n["NodeID"] == node_id and n["Alive"]]
    try:
        return sum(samples(scrape(f"http://127.0.0.1:{ports[0]}/metrics"), "ray_vllm_num_requests_running"))
    except (IndexError, httpx.HTTPError):
        return 0.0


def wait_until(check: Any, limit_s: float = 120) -> bool:
    began = time.monotonic()
    while not check():
        if time.monotonic() - began > limit_s:
            return False
        time.sleep(0.1)
    return True


def kill_and_measure(cluster: Any, workers: list[Any], url: str) -> dict[str, Any]:
    outcome: dict[str, Any] = {}
    ingress_nodes = {p.node_id for p in service_processes() if p.role == "ingress"}
    victim = next((w for w in workers if w.node_id not in ingress_nodes), workers[0])
    with httpx.Client(base_url=url, timeout=400) as client:
        warm = post(client, compact_body(history(HISTORY_TURNS // 3, "warm"), "spread"))
        for tokens in (2**k for k in range(5, 11)):  # doubles until it is still running when the gauge shows it
            outcome.clear()
            wait_until(lambda: running_on(victim.node_id) == 0)
            body = compact_body(history(HISTORY_TURNS, f"a{tokens}"), "spread", tokens)
            big = threading.Thread(target=lambda body=body: outcome.update(post(client, body)))
            big.start()
            wait_until(lambda big=big: not big.is_alive() or running_on(victim.node_id) > 0)
            if big.is_alive():
                break
            big.join()
        killed_at = time.monotonic()
        held = kill_node(cluster, victim)
        probes = probe_until_200(client, killed_at)
        big.join()
        after = post(client, compact_body(history(HISTORY_TURNS // 3, "b"), "spread"))
    return {
        "warm": warm,
        "forced_tokens": tokens,
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
