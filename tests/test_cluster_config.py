"""The deploy files in cluster/: autoscaler schemas (GCP and Azure), Serve schema, KubeRay manifest, their agreement
with the catalogue (which node type hosts each model, and whether it fits there), and a locked control plane (Ray
token auth on every node, no dashboard, GCS or Ray Client port open beyond the Ray pods, no key in a runtime_env)."""

from __future__ import annotations

import copy
import json
import re
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


def kuberay_documents() -> dict[str, dict[str, Any]]:
    """The manifest's documents by kind (a RayService and its NetworkPolicy)."""
    documents = {doc["kind"]: doc for doc in yaml.safe_load_all(KUBERAY_YAML.read_text())}
    assert set(documents) == {"RayService", "NetworkPolicy"}
    return documents


@pytest.fixture(scope="module")
def rayservice() -> dict[str, Any]:
    return kuberay_documents()["RayService"]


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


# A locked control plane: token auth, a loopback or policed dashboard, no Ray Client port, no key in a runtime_env.

SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD", re.IGNORECASE)
RAY_PORTS = {"gcs": 6379, "dashboard": 8265, "client": 10001, "metrics": 8080, "serve": 8000}


def start_commands(cluster: dict[str, Any]) -> dict[str, str]:
    """The `ray start` command of the head and of the workers, each with the shell lines before it."""
    found = {}
    for role in ("head", "worker"):
        (command,) = [c for c in cluster[f"{role}_start_ray_commands"] if "ray start" in c]
        found[role] = command
    return found


def exported(command: str) -> dict[str, str]:
    """Variables the command exports before `ray start` (`export A=x B=y;`)."""
    pairs: dict[str, str] = {}
    for statement in re.findall(r"export ([^;]+);", command):
        pairs.update(re.findall(r'(\w+)=("[^"]*"|\S+)', statement))
    return pairs


def test_every_node_starts_ray_with_token_auth_from_a_mounted_token(
    deployment: tuple[dict[str, Any], list[ModelSpec]],
) -> None:
    cluster = deployment[0]
    for role, command in start_commands(cluster).items():
        env = exported(command)
        assert env.get("RAY_AUTH_MODE") == "token", role
        assert env["RAY_AUTH_TOKEN_PATH"] in cluster["file_mounts"], role
        assert cluster["file_mounts"][env["RAY_AUTH_TOKEN_PATH"]] == "~/.ray/auth_token"  # `ray get-auth-token`
    head = start_commands(cluster)["head"]
    assert "--dashboard-host=127.0.0.1" in head and "0.0.0.0" not in head


def test_every_node_exports_the_api_key_from_a_mounted_file(
    deployment: tuple[dict[str, Any], list[ModelSpec]],
) -> None:
    # The ingress may run on any node; its process inherits the raylet's environment.
    cluster = deployment[0]
    for role, command in start_commands(cluster).items():
        value = exported(command)["COMPACTION_API_KEY"]
        (path,) = re.fullmatch(r'"\$\(cat (\S+)\)"', value).groups()  # type: ignore[union-attr]
        assert path in cluster["file_mounts"], role


def runtime_env_secrets(node: object) -> list[str]:
    """Names of secret-looking env vars in any runtime_env inside a parsed config."""
    if isinstance(node, list):
        return [name for item in node for name in runtime_env_secrets(item)]
    if not isinstance(node, dict):
        return []
    found = [name for name in (node.get("runtime_env") or {}).get("env_vars", {}) if SECRET_NAME.search(name)]
    return found + [name for value in node.values() for name in runtime_env_secrets(value)]


def shipped_configs() -> dict[str, object]:
    paths = sorted(set((ROOT / "cluster").glob("*.yaml")) - {KUBERAY_YAML})
    configs: dict[str, object] = {path.name: load(path) for path in paths}
    service = kuberay_documents()["RayService"]
    configs[KUBERAY_YAML.name] = service
    configs["serveConfigV2"] = yaml.safe_load(service["spec"]["serveConfigV2"])
    return configs


def test_no_shipped_config_puts_a_key_or_token_in_a_runtime_env() -> None:
    configs = shipped_configs()
    assert {"serve-local.yaml", "serve-gpu.yaml", "serve-azure.yaml", "gcp-h100.yaml", "serveConfigV2"} <= set(configs)
    for name, config in configs.items():
        assert runtime_env_secrets(config) == [], name
    leaked = copy.deepcopy(configs["serve-gpu.yaml"])
    leaked["applications"][0]["runtime_env"] = {"env_vars": {"COMPACTION_API_KEY": "sk-1"}}  # type: ignore[index]
    assert runtime_env_secrets(leaked) == ["COMPACTION_API_KEY"]


def ray_containers(service: dict[str, Any]) -> list[dict[str, Any]]:
    spec = service["spec"]["rayClusterConfig"]
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    return [group["template"]["spec"]["containers"][0] for group in groups]


def test_kuberay_turns_on_token_auth_and_opens_no_ray_client_port(rayservice: dict[str, Any]) -> None:
    spec = rayservice["spec"]["rayClusterConfig"]
    assert spec["authOptions"] == {"mode": "token", "secretName": "ray-auth-token"}
    head = spec["headGroupSpec"]
    assert head.get("serviceType", "ClusterIP") == "ClusterIP"
    assert "ray-client-server-port" not in head["rayStartParams"]
    ports = {p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    # The head Service carries the head container's ports: the GCS for the workers, the dashboard for the operator.
    assert ports == {RAY_PORTS["gcs"], RAY_PORTS["dashboard"], RAY_PORTS["serve"]}
    for container in ray_containers(rayservice):
        for var in container.get("env", []):
            assert not var["name"].startswith("RAY_AUTH"), "authOptions sets the token; do not inline it"


def test_kuberay_gives_every_ray_container_the_api_key_from_a_secret(rayservice: dict[str, Any]) -> None:
    for container in ray_containers(rayservice):
        (var,) = [v for v in container["env"] if v["name"] == "COMPACTION_API_KEY"]
        assert set(var) == {"name", "valueFrom"}, "the key comes from a Secret, never inline"
        assert var["valueFrom"]["secretKeyRef"] == {"name": "compaction-api-key", "key": "key"}


def admitted(policy: dict[str, Any], source: dict[str, str], port: int) -> bool:
    """Whether a NetworkPolicy lets a pod with labels `source` (any namespace) reach a selected pod on `port`."""

    def peer_matches(peer: dict[str, Any]) -> bool:
        if "ipBlock" in peer:
            return True
        wanted = peer.get("podSelector", {}).get("matchLabels", {})
        return all(source.get(k) == v for k, v in wanted.items())

    for rule in policy["spec"].get("ingress", []):
        from_ok = "from" not in rule or any(peer_matches(peer) for peer in rule["from"])
        port_ok = "ports" not in rule or any(p["port"] == port for p in rule["ports"])
        if from_ok and port_ok:
            return True
    return False


def reachable_ports(policy: dict[str, Any], source: dict[str, str]) -> set[int]:
    return {port for port in RAY_PORTS.values() if admitted(policy, source, port)}


def test_kuberay_network_policy_admits_only_the_serve_port_from_outside(rayservice: dict[str, Any]) -> None:
    policy = kuberay_documents()["NetworkPolicy"]
    assert policy["apiVersion"] == "networking.k8s.io/v1"
    assert "Ingress" in policy["spec"]["policyTypes"]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    spec = rayservice["spec"]["rayClusterConfig"]
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        labels = group["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), "the policy must select every Ray pod"
    ray_pod = dict(selector)
    operator = {"app.kubernetes.io/name": "kuberay-operator"}
    assert reachable_ports(policy, {"app": "some-other-pod"}) == {RAY_PORTS["serve"]}
    assert reachable_ports(policy, operator) == {RAY_PORTS["serve"], RAY_PORTS["dashboard"]}
    assert reachable_ports(policy, ray_pod) == set(RAY_PORTS.values())
    opened = copy.deepcopy(policy)
    opened["spec"]["ingress"].append({"ports": [{"port": RAY_PORTS["gcs"], "protocol": "TCP"}]})
    assert RAY_PORTS["gcs"] in reachable_ports(opened, {"app": "some-other-pod"})
