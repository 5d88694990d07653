"""The GPU catalogue entries: their ray.serve.llm configs and their GPU memory arithmetic (no GPU needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from compaction.errors import InvalidInput
from serving.models import ModelSpec, load_catalogue
from serving.sizing import GIB, H100_80GB_GIB, H100_NVL_GIB, gpu_fit

CATALOGUE = load_catalogue()
GPU_MODELS = [m for m in CATALOGUE.models if m.device == "gpu"]
PAPER_MODELS = {"llama-3.1-8b-instruct", "gpt-oss-20b", "gpt-oss-120b", "llama-3.3-70b-instruct"}
# The 70B on the paper's own hardware: an Azure H100 NVL pair (cluster/azure-h100.yaml).
NVL_70B = "llama-3.3-70b-instruct-nvl"
# The paper's largest compaction threshold: a history of 96k tokens goes into one prompt.
PAPER_MAX_HISTORY_TOKENS = 96 * 1024


def gpu_spec(**fields: object) -> ModelSpec:
    base: dict[str, object] = {
        "name": "m",
        "source": "org/m",
        "device": "gpu",
        "accelerator_type": "H100",
        "max_model_len": 16384,
        "weights_gib": 20.0,
        "kv_bytes_per_token": 2 * 2**20,
        "runtime_reserve_gib": 2.0,
        "gpu_memory_utilization": 0.5,
        "tensor_parallel_size": 2,
    }
    return ModelSpec.model_validate(base | fields)


def test_the_paper_models_are_the_gpu_entries() -> None:
    assert {m.name for m in GPU_MODELS} == PAPER_MODELS | {NVL_70B}


@pytest.mark.parametrize("spec", GPU_MODELS, ids=lambda m: m.name)
def test_llm_config_asks_for_tp_h100s_on_one_node(spec: ModelSpec) -> None:
    from ray.serve.llm import LLMConfig

    config = spec.llm_config()
    assert isinstance(config, LLMConfig)
    assert config.accelerator_type == "H100"
    engine = config.get_engine_config()
    assert engine.placement_strategy == "STRICT_PACK"
    assert len(engine.placement_bundles) == spec.tensor_parallel_size
    for bundle in engine.placement_bundles:
        assert bundle["GPU"] == 1
        assert bundle["accelerator_type:H100"] > 0
    kwargs = config.engine_kwargs
    assert kwargs["tensor_parallel_size"] == spec.tensor_parallel_size
    assert kwargs["max_model_len"] == spec.max_model_len
    assert kwargs["gpu_memory_utilization"] == spec.gpu_memory_utilization
    assert kwargs["enable_prefix_caching"] and kwargs["enable_chunked_prefill"]
    assert config.deployment_config["ray_actor_options"]["resources"] == spec.replica_resources
    assert spec.replica_resources, "a GPU model must name the node type it runs on"


@pytest.mark.parametrize("spec", GPU_MODELS, ids=lambda m: m.name)
def test_weights_and_a_full_length_kv_sequence_fit_each_h100(spec: ModelSpec) -> None:
    fit = gpu_fit(spec)
    assert fit.weights_gib + fit.reserve_gib + fit.kv_gib == pytest.approx(fit.budget_gib)
    assert fit.budget_gib <= fit.device_gib == (spec.device_memory_gib or H100_80GB_GIB)
    assert fit.fits, fit.row()
    assert spec.max_model_len == 131072, "the paper's tau range needs the full window on every model"


def test_sizing_arithmetic_on_round_numbers() -> None:
    # 0.5 x 80 GiB = 40 GiB per GPU; weights 20 GiB over TP=2 = 10; reserve 2; KV 28 GiB at 1 MiB per token per GPU.
    fit = gpu_fit(gpu_spec(), device_gib=80.0)
    assert (fit.budget_gib, fit.weights_gib, fit.kv_gib) == (40.0, 10.0, 28.0)
    assert fit.kv_bytes_per_token == 2**20
    assert fit.kv_tokens == 28 * 1024
    assert fit.fits and fit.sequences == pytest.approx(1.75)
    assert gpu_fit(gpu_spec(kv_cache_dtype="fp8"), device_gib=80.0).kv_tokens == 56 * 1024
    # A 112-token window (+ one 16-token block) of 2 MiB/token layers costs 128 MiB per GPU per sequence.
    windowed = gpu_fit(gpu_spec(window_kv_bytes_per_token=2 * 2**20, sliding_window=112), device_gib=80.0)
    assert windowed.window_bytes_per_sequence == 128 * 2**20
    assert windowed.kv_tokens == 28 * 1024 - 128
    assert not gpu_fit(gpu_spec(max_model_len=32768), device_gib=80.0).fits
    assert gpu_fit(gpu_spec(weights_gib=100.0), device_gib=80.0).kv_tokens == 0


def test_llama_70b_in_bf16_cannot_hold_the_papers_longest_history_on_two_h100s() -> None:
    # Why the catalogue quantizes the 70B weights to fp8: even fp8 KV at 0.95 utilization is too small in bf16.
    bf16 = CATALOGUE.get("llama-3.3-70b-instruct").model_copy(
        update={
            "quantization": None,
            "weights_gib": 70.55e9 * 2 / GIB,
            "kv_cache_dtype": "fp8",
            "gpu_memory_utilization": 0.95,
            "max_model_len": PAPER_MAX_HISTORY_TOKENS + 2048,
        }
    )
    assert not gpu_fit(bf16).fits
    assert gpu_fit(CATALOGUE.get("llama-3.3-70b-instruct")).kv_tokens > 2 * PAPER_MAX_HISTORY_TOKENS


def test_gpt_oss_120b_serves_its_full_window_on_one_h100_from_the_cited_figures() -> None:
    # GitLab's vLLM guide: at 0.95, 61 GB weights + 2 GB overhead leave 13 GB of KV, ~370k tokens at ~36 KB.
    spec = CATALOGUE.get("gpt-oss-120b")
    fit = gpu_fit(spec)
    assert (spec.tensor_parallel_size, spec.max_model_len, spec.gpu_memory_utilization) == (1, 131072, 0.95)
    assert spec.weights_gib == pytest.approx(61e9 / GIB, abs=0.05) and spec.runtime_reserve_gib == pytest.approx(
        2e9 / GIB, abs=0.05
    )
    assert fit.fits and fit.kv_tokens > 2 * spec.max_model_len
    # The figures they replace (64.4 GiB loaded weights + a 7.5 GiB reserve) capped the window below 96k...
    old = spec.model_copy(update={"weights_gib": 64.4, "runtime_reserve_gib": 7.5})
    assert gpu_fit(old).kv_tokens < 96 * 1024
    # ...while the window fits even with the old weight figure once the overhead is the guide's 2 GB.
    assert gpu_fit(spec.model_copy(update={"weights_gib": 64.4})).fits


def test_llama_70b_on_an_h100_nvl_pair_keeps_bf16_weights_with_an_fp8_kv_cache() -> None:
    spec = CATALOGUE.get(NVL_70B)
    assert spec.device_memory_gib == H100_NVL_GIB and spec.quantization is None and spec.kv_cache_dtype == "fp8"
    fit = gpu_fit(spec)
    assert fit.weights_gib == pytest.approx(70.55e9 * 2 / GIB / 2, abs=0.1) and fit.fits, fit.row()
    # bf16 KV would not hold the window on 2 x 94 GB; on 2 x 80 GB even fp8 KV cannot hold bf16 weights' 96k history.
    assert not gpu_fit(spec.model_copy(update={"kv_cache_dtype": "auto"})).fits
    assert gpu_fit(spec.model_copy(update={"kv_cache_dtype": "auto", "max_model_len": 98304 + 8192})).fits
    assert gpu_fit(spec, device_gib=H100_80GB_GIB).kv_tokens < PAPER_MAX_HISTORY_TOKENS


def test_sliding_window_layers_are_counted_per_sequence_not_per_token() -> None:
    spec = CATALOGUE.get("gpt-oss-120b")
    all_full = spec.model_copy(
        update={"kv_bytes_per_token": 2 * spec.kv_bytes_per_token, "window_kv_bytes_per_token": 0}
    )
    assert gpu_fit(spec).kv_tokens > 1.9 * gpu_fit(all_full).kv_tokens


def test_sizing_refuses_cpu_models() -> None:
    with pytest.raises(ValueError, match="GPU models"):
        gpu_fit(CATALOGUE.get("smollm2-135m-instruct"))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"weights_gib": 0}, "weights_gib and kv_bytes_per_token"),
        ({"window_kv_bytes_per_token": 4096}, "needs sliding_window"),
        ({"engine_kwargs": {"gpu_memory_utilization": 0.99}}, "gpu_memory_utilization"),
        ({"kv_cache_dtype": "int4"}, "kv_cache_dtype"),
        ({"gpu_memory_utilization": 1.0}, "gpu_memory_utilization"),
    ],
)
def test_invalid_gpu_entries_are_refused_naming_the_field(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        gpu_spec(**fields)


def test_a_catalogue_file_with_an_unsized_gpu_model_is_invalid_input(tmp_path: Path) -> None:
    path = tmp_path / "catalogue.yaml"
    path.write_text("models:\n  - {name: m, source: org/m, device: gpu, accelerator_type: H100, max_model_len: 4096}\n")
    with pytest.raises(InvalidInput) as info:
        load_catalogue(path)
    assert info.value.field == "catalogue"


def test_cpu_default_config_is_unchanged_by_the_gpu_fields() -> None:
    spec = CATALOGUE.get("smollm2-135m-instruct")
    args = spec.engine_args()
    assert "gpu_memory_utilization" not in args and "kv_cache_dtype" not in args
    config = spec.llm_config()
    assert config.deployment_config["ray_actor_options"] == {"num_cpus": spec.replica_cpus}
    assert config.placement_group_config == {"bundles": [{"CPU": spec.replica_cpus * 2}]}
