"""GPU memory arithmetic for one catalogue entry: do its weights, runtime reserve and KV cache fit?

vLLM takes `gpu_memory_utilization` of each GPU's memory. Out of that budget come the weights (split evenly over
the tensor-parallel GPUs), a runtime reserve (activation peak at max_num_batched_tokens, CUDA graphs, NCCL and
cuBLAS workspaces), and the KV cache. The engine refuses to start unless the KV cache holds at least one
`max_model_len` sequence, so that is the fit condition. KV heads are split over the TP ranks, so per-GPU KV bytes
per token are the model's divided by tensor_parallel_size. Sliding-window layers (gpt-oss) keep only the window
plus one block per sequence, so they cost a constant per sequence, not per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from serving.models import ModelSpec

GIB = 2**30
# What CUDA reports as the total memory of an H100 SXM 80GB (nvidia-smi shows 81,559 MiB, part of it held by the
# driver); vLLM multiplies this total by gpu_memory_utilization.
H100_80GB_GIB = 79.1
# An H100 NVL (94 GB HBM3, Azure NC40ads/NC80adis H100 v5): 99,961,274,368 bytes of device memory as the driver reports
# it (fastfetch-cli/fastfetch#1658, "NVIDIA H100 NVL" ... "total": 99961274368) = 93.1 GiB.
H100_NVL_GIB = 93.1
# KV bytes relative to bf16.
KV_DTYPE_SCALE = {"auto": 1.0, "fp8": 0.5}


@dataclass(frozen=True)
class GpuFit:
    """Per-GPU memory plan of one replica. All sizes are per GPU."""

    model: str
    device_gib: float  # memory of one GPU
    gpus: int  # GPUs per replica = tensor_parallel_size
    budget_gib: float  # gpu_memory_utilization x device memory: what vLLM may take
    weights_gib: float  # the weights' share on this GPU
    reserve_gib: float  # activations, CUDA graphs, communication buffers
    kv_gib: float  # what is left for the KV cache (negative: the weights alone do not fit)
    kv_bytes_per_token: float  # full-attention layers, at the configured KV dtype
    window_bytes_per_sequence: float  # sliding-window layers, one sequence
    kv_tokens: int  # full-length tokens the KV cache holds (0 when nothing is left)
    max_model_len: int

    @property
    def fits(self) -> bool:
        """True when the KV cache holds one max_model_len sequence (vLLM's own start-up condition)."""
        return self.kv_tokens >= self.max_model_len

    @property
    def sequences(self) -> float:
        """How many full-length sequences the KV cache holds."""
        return self.kv_tokens / self.max_model_len

    def row(self) -> str:
        return (
            f"{self.model:<27} {self.gpus} x {self.device_gib:4.1f} GiB, budget {self.budget_gib:5.1f} GiB"
            f" = weights {self.weights_gib:5.1f} + reserve {self.reserve_gib:4.1f} + KV {self.kv_gib:5.1f} GiB"
            f" -> {self.kv_tokens:>9,} tokens,"
            f" max_model_len {self.max_model_len:,} x{self.sequences:.2f} {'fits' if self.fits else 'DOES NOT FIT'}"
        )


def gpu_fit(spec: ModelSpec, device_gib: float | None = None) -> GpuFit:
    """The per-GPU memory plan of a GPU catalogue entry on GPUs with `device_gib` of memory each.

    Default: the entry's own `device_memory_gib`, else an H100 80GB.
    """
    device_gib = device_gib or spec.device_memory_gib or H100_80GB_GIB
    if spec.device != "gpu":
        raise ValueError(f"{spec.name}: sizing applies to GPU models, this one runs on the {spec.device}")
    tp = spec.tensor_parallel_size
    scale = KV_DTYPE_SCALE[spec.kv_cache_dtype]
    budget = spec.gpu_memory_utilization * device_gib
    weights = spec.weights_gib / tp
    kv_gib = budget - weights - spec.runtime_reserve_gib
    per_token = spec.kv_bytes_per_token * scale / tp
    window_tokens = (spec.sliding_window or 0) + spec.block_size
    window = spec.window_kv_bytes_per_token * scale / tp * window_tokens
    tokens = max(0, math.floor((kv_gib * GIB - window) / per_token))
    return GpuFit(
        model=spec.name,
        device_gib=device_gib,
        gpus=tp,
        budget_gib=budget,
        weights_gib=weights,
        reserve_gib=spec.runtime_reserve_gib,
        kv_gib=kv_gib,
        kv_bytes_per_token=per_token,
        window_bytes_per_sequence=window,
        kv_tokens=tokens,
        max_model_len=spec.max_model_len,
    )


def main() -> None:
    """Print the memory plan of every GPU model in the shipped catalogue."""
    from serving.models import load_catalogue

    for spec in load_catalogue().models:
        if spec.device == "gpu":
            print(gpu_fit(spec).row())


if __name__ == "__main__":
    main()
