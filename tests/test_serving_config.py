"""build_app and the Serve config, built (never started): the GPU models validate without a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from compaction.errors import InvalidInput
from serving.app import AppArgs, build_app, hosted_specs, parse_args
from serving.cpu import CPU_DTYPE_ENV, cpu_dtype
from serving.models import load_catalogue

pytestmark = pytest.mark.ray
GPU_MODELS = ["llama-3.1-8b-instruct", "gpt-oss-20b", "gpt-oss-120b", "llama-3.3-70b-instruct"]
SERVE_LOCAL = Path(__file__).resolve().parents[1] / "cluster" / "serve-local.yaml"
SERVE_GPU = SERVE_LOCAL.with_name("serve-gpu.yaml")


def test_app_args_have_safe_defaults_and_refuse_unknown_keys() -> None:
    args = AppArgs()
    assert args.models == ["smollm2-135m-instruct"] and args.catalogue is None
    assert args.tenancy.api_key_env == "COMPACTION_API_KEY" and args.max_request_bytes > 1_000_000
    assert args.coordinator_replicas == 2 and args.admission.max_running is None  # sized by the engines
    bad_args = (
        {"modelz": ["x"]},
        {"models": []},
        {"max_request_bytes": 0},
        {"cost": {"other": {}}},
        {"replicas": {"other": {}}},
        {"replicas": {"smollm2-135m-instruct": {"min": 3, "max": 2}}},
        {"coordinator_replicas": 0},
        {"admission": {"max_queued": -1}},
        {"max_queued_compactions": 8},  # the admission limits are nested
    )
    for bad in bad_args:
        with pytest.raises(ValueError, match=r"invalid serving\.app args"):
            parse_args(bad)


def test_replica_bounds_can_replace_the_catalogues() -> None:
    (spec,) = hosted_specs(parse_args({"replicas": {"smollm2-135m-instruct": {"min": 1, "max": 3, "initial": 1}}}))
    autoscaling = spec.llm_config().deployment_config["autoscaling_config"]
    assert (autoscaling["min_replicas"], autoscaling["max_replicas"], autoscaling["initial_replicas"]) == (1, 3, 1)
    (default,) = hosted_specs(parse_args({}))
    assert default.replicas.initial == 1  # one replica on every core of the host (docs/placement.md)


def test_the_gpu_models_build_into_an_application(ray_cluster: None) -> None:
    from ray.serve.deployment import Application

    gpu_config = yaml.safe_load(SERVE_GPU.read_text())
    (gpu_app,) = gpu_config["applications"]
    assert sorted(gpu_app["args"]["models"]) == sorted(GPU_MODELS)
    assert isinstance(build_app(gpu_app["args"]), Application)
    assert isinstance(build_app({}), Application)
    with pytest.raises(ValueError, match="unknown model 'llama-4'"):
        build_app({"models": ["llama-4"]})


def test_the_local_serve_config_is_valid(ray_cluster: None) -> None:
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate(yaml.safe_load(SERVE_LOCAL.read_text()))
    (app,) = config.applications
    assert app.import_path == "serving.app:build_app" and app.route_prefix == "/"
    assert config.http_options.host == "127.0.0.1"
    args = AppArgs.model_validate(app.args)
    assert args.models == ["smollm2-135m-instruct"] and args.coordinator_replicas >= 2
    assert build_app(app.args) is not None


@pytest.mark.parametrize(
    ("flags", "dtype"),
    [
        ("flags\t\t: fpu sse2 avx2 fma", "float32"),  # AVX2 only: bf16 would be converted on every matmul
        ("flags\t\t: fpu avx2 avx512f avx512_bf16", "bfloat16"),
        ("flags\t\t: fpu avx2 amx_tile amx_bf16", "bfloat16"),
        ("Features\t: fp asimd bf16 i8mm", "bfloat16"),  # Arm
    ],
)
def test_the_cpu_engines_run_bf16_only_where_the_cpu_computes_it(tmp_path: Path, flags: str, dtype: str) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: test\n{flags}\n")
    assert cpu_dtype(cpuinfo, {}) == dtype  # the flags decide unless COMPACTION_CPU_DTYPE is set
    assert cpu_dtype(tmp_path / "absent", {}) == "float32"
    assert load_catalogue().get("smollm2-135m-instruct").engine_args()["dtype"] == cpu_dtype()


def test_the_cpu_dtype_can_be_forced_and_a_wrong_one_is_refused_by_name(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("flags\t\t: fpu avx2 avx512f avx512_bf16\n")
    assert cpu_dtype(cpuinfo, {CPU_DTYPE_ENV: "float32"}) == "float32"
    assert cpu_dtype(cpuinfo, {CPU_DTYPE_ENV: ""}) == "bfloat16"
    with pytest.raises(InvalidInput, match=CPU_DTYPE_ENV):
        cpu_dtype(cpuinfo, {CPU_DTYPE_ENV: "fp16"})


def test_the_local_service_exits_non_zero_once_its_port_is_gone_and_zero_when_stopped() -> None:
    import socket
    import threading

    from serving.local import watch

    with socket.socket() as probe:  # a port nothing listens on: what is left when the node's proxy died
        probe.bind(("127.0.0.1", 0))
        gone = f"http://127.0.0.1:{probe.getsockname()[1]}"
    assert watch(gone, threading.Event(), every_s=0.01, lost_after=3) == 1
    stopped = threading.Event()
    stopped.set()
    assert watch(gone, stopped, every_s=0.01) == 0


@pytest.mark.parametrize(
    ("source", "bundle_nodes", "runs"),
    [("folder", ["n1"], False), ("folder", ["n1", "n2"], True), ("hub id", ["n1"], True)],
)
def test_node_initialisation_is_skipped_only_for_weights_already_on_the_replicas_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, bundle_nodes: list[str], runs: bool
) -> None:
    import asyncio
    from types import SimpleNamespace

    import ray

    from serving.node_init import LocalWeights

    if source == "folder":  # the catalogue names the callback for a folder only
        config = load_catalogue().get("smollm2-135m-instruct").model_copy(update={"source": str(tmp_path)}).llm_config()
        assert config.callback_config.callback_class == "serving.node_init.LocalWeights"
    else:
        config = load_catalogue().get("llama-3.1-8b-instruct").llm_config()
        assert config.callback_config.callback_class != "serving.node_init.LocalWeights"
    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(get_node_id=lambda: "n1"))
    table = {"bundles_to_node_id": dict(enumerate(bundle_nodes))}
    monkeypatch.setattr(ray.util, "placement_group_table", lambda group: table)
    callback = LocalWeights(llm_config=config, ctx_kwargs={"placement_group": object()})
    asyncio.run(callback.on_before_node_init())
    assert callback.ctx.run_init_node is runs
