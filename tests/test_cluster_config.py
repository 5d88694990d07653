"""The deploy files in cluster/: autoscaler schema, Serve schema, KubeRay manifest, and their agreement with the
catalogue (which node type hosts each model, and whether it fits there)."""

from __future__ import annotations

import copy
import json
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from serving.models import ModelSpec, load_catalogue
from serving.sizing import gpu_fit

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_YAML = ROOT / "cluster" / "gcp-h100.yaml"
SERVE_YAML = ROOT / "cluster" / "serve-gpu.yaml"
KUBERAY_YAML = ROOT / "cluster" / "kuberay-rayservice.yaml"
GPU_MODELS = [m for m in load_catalogue().models if m.device == "gpu"]


def load(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def cluster() -> dict[str, Any]:
    return load(CLUSTER_YAML)


@pytest.fixture(scope="module")
def autoscaler_schema() -> dict[str, Any]:
    import ray.autoscaler

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    assert isinstance(schema, dict)
    return schema


def node_type_for(spec: ModelSpec, cluster: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The one node type that offers every custom resource the model's replicas ask for."""
    types = cluster["available_node_types"]
    matches = [
        (name, t)
        for name, t in types.items()
        if all(t["resources"].get(r, 0) >= n for r, n in spec.replica_resources.items())
    ]
    assert len(matches) == 1, f"{spec.name}: {spec.replica_resources} matches node types {[n for n, _ in matches]}"
    return matches[0]


def test_cluster_yaml_passes_the_autoscaler_schema_shipped_with_ray(
    cluster: dict[str, Any], autoscaler_schema: dict[str, Any]
) -> None:
    jsonschema.validate(cluster, autoscaler_schema)


def test_cluster_yaml_passes_the_launchers_own_checks(cluster: dict[str, Any]) -> None:
    # What `ray up` runs before talking to the cloud: fill in defaults, then validate (schema + node-type rules).
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(cluster))
    validate_config(prepared)
    assert prepared["available_node_types"][prepared["head_node_type"]]["max_workers"] == 0


@pytest.mark.parametrize(
    "break_it",
    [
        lambda c: c["available_node_types"]["gpu-h100x1"]["resources"].update({"GPU": 0.5}),
        lambda c: c["available_node_types"]["head"].pop("node_config"),
        lambda c: c["docker"].update({"imag": "typo"}),
        lambda c: c.pop("provider"),
    ],
    ids=["fractional-resource", "no-node-config", "unknown-docker-key", "no-provider"],
)
def test_the_schema_check_catches_broken_configs(
    cluster: dict[str, Any], autoscaler_schema: dict[str, Any], break_it: Callable[[dict[str, Any]], object]
) -> None:
    broken = copy.deepcopy(cluster)
    break_it(broken)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, autoscaler_schema)


def test_head_is_cpu_only_and_gpu_node_types_declare_the_h100(cluster: dict[str, Any]) -> None:
    types = cluster["available_node_types"]
    head = types[cluster["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0 and head["resources"]["CPU"] > 0
    for name, node_type in types.items():
        if node_type["resources"].get("GPU", 0):
            assert node_type["resources"]["accelerator_type:H100"] == 1, name
            assert node_type["node_config"]["machineType"].startswith("a3-highgpu-"), name
            gpus = int(node_type["node_config"]["machineType"].removeprefix("a3-highgpu-").removesuffix("g"))
            assert node_type["resources"]["GPU"] == gpus, f"{name}: resources disagree with the machine type"


@pytest.mark.parametrize("spec", GPU_MODELS, ids=lambda m: m.name)
def test_each_model_has_one_node_type_that_holds_a_replica(spec: ModelSpec, cluster: dict[str, Any]) -> None:
    name, node_type = node_type_for(spec, cluster)
    resources = node_type["resources"]
    bundles = spec.llm_config().get_engine_config().placement_bundles
    assert len(bundles) == spec.tensor_parallel_size == resources["GPU"], name
    assert sum(b["CPU"] for b in bundles) + spec.replica_cpus <= resources["CPU"], name
    assert resources.get(f"accelerator_type:{spec.accelerator_type}") == 1, name
    assert gpu_fit(spec).fits, gpu_fit(spec).row()


def test_worker_bounds_follow_the_catalogue_replica_bounds(cluster: dict[str, Any]) -> None:
    # One replica per GPU node: a node type's min/max workers are the sums of its models' min/max replicas.
    bounds: dict[str, list[int]] = {}
    for spec in GPU_MODELS:
        name, _ = node_type_for(spec, cluster)
        lo_hi = bounds.setdefault(name, [0, 0])
        lo_hi[0] += spec.replicas.min
        lo_hi[1] += spec.replicas.max
    types = cluster["available_node_types"]
    assert {n for n, t in types.items() if t["resources"].get("GPU", 0)} == set(bounds)
    for name, (lo, hi) in bounds.items():
        assert (types[name]["min_workers"], types[name]["max_workers"]) == (lo, hi), name
    assert cluster["max_workers"] >= sum(hi for _, hi in bounds.values())
    assert cluster["idle_timeout_minutes"] >= 5


def test_setup_installs_the_projects_gpu_extra(cluster: dict[str, Any]) -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(dep.startswith("vllm==") for dep in extras["gpu"])
    assert any('".[gpu]"' in command for command in cluster["setup_commands"])
    assert "." in cluster["file_mounts"].values()


def test_serve_config_passes_ray_serves_schema_and_deploys_the_paper_models() -> None:
    from ray.serve.schema import ServeDeploySchema

    from serving.app import AppArgs

    config = ServeDeploySchema.model_validate(load(SERVE_YAML))
    (app,) = config.applications
    assert app.import_path == "serving.app:build_app"
    assert AppArgs.model_validate(app.args).coordinator_replicas >= 2  # no single point of failure
    assert set(app.args["models"]) == {m.name for m in GPU_MODELS}
    assert app.args["max_request_bytes"] > 0


@pytest.mark.parametrize(
    ("break_it", "field"),
    [
        (lambda c: c.update(proxy_location="Nowhere"), "proxy_location"),
        (lambda c: c["applications"][0].pop("import_path"), "import_path"),
        (lambda c: c["http_options"].update(port="eight thousand"), "port"),
    ],
    ids=["proxy-location", "no-import-path", "port"],
)
def test_the_serve_schema_check_catches_broken_configs(
    break_it: Callable[[dict[str, Any]], object], field: str
) -> None:
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    broken = load(SERVE_YAML)
    break_it(broken)
    with pytest.raises(ValidationError, match=field):
        ServeDeploySchema.model_validate(broken)


@pytest.fixture(scope="module")
def rayservice() -> dict[str, Any]:
    return load(KUBERAY_YAML)


def test_kuberay_manifest_embeds_the_same_serve_config(rayservice: dict[str, Any]) -> None:
    from ray.serve.schema import ServeDeploySchema

    assert (rayservice["apiVersion"], rayservice["kind"]) == ("ray.io/v1", "RayService")
    embedded = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(embedded)
    assert embedded == load(SERVE_YAML)


def test_kuberay_groups_match_the_autoscaler_node_types(rayservice: dict[str, Any], cluster: dict[str, Any]) -> None:
    import ray
    from ray.autoscaler._private.kuberay.autoscaling_config import _get_ray_resources_from_group_spec

    spec = rayservice["spec"]["rayClusterConfig"]
    assert spec["rayVersion"] == ray.__version__
    assert spec["enableInTreeAutoscaling"] is True
    types = cluster["available_node_types"]

    def ray_resources(group: dict[str, Any], is_head: bool) -> dict[str, int]:
        # The resources KubeRay's autoscaler sees for a group, computed by Ray's own parser.
        found = _get_ray_resources_from_group_spec(group, is_head)
        found.pop("memory", None)
        return found

    assert ray_resources(spec["headGroupSpec"], True) == types[cluster["head_node_type"]]["resources"]
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    assert set(groups) == set(types) - {cluster["head_node_type"]}
    for name, group in groups.items():
        assert ray_resources(group, False) == types[name]["resources"], name
        assert (group["minReplicas"], group["maxReplicas"]) == (types[name]["min_workers"], types[name]["max_workers"])
        machine = group["template"]["spec"]["nodeSelector"]["node.kubernetes.io/instance-type"]
        assert machine == types[name]["node_config"]["machineType"], name
