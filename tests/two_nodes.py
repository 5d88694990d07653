"""Driver of the two-node tests (tests/test_two_nodes.py), run in its own process: it starts its own Ray cluster.

Three Ray nodes on this machine (`ray.cluster_utils.Cluster`): a head without the model, and two worker nodes, each
started on its own half of the machine's cores (as two hosts would be) and declaring one `model_node` slot. The CPU
default model runs two replicas that ask for that slot, hence one per node (a catalogue copy with
`replica_resources`), each computing on its node's cores. On that service, in order:

1. affinity and the simulator: jobs.sim.validate for the two placement policies that bound the others (an agent
   session whose compaction runs pinned to the session's replica, then round robin, the prefix caches emptied before
   each), calibrated on the live service (jobs.bench.affinity also measures the session without affinity anywhere);
2. node loss: while a compaction whose chunks are spread over both replicas runs on the engines (the victim node's
   vLLM gauge shows its requests running; every chunk summary is forced to a length that doubles until the
   compaction is still running when the gauge shows it, so it is long by measurement on any CPU) and six agent
   sessions' turns are in flight, the whole worker node of one replica (its raylet, its replica and engine, whatever
   coordinator landed there) is killed without warning.

Writes one JSON object to --out: each phase's figures, or the error that stopped it (the later phases still run).
(A sweep resuming after its driver stopped: tests/test_sweep.py.)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

from jobs.bench.processes import raylet_of, service_processes
from tests.support import kill_workers, samples, scrape

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
SLOT = "model_node"
HISTORY_TURNS = 24
DECODE = 8  # tokens per reply and chunk summary where the length is not what a phase measures
METRICS_INTERVAL_MS = 1000  # the gauge the kill waits on is fresh within a second
KV_CACHE_GIB = 1
# The GCS declares a node dead after this many failed health checks a period apart (Ray's defaults, 5 of 3 s, make
# the node loss take about 20 s longer: a lost node's actors are failed only then). A killed raylet refuses the
# check at once; a live one must miss three 2-s answers in a row to be taken for dead.
HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_timeout_ms": 2000, "health_check_failure_threshold": 3}


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
        "max_chunk_summary_tokens": forced or DECODE,
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
        kv_cache_gib=KV_CACHE_GIB,
        cpu_binding="cores",  # the cores of its node: the half of the machine its raylet was started on
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
    if raylet is None:  # gone before the kill: say what the GCS thinks of it (a node declared dead ends its raylet)
        import ray

        known = [(n["Alive"], n.get("DeathReasonMessage")) for n in ray.nodes() if n["NodeID"] == node.node_id]
        raise AssertionError(f"no raylet for node {node.node_id}; the GCS has it as (alive, death reason) {known}")
    doomed = [raylet, *raylet.children(recursive=True)]
    held = held_by(node.node_id)
    cluster.remove_node(node, allow_graceful=False)
    for proc in doomed:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    return held


def start_cluster() -> tuple[Any, list[Any]]:
    """The head on every core; each worker node on its own half of them (its processes inherit the affinity)."""
    from ray.cluster_utils import Cluster

    head = {
        "num_cpus": 2,
        "include_dashboard": False,
        "_system_config": {"metrics_report_interval_ms": METRICS_INTERVAL_MS, **HEALTH_CHECKS},
    }
    cluster = Cluster(initialize_head=True, head_node_args=head)
    cores = sorted(os.sched_getaffinity(0))
    half = max(1, len(cores) // 2)
    workers = []
    try:
        for host in (cores[:half], cores[half:] or cores):
            os.sched_setaffinity(0, host)
            workers.append(cluster.add_node(num_cpus=2, resources={SLOT: 1}))
    finally:
        os.sched_setaffinity(0, cores)
    return cluster, workers


def phase(name: str, work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """One phase's figures, or the error that stopped it."""
    began = time.monotonic()
    try:
        figures = work()
    except Exception:
        figures = {"error": traceback.format_exc()[-3000:]}
    print(f"[two-nodes] {name}: {time.monotonic() - began:.0f} s", flush=True)
    return figures


def run(out: Path, work: Path) -> dict[str, Any]:
    import ray
    from ray import serve

    from serving.local import LocalService, worker_env

    catalogue = work / "catalogue.yaml"
    catalogue_copy(catalogue)
    os.environ["RAY_metrics_report_interval_ms"] = str(METRICS_INTERVAL_MS)  # noqa: SIM112 (Ray reads this name)
    cluster, workers = start_cluster()
    ray.init(address=cluster.address, runtime_env={"env_vars": worker_env(True)}, log_to_driver=False)
    port = int(os.environ.get("TWO_NODES_PORT", "18480"))
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    args = {"models": [MODEL], "catalogue": str(catalogue), "coordinator_replicas": 2, "coordinators_per_node": 1}
    service = LocalService(port, args)
    figures: dict[str, Any] = {}
    try:
        began = time.monotonic()
        service.start()
        figures["service_up_s"] = round(time.monotonic() - began, 1)
        # This cluster's worker nodes only: other engines may run on the machine (another program's, `make serve`).
        on_workers = [p for p in service_processes() if p.node_id in {w.node_id for w in workers}]
        engines = [p for p in on_workers if p.role == "engine"]
        figures["replica_nodes"] = sorted({p.node_id for p in on_workers if p.role == "replica"})
        figures["engine_cores"] = sorted({tuple(psutil.Process(p.pid).cpu_affinity()) for p in engines})
        conversations = locomo()
        figures["simulator"] = phase("simulator", lambda: simulator(service.url, conversations))
        figures["node_loss"] = phase("node loss", lambda: kill_and_measure(cluster, workers, service.url))
    finally:
        out.write_text(json.dumps(figures, indent=2))
        tear_down(cluster)
    return figures


def tear_down(cluster: Any) -> None:
    """The nodes' workers killed, then the nodes removed (Serve's graceful shutdown waits on the lost node)."""
    import ray

    nodes = [node.node_id for node in cluster.list_all_nodes()]
    ray.shutdown()
    kill_workers(nodes)
    cluster.shutdown()


def locomo() -> list[dict[str, Any]] | str:
    """The shared LoCoMo conversations, or why they are missing."""
    from jobs.data.conversations import LOCOMO_PATH

    if not LOCOMO_PATH.exists():
        return f"shared LoCoMo data not found at {LOCOMO_PATH} (set COMPACTION_DATA to its folder)"
    return list(json.loads(LOCOMO_PATH.read_text()))


async def reset_caches() -> None:
    from ray import serve

    from serving.local import APP_NAME

    await serve.get_deployment_handle("Coordinator", app_name=APP_NAME).reset_prefix_cache.remote(MODEL)


def simulator(url: str, conversations: list[dict[str, Any]] | str) -> dict[str, Any]:
    """jobs.sim.validate for pinned and round_robin; the CPU profile calibrated once, from the live service (the
    latencies are printed, not bounded: one timing each on a shared machine)."""
    from compaction.history import parse_messages
    from compaction.render import render_history
    from compaction.tokenizer import HFChatTokenizer
    from jobs.bench.affinity import make_session
    from jobs.data.conversations import locomo_messages
    from jobs.sim.calibrate import calibrate, calibration_prompt, cpu_kv_tokens
    from jobs.sim.validate import Workload, table, validate
    from serving.backends import OpenAIBackend
    from serving.models import load_catalogue
    from serving.tenants import client_headers
    from serving.weights import model_dir

    if isinstance(conversations, str):
        return {"skipped": conversations}
    chat = HFChatTokenizer.from_path(model_dir())
    conversation = locomo_messages(conversations[0])
    session = make_session(conversation, chat, 800, turns=2, turn_tokens=120)
    history = render_history(parse_messages(conversation), chat).token_ids
    spec = load_catalogue().get(MODEL)

    async def run() -> Any:
        async with httpx.AsyncClient(base_url=url, headers=client_headers(), timeout=900) as client:
            profiles: list[Any] = []

            async def profile() -> Any:
                if not profiles:
                    profiles.append(
                        await calibrate(
                            OpenAIBackend(url, MODEL, client=client),
                            calibration_prompt(chat, history, 768),
                            model_path=model_dir(),
                            block_size=spec.block_size,
                            kv_tokens=cpu_kv_tokens(KV_CACHE_GIB, model_dir()),
                            where=url,
                            decode_tokens=DECODE,
                            host_parallelism=spec.host_parallelism(len(os.sched_getaffinity(0)), replicas=2),
                        )
                    )
                return profiles[0]

            options = Workload([], []).options.model_copy(update={"max_chunk_summary_tokens": DECODE})
            workload = Workload(session.base, session.observations, answer_tokens=DECODE // 2, options=options)
            return await validate(client, chat, workload, profile, reset_caches, policies=("pinned", "round_robin"))

    rows = asyncio.run(run())
    return {
        "table": table(rows),
        "profiles": [profile.summary() for _, _, profile in rows.values()][:1],
        "policies": {
            p: {"real": dataclasses.asdict(real), "sim": dataclasses.asdict(sim)} for p, (real, sim, _) in rows.items()
        },
    }


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


def turn(client: httpx.Client, i: int) -> int | None:
    """One agent session's turn (sessions hash over both replicas): its status code."""
    asked = [*history(3, f"turn{i}"), {"role": "user", "content": f"Session {i}: what was said last?"}]
    body = {"model": MODEL, "messages": asked, "max_tokens": DECODE}
    try:
        return client.post("/v1/chat/completions", json=body, headers={"x-session-id": f"kill-turn-{i}"}).status_code
    except httpx.HTTPError:
        return None


def kill_and_measure(cluster: Any, workers: list[Any], url: str) -> dict[str, Any]:
    outcome: dict[str, Any] = {}

    # The victim holds a replica and a coordinator, never the ingress: Serve's proxy would answer 500 for the dead
    # ingress until Serve replaces it (CI43). A scan can miss a process (its title or parents unreadable for a
    # moment), so the ingress is looked for until it is found on a node.
    ingress: set[str | None] = set()

    def ingress_found() -> bool:
        ingress.clear()
        ingress.update(p.node_id for p in service_processes() if p.role == "ingress")
        return bool(ingress) and None not in ingress

    wait_until(ingress_found, 30)
    spared = [w for w in workers if w.node_id not in ingress]
    assert ingress and None not in ingress and spared, f"no worker node known to be without the ingress: {ingress}"
    victim = spared[0]
    turns: dict[int, int | None] = {}
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
        agents = [threading.Thread(target=lambda i=i: turns.update({i: turn(client, i)})) for i in range(6)]
        for agent in agents:
            agent.start()
        killed_at = time.monotonic()
        held = kill_node(cluster, victim)
        probes = probe_until_200(client, killed_at)
        big.join()
        for agent in agents:
            agent.join()
        after = post(client, compact_body(history(HISTORY_TURNS // 3, "b"), "spread"))
    return {
        "warm": warm,
        "forced_tokens": tokens,
        "killed_node_held": held,
        "killed_mid_compaction": outcome.get("ended", 0) > killed_at > outcome.get("began", 0),
        "during": outcome,
        "turns": [turns.get(i) for i in range(6)],
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
