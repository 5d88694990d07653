"""The model catalogue: pydantic entries loaded from YAML, each turned into a ray.serve.llm LLMConfig."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from compaction.errors import InvalidInput, UnknownModel
from compaction.pacing import YieldRule
from compaction.partition import PlanLimits
from serving.cpu import CPU_ENGINE_ENV, cpu_dtype

DEFAULT_CATALOGUE = Path(__file__).with_name("catalogue.yaml")
DEFAULT_MODEL = "smollm2-135m-instruct"  # the CPU default: what the service hosts when told nothing else
CPU_DEFAULT_SOURCE = "cpu-default"
# Engine arguments that are catalogue fields (sizing or the served API read them): engine_kwargs may not set them.
FIELD_ENGINE_ARGS = frozenset(
    {
        "max_model_len", "tensor_parallel_size", "quantization", "gpu_memory_utilization", "kv_cache_dtype",
        "block_size", "max_num_seqs", "tool_call_parser", "reasoning_parser", "enable_auto_tool_choice",
    }
)  # fmt: skip
# Engine arguments the service relies on (background requests run at a priority other than 0).
RESERVED_ENGINE_ARGS = frozenset({"scheduling_policy", "additional_config"})
# vLLM schedulers in which background compaction yields to the agent (serving.scheduler).
SCHEDULERS = {"cpu": "serving.scheduler.YieldingScheduler", "gpu": "serving.scheduler.YieldingAsyncScheduler"}
CpuBinding = Literal["cores", "auto", "nobind"]  # serving.placement
# vLLM's own max_num_seqs default for an OpenAI server: 128 on the CPU, 1024 on 70 GB+ GPUs (H100), 256 below.
DEFAULT_MAX_NUM_SEQS = {"cpu": 128, "gpu_large": 1024, "gpu": 256}
LARGE_GPUS = frozenset({"H100", "H200", "B200", "GB200"})


class Replicas(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    min: int = Field(1, ge=0, le=1024, description="Autoscaling lower bound.")
    max: int = Field(1, ge=1, le=1024, description="Autoscaling upper bound.")
    initial: int = Field(1, ge=0, le=1024, description="Replicas started with the application.")
    target_ongoing_requests: float | None = Field(
        None, gt=0, le=100_000, description="Serve autoscaling target: requests in flight per replica (None: Serve's)."
    )

    @model_validator(mode="after")
    def _ordered(self) -> Replicas:
        if not self.min <= self.initial <= self.max:
            raise ValueError(f"need min <= initial <= max, got {self.min}, {self.initial}, {self.max}")
        return self


class ModelSpec(BaseModel):
    """One hosted model: what to load, on what hardware, with what limits."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(min_length=1, description="Model id in the API (`model` field of requests).")
    source: str = Field(min_length=1, description="HF repo id, local folder, or `cpu-default`.")
    device: Literal["cpu", "gpu"] = Field(description="Which vLLM build serves it.")
    accelerator_type: str | None = Field(None, description="Ray accelerator type of the GPU (e.g. H100).")
    tensor_parallel_size: int = Field(1, ge=1, le=8, description="GPUs per replica, on one node.")
    quantization: str | None = Field(
        None, description="vLLM quantization method (vLLM checks it against the checkpoint's own, if any)."
    )
    max_model_len: int = Field(ge=512, le=1_048_576, description="Context window the engine is started with.")
    block_size: int = Field(16, ge=1, le=1024, description="Prefix-cache block size in tokens.")
    weights_gib: float = Field(
        0.0, ge=0, description="GPU memory the loaded weights take per replica (all GPUs, GiB), for sizing."
    )
    kv_bytes_per_token: int = Field(
        0, ge=0, description="bf16 KV bytes per token of the full-attention layers (all GPUs), for sizing."
    )
    window_kv_bytes_per_token: int = Field(
        0, ge=0, description="bf16 KV bytes per token of the sliding-window layers (all GPUs), for sizing."
    )
    sliding_window: int | None = Field(
        None, ge=1, description="Tokens a sliding-window layer keeps; needed when window_kv_bytes_per_token > 0."
    )
    kv_cache_dtype: Literal["auto", "fp8"] = Field("auto", description="GPU only: KV-cache dtype (auto = bf16).")
    device_memory_gib: float | None = Field(
        None,
        gt=1,
        le=1024,
        description="GPU only, for sizing: memory CUDA reports per GPU (None: an H100 80GB, 79.1 GiB).",
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0.1, le=0.98, description="GPU only: share of each GPU's memory vLLM may take (weights + KV + runtime)."
    )
    runtime_reserve_gib: float = Field(
        4.0,
        ge=0,
        le=40,
        description="GPU only, for sizing: per-GPU memory outside weights and KV (activations, "
        "CUDA graphs, NCCL/cuBLAS workspaces).",
    )
    replica_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources each replica asks for; a resource only one node type has pins the "
        "replica to that node type (see cluster/).",
    )
    kv_cache_gib: int = Field(1, ge=1, le=512, description="CPU only: KV cache size (VLLM_CPU_KVCACHE_SPACE).")
    max_num_seqs: int | None = Field(
        None,
        ge=1,
        le=16_384,
        description="Sequences one replica's engine batches (vLLM max_num_seqs); also what compaction admission "
        "fills per replica. None: vLLM's default for the device (128 on CPU, 1024 on H100-class GPUs).",
    )
    max_ongoing_requests: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description="Requests one replica takes at once (Serve's max_ongoing_requests); more wait for it or go to "
        "the next replica of the session's ring (agent turns and chunk prompts alike), so a replica that hashing "
        "gave more sessions spills work to the others under load. None: ray.serve.llm's default (unbounded).",
    )
    replicas: Replicas = Field(default_factory=Replicas)
    replica_cpus: float = Field(1.0, gt=0, le=64, description="Logical CPUs of the replica actor.")
    cpu_binding: CpuBinding = Field(
        "cores",
        description="CPU only: where each replica's engine computes. cores: `cpu_threads` cores of its own, by "
        "its rank on the host; auto: vLLM-CPU's choice (every engine on a host on the same cores); nobind: "
        "the OS's (serving.placement).",
    )
    cpu_threads: int | None = Field(
        None,
        ge=1,
        le=512,
        description="CPU only, binding cores: cores (compute threads) per replica. None: the host's cores shared "
        "evenly by the replicas that may run on it (replicas_per_host, else replicas.max).",
    )
    replicas_per_host: int | None = Field(
        None, ge=1, le=1024, description="At most this many replicas on one node (Serve's max_replicas_per_node)."
    )
    background_step_tokens: int | None = Field(
        None,
        ge=16,
        le=1_048_576,
        description="Token budget of an engine step led by background compaction, so an agent request that "
        "arrives waits one small step (compaction.pacing); None: the engine's max_num_batched_tokens.",
    )
    background_decode_beside: bool = Field(
        True,
        description="Background requests decode beside the agent's (a batched decode step costs about what a "
        "single one does on a GPU); false holds them back too (measured better on the CPU).",
    )
    next_step_tokens: int = Field(
        64,
        ge=0,
        le=1_048_576,
        description="Tokens of an agent-led engine step that the work the agent's next turn waits for (a rolling "
        "session's last run before its threshold) may prefill beside it; it also decodes beside it "
        "(compaction.pacing.NEXT). 0: that work runs as other background work does, in the agent's tool gaps.",
    )
    background_beside_tokens: int = Field(
        0,
        ge=0,
        le=1_048_576,
        description="Tokens of an agent-led engine step that background compaction may prefill beside it (0: none, "
        "it waits for a step without agent work; the CPU's measured rule). On a busy GPU engine some agent request "
        "is always decoding, so 0 would starve background work there.",
    )
    max_chunks: int | None = Field(
        None,
        ge=1,
        le=65_536,
        description="Chunk prompts one compaction may plan; more get 422 naming the chunk_tokens that fits. None: "
        "the sequences one replica batches (batch_sequences(): max_num_seqs, 128 on the CPU, 1,024 on an H100), "
        "so a compaction's prompts fit one engine's batch (compaction.partition).",
    )
    max_history_tokens: int | None = Field(
        None,
        ge=512,
        le=67_108_864,
        description="Tokens a history to compact may render to; more get 422. None: 16 model windows "
        "(compaction.partition.HISTORY_WINDOWS x max_model_len: 131,072 for an 8,192-token window).",
    )
    default_max_tokens: int | None = Field(
        None,
        ge=1,
        le=1_048_576,
        description="The reply budget of a turn that sets none (an agent CLI often does not); None: the room left "
        "in the window, as vLLM would.",
    )
    tool_call_parser: str | None = Field(
        None,
        min_length=1,
        description="vLLM's tool-call parser for this model's output (hermes, llama3_json, openai, ...): requests "
        "with tools (tool_choice auto, required or named) are served and calls come back as tool calls. None: "
        "the engine refuses tools.",
    )
    reasoning_parser: str | None = Field(
        None,
        min_length=1,
        description="vLLM's reasoning parser for a reasoning model (openai_gptoss, ...): its reasoning is kept out "
        "of the answer's content.",
    )
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="Extra vLLM engine arguments.")
    description: str = ""

    @model_validator(mode="after")
    def _gpu_fields(self) -> ModelSpec:
        if self.device == "gpu" and not self.accelerator_type:
            raise ValueError(f"{self.name}: a GPU model needs accelerator_type")
        if self.device == "cpu" and self.tensor_parallel_size != 1:
            raise ValueError(f"{self.name}: the CPU engine runs tensor_parallel_size 1")
        if self.device == "gpu" and (self.weights_gib <= 0 or self.kv_bytes_per_token <= 0):
            raise ValueError(f"{self.name}: a GPU model needs weights_gib and kv_bytes_per_token for sizing")
        if self.window_kv_bytes_per_token and not self.sliding_window:
            raise ValueError(f"{self.name}: window_kv_bytes_per_token needs sliding_window")
        modelled = sorted(FIELD_ENGINE_ARGS & self.engine_kwargs.keys())
        if modelled:
            raise ValueError(f"{self.name}: set {modelled} as catalogue fields, not in engine_kwargs")
        reserved = sorted(RESERVED_ENGINE_ARGS & self.engine_kwargs.keys())
        if reserved:
            raise ValueError(f"{self.name}: {reserved} are the service's (priority scheduling); leave them out")
        return self

    def resolved_source(self) -> str:
        """The path or repo id vLLM loads; `cpu-default` becomes the converted SmolLM2 folder."""
        if self.source == CPU_DEFAULT_SOURCE:
            from serving.weights import model_dir

            return str(model_dir())
        return self.source

    def batch_sequences(self) -> int:
        """Sequences one replica's engine runs at once (vLLM max_num_seqs, as vLLM would default it)."""
        if self.max_num_seqs is not None:
            return self.max_num_seqs
        if self.device == "cpu":
            return DEFAULT_MAX_NUM_SEQS["cpu"]
        return DEFAULT_MAX_NUM_SEQS["gpu_large" if self.accelerator_type in LARGE_GPUS else "gpu"]

    def plan_limits(self) -> PlanLimits:
        """The caps on one compaction's work for this model: the catalogue's, else the defaults of its window
        and engine batch (compaction.partition)."""
        default = PlanLimits.for_window(self.max_model_len, self.batch_sequences())
        return PlanLimits(self.max_chunks or default.max_chunks, self.max_history_tokens or default.max_history_tokens)

    def engine_args(self) -> dict[str, Any]:
        """vLLM engine arguments: prefix caching and chunked prefill on, prompt-cache details reported,
        priority scheduling with background compaction yielding to the agent (serving.scheduler)."""
        args: dict[str, Any] = {
            "max_model_len": self.max_model_len,
            "enable_prefix_caching": True,
            "enable_chunked_prefill": True,
            "enable_prompt_tokens_details": True,
            "tensor_parallel_size": self.tensor_parallel_size,
            **yielding_engine_args(self.device, self.yield_rule()),
        }
        if self.device == "cpu":
            args |= {"dtype": cpu_dtype(), "enforce_eager": True}
        else:
            args |= {"block_size": self.block_size, "gpu_memory_utilization": self.gpu_memory_utilization}
            if self.kv_cache_dtype != "auto":
                args["kv_cache_dtype"] = self.kv_cache_dtype
        if self.quantization:
            args["quantization"] = self.quantization
        if self.max_num_seqs is not None:
            args["max_num_seqs"] = self.max_num_seqs
        if self.tool_call_parser:
            args |= {"enable_auto_tool_choice": True, "tool_call_parser": self.tool_call_parser}
        if self.reasoning_parser:
            args["reasoning_parser"] = self.reasoning_parser
        return args | self.engine_kwargs

    def llm_config(self) -> Any:
        """This entry as a ray.serve.llm LLMConfig (validated by Ray's own model)."""
        from ray.serve.llm import LLMConfig

        autoscaling: dict[str, Any] = {
            "min_replicas": self.replicas.min,
            "max_replicas": self.replicas.max,
            "initial_replicas": self.replicas.initial,
        }
        if self.replicas.target_ongoing_requests is not None:
            autoscaling["target_ongoing_requests"] = self.replicas.target_ongoing_requests
        deployment: dict[str, Any] = {
            "autoscaling_config": autoscaling,
            "ray_actor_options": {"num_cpus": self.replica_cpus},
        }
        if self.replicas_per_host is not None:
            deployment["max_replicas_per_node"] = self.replicas_per_host
        if self.max_ongoing_requests is not None:
            deployment["max_ongoing_requests"] = self.max_ongoing_requests
        if self.replica_resources:
            deployment["ray_actor_options"]["resources"] = dict(self.replica_resources)
        config: dict[str, Any] = {
            "model_loading_config": {"model_id": self.name, "model_source": self.resolved_source()},
            "engine_kwargs": self.engine_args(),
            "deployment_config": deployment,
            "log_engine_metrics": True,
        }
        if Path(config["model_loading_config"]["model_source"]).is_dir():
            config["callback_config"] = {"callback_class": "serving.node_init.LocalWeights"}
        if self.device == "gpu":
            config["accelerator_type"] = self.accelerator_type
            config["placement_group_config"] = {
                "bundles": [{"CPU": 1, "GPU": 1}] * self.tensor_parallel_size,
                "strategy": "STRICT_PACK",
            }
        else:
            config["placement_group_config"] = {"bundles": [{"CPU": self.replica_cpus * 2}]}
            config["runtime_env"] = {
                "env_vars": {"VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib), "HF_HUB_OFFLINE": "1", **CPU_ENGINE_ENV}
            }
        return LLMConfig(**config)

    def host_parallelism(self, host_cores: int, replicas: int | None = None) -> int:
        """How many of `replicas` (default replicas.max) replicas one host of `host_cores` cores runs at full speed
        at once: each on cores of its own with binding `cores`, else one (they share the same cores)."""
        count = replicas or self.replicas.max
        if self.device != "cpu" or self.cpu_binding != "cores":
            return 1
        each = self.cpu_threads or max(1, host_cores // max(1, min(self.replicas_per_host or count, host_cores)))
        return max(1, min(count, host_cores // each))

    def yield_rule(self) -> YieldRule:
        """How background compaction yields to the agent on this model's engines (compaction.pacing)."""
        return YieldRule(
            self.background_step_tokens,
            self.background_decode_beside,
            self.next_step_tokens,
            self.background_beside_tokens,
        )

    def server_kwargs(self) -> dict[str, Any]:
        """Constructor arguments of this model's server class beyond the LLMConfig (serving.placement)."""
        if self.device != "cpu":
            return {}
        per_host = self.replicas_per_host or self.replicas.max
        return {"cpu_binding": self.cpu_binding, "cpu_threads": self.cpu_threads, "per_host": per_host}


class Catalogue(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    models: list[ModelSpec] = Field(min_length=1)

    @cached_property
    def by_name(self) -> dict[str, ModelSpec]:
        return {m.name: m for m in self.models}

    @model_validator(mode="after")
    def _unique(self) -> Catalogue:
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate model names in {names}")
        return self

    def get(self, name: str) -> ModelSpec:
        if name not in self.by_name:
            raise UnknownModel("model", f"unknown model {name!r}; hosted: {sorted(self.by_name)}")
        return self.by_name[name]


def load_catalogue(path: str | Path | None = None) -> Catalogue:
    """Read and validate a catalogue YAML (default: the one shipped with the package)."""
    file = Path(path) if path else DEFAULT_CATALOGUE
    try:
        return Catalogue.model_validate(yaml.safe_load(file.read_text()))
    except (OSError, yaml.YAMLError) as exc:
        raise InvalidInput("catalogue", f"cannot read {file}: {exc}") from exc
    except ValidationError as exc:
        raise InvalidInput("catalogue", f"{file} is invalid: {exc}") from exc


def yielding_engine_args(device: Literal["cpu", "gpu"], rule: YieldRule) -> dict[str, Any]:
    """Engine arguments of priority scheduling with background work yielding to the agent (serving.scheduler)."""
    return {"scheduling_policy": "priority", "scheduler_cls": SCHEDULERS[device], "additional_config": rule.config()}
