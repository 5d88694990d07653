"""Driver of the multi-node rehearsal (tests/test_cluster_rehearsal.py), run in its own process against a running
local cluster whose worker nodes stand in for the node types of cluster/gcp-h100.yaml.

Stand-in model replicas are Serve deployments with exactly the options ray.serve.llm derives from the catalogue's
LLMConfig (placement-group bundles, strategy, actor resources, autoscaling bounds); only the vLLM engine is
replaced: each replica starts one "engine worker" actor per tensor-parallel bundle of its placement group, as
vLLM's Ray executor does, and serves a chunk request by running a task on every one of them. Writes one JSON
object to --out: where each replica, each engine worker and each chunk ran, and what the node types are.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import ray
from ray import serve
from ray.util.placement_group import get_current_placement_group, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from serving.models import load_catalogue

SINGLE_GPU_MODEL = "llama-3.1-8b-instruct"
PAIR_MODEL = "llama-3.3-70b-instruct"
OTHER_SINGLE_GPU_MODEL = "gpt-oss-20b"
CHUNKS = 6
NODES_MISSING = 3  # exit code: a node kind asked for by --kinds is not alive after --nodes-wait-s


@ray.remote
class EngineWorker:
    """Holds one GPU of the replica's placement group, like a vLLM tensor-parallel worker."""

    def forward(self, chunk: int) -> dict[str, Any]:
        context = ray.get_runtime_context()
        return {"chunk": chunk, "node": context.get_node_id(), "gpus": [str(g) for g in ray.get_gpu_ids()]}


@serve.deployment
class StandInModel:
    def __init__(self, model: str, tensor_parallel_size: int) -> None:
        group = get_current_placement_group()
        self.model = model
        self.workers = [
            EngineWorker.options(
                num_cpus=1,
                num_gpus=1,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank),
            ).remote()
            for rank in range(tensor_parallel_size)
        ]

    async def __call__(self, chunk: int) -> dict[str, Any]:
        ranks = await asyncio.gather(*[worker.forward.remote(chunk) for worker in self.workers])
        return {
            "model": self.model,
            "chunk": chunk,
            "replica_node": ray.get_runtime_context().get_node_id(),
            "ranks": ranks,
        }


def replica_options(model: str) -> dict[str, Any]:
    """The deployment options ray.serve.llm gives this model's LLMServer, minus the engine's runtime_env."""
    from ray.serve.llm import LLMServer

    options = dict(LLMServer.get_deployment_options(load_catalogue().get(model).llm_config()))
    options["ray_actor_options"] = {k: v for k, v in options["ray_actor_options"].items() if k != "runtime_env"}
    return options


def deploy(model: str) -> Any:
    spec = load_catalogue().get(model)
    app = StandInModel.options(name=model, **replica_options(model)).bind(model, spec.tensor_parallel_size)
    return serve.run(app, name=model, route_prefix=None)


def pending_while_pair_node_idle(model: str, wait_s: float) -> bool:
    """Whether a second 1-GPU model's placement group stays unplaced (the autoscaler would add a 1g node)."""
    options = replica_options(model)
    group = placement_group(options["placement_group_bundles"], strategy=options["placement_group_strategy"])
    ready, _ = ray.wait([group.ready()], timeout=wait_s)
    remove_placement_group(group)
    return not ready


def node_kinds() -> dict[str, str]:
    kinds = {}
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        resources = node["Resources"]
        kind = "nvlink_pair" if "nvlink_pair" in resources else "single_h100" if "single_h100" in resources else "head"
        kinds[node["NodeID"]] = kind
    return kinds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True)
    parser.add_argument("--out", required=True, help="JSON file for the placements")
    parser.add_argument("--pending-wait-s", type=float, default=5.0)
    parser.add_argument("--kinds", default="head", help="comma-separated node kinds to wait for (one node each)")
    parser.add_argument("--nodes-wait-s", type=float, default=300.0)
    args = parser.parse_args()
    ray.init(address=args.address, namespace="cluster-rehearsal", log_to_driver=False)
    try:
        deadline = time.monotonic() + args.nodes_wait_s
        while missing := sorted(set(args.kinds.split(",")) - set(node_kinds().values())):
            if time.monotonic() > deadline:
                # The caller may restart these nodes and run the driver again.
                Path(args.out).write_text(json.dumps({"missing": missing}))
                raise SystemExit(NODES_MISSING)
            time.sleep(0.5)
        serve.start(proxy_location="Disabled")
        single = deploy(SINGLE_GPU_MODEL)
        pending = pending_while_pair_node_idle(OTHER_SINGLE_GPU_MODEL, args.pending_wait_s)
        pair = deploy(PAIR_MODEL)
        calls = [(single if k % 2 == 0 else pair).remote(k) for k in range(CHUNKS)]
        chunks = [call.result(timeout_s=120) for call in calls]
        result = {"nodes": node_kinds(), "chunks": chunks, "second_single_gpu_model_pending": pending}
        Path(args.out).write_text(json.dumps(result, indent=1))
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
