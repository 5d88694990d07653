"""The deploy files in cluster/: autoscaler schemas (GCP and Azure), Serve schema, KubeRay manifest, and their agreement
with the catalogue (which node type hosts each model, and whether it fits there)."""

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

from serving.models import ModelSpec, Replicas, load_catalogue
from serving.sizing import gpu_fit

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_YAML = ROOT / "cluster" / "gcp-h100.yaml"
SERVE_YAML = ROOT / "cluster" / "serve-gpu.yaml"
KUBERAY_YAML = ROOT / "cluster" / "kuberay-rayservice.yaml"
# Each autoscaler cluster and the Serve config deployed on it.
CLUSTERS = {
    "gcp": (CLUSTER_YAML, SERVE_YAML),
    "azure": (ROOT / "cluster" / "azure-h100.yaml", ROOT / "cluster" / "serve-azure.yaml"),
}
MACHINE_GPUS = {"a3-highgpu-1g": 1, "a3-highgpu-2g": 2, "Standard_NC40ads_H100_v5": 1, "Standard_NC80adis_H100_v5": 2}
CATALOGUE = load_catalogue()
GPU_MODELS = [m for m in CATALOGUE.models if m.device == "gpu"]
PAPER_MODELS = {"llama-3.1-8b-instruct", "gpt-oss-20b", "gpt-oss-120b", "llama-3.3-70b-instruct"}


def load(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def cluster() -> dict[str, Any]:
    return load(CLUSTER_YAML)


def deployed(serve_yaml: Path) -> list[ModelSpec]:
    """The catalogue entries a Serve config deploys, with its replica bounds applied."""
    args = load(serve_yaml)["applications"][0]["args"]
    bounds = args.get("replicas") or {}
    specs = [CATALOGUE.get(name) for name in args["models"]]
    return [
        s.model_copy(update={"replicas": Replicas.model_validate(bounds[s.name])}) if s.name in bounds else s
        for s in specs
    ]


@pytest.fixture(scope="module", params=list(CLUSTERS))
def deployment(request: pytest.FixtureRequest) -> tuple[dict[str, Any], list[ModelSpec]]:
    """(cluster YAML, the models its Serve config deploys), for every cloud."""
    cluster_yaml, serve_yaml = CLUSTERS[request.param]
    return load(cluster_yaml), deployed(serve_yaml)


def machine(node_type: dict[str, Any]) -> str:
    config = node_type["node_config"]
    return str(config.get("machineType") or config["azure_arm_parameters"]["vmSize"])


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
    deployment: tuple[dict[str, Any], list[ModelSpec]], autoscaler_schema: dict[str, Any]
) -> None:
    jsonschema.validate(deployment[0], autoscaler_schema)


def test_cluster_yaml_passes_the_launchers_own_checks(deployment: tuple[dict[str, Any], list[ModelSpec]]) -> None:
    # What `ray up` runs before talking to the cloud: fill in defaults, then validate (schema + node-type rules).
    from ray.autoscaler._private.util import prepare_config, validate_config

    cluster = deployment[0]
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


def test_head_is_cpu_only_and_gpu_node_types_declare_the_h100(
    deployment: tuple[dict[str, Any], list[ModelSpec]],
) -> None:
    cluster = deployment[0]
    types = cluster["available_node_types"]
    head = types[cluster["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0 and head["resources"]["CPU"] > 0
    for name, node_type in types.items():
        if node_type["resources"].get("GPU", 0):
            assert node_type["resources"]["accelerator_type:H100"] == 1, name
            gpus = MACHINE_GPUS[machine(node_type)]
            assert node_type["resources"]["GPU"] == gpus, f"{name}: resources disagree with the machine type"


def test_each_model_has_one_node_type_that_holds_a_replica(deployment: tuple[dict[str, Any], list[ModelSpec]]) -> None:
    cluster, specs = deployment
    for spec in specs:
        name, node_type = node_type_for(spec, cluster)
        resources = node_type["resources"]
        bundles = spec.llm_config().get_engine_config().placement_bundles
        assert len(bundles) == spec.tensor_parallel_size == resources["GPU"], name
        assert sum(b["CPU"] for b in bundles) + spec.replica_cpus <= resources["CPU"], name
        assert resources.get(f"accelerator_type:{spec.accelerator_type}") == 1, name
        assert gpu_fit(spec).fits, gpu_fit(spec).row()


def test_every_gpu_entry_is_deployed_on_some_cloud() -> None:
    assert {s.name for _, serve in CLUSTERS.values() for s in deployed(serve)} == {m.name for m in GPU_MODELS}


def test_worker_bounds_follow_the_catalogue_replica_bounds(deployment: tuple[dict[str, Any], list[ModelSpec]]) -> None:
    # One replica per GPU node: a node type's min/max workers are the sums of its models' min/max replicas.
    cluster, specs = deployment
    bounds: dict[str, list[int]] = {}
    for spec in specs:
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


def test_setup_installs_the_projects_gpu_extra(deployment: tuple[dict[str, Any], list[ModelSpec]]) -> None:
    cluster = deployment[0]
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(dep.startswith("vllm==") for dep in extras["gpu"])
    assert any('".[gpu]"' in command for command in cluster["setup_commands"])
    assert "." in cluster["file_mounts"].values()


@pytest.mark.parametrize("cloud", list(CLUSTERS))
def test_serve_config_passes_ray_serves_schema_and_deploys_the_paper_models(cloud: str) -> None:
    from ray.serve.schema import ServeDeploySchema

    from serving.app import AppArgs

    config = ServeDeploySchema.model_validate(load(CLUSTERS[cloud][1]))
    (app,) = config.applications
    assert app.import_path == "serving.app:build_app"
    assert AppArgs.model_validate(app.args).coordinator_replicas >= 2  # no single point of failure
    paper = (
        PAPER_MODELS if cloud == "gcp" else PAPER_MODELS - {"llama-3.3-70b-instruct"} | {"llama-3.3-70b-instruct-nvl"}
    )
    assert set(app.args["models"]) == paper
    assert app.args["max_request_bytes"] > 0


def test_the_azure_serve_config_is_the_gcp_one_but_for_the_70b() -> None:
    gcp, azure = load(SERVE_YAML), load(CLUSTERS["azure"][1])
    nvl = "llama-3.3-70b-instruct-nvl"
    for config in (gcp, azure):
        args = config["applications"][0]["args"]
        args["models"] = [m.removesuffix("-nvl") for m in args["models"]]
        for key in ("cost", "replicas"):
            args.get(key, {}).pop("llama-3.3-70b-instruct", None)
            args.get(key, {}).pop(nvl, None)
    assert gcp == azure


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


@pytest.mark.parametrize("cloud", list(CLUSTERS))
def test_the_serve_configs_simulated_bounds_and_targets_reach_the_llm_deployments(cloud: str) -> None:
    from serving.app import hosted_specs, parse_args

    args = parse_args(load(CLUSTERS[cloud][1])["applications"][0]["args"])
    assert set(args.cost) == set(args.replicas) == set(args.models)
    for spec in hosted_specs(args):
        autoscaling = spec.llm_config().deployment_config["autoscaling_config"]
        bounds = args.replicas[spec.name]
        assert autoscaling["max_replicas"] == bounds.max >= 2
        assert autoscaling["target_ongoing_requests"] == bounds.target_ongoing_requests
