"""Measure the real CPU engine and write its profile: prefill rate, decode step at batch 1 and batch B.

Three measurements through any `compaction.backend.Backend` (the in-process engine, or the service over HTTP with
a session id so every request lands on one replica), a few seconds each on SmolLM2 / vLLM-CPU:
  1. a cold prompt of `cold_tokens` tokens (a fresh nonce in front, so nothing is cached), 1 output token:
     its time is the prefill (the profile's reference point);
  2. the same prompt again (now cached) with exactly `decode_tokens` output tokens: decode at batch 1;
  3. `batch` copies with distinct short endings, sent together, each with `decode_tokens` forced outputs:
     decode at batch `batch` (their short prefills are subtracted with the rate from step 1).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Sequence
from pathlib import Path

import yaml

from compaction.backend import Backend, Generation, GenerationRequest
from compaction.tokenizer import ChatTokenizer
from jobs.sim.profiles import DecodePoint, EngineProfile, PrefillPoint, Source
from serving.cpu import cpu_dtype, dtype_bytes

CPU_MEMORY_BYTES_PER_S = 20e9  # nominal DRAM bandwidth; at the calibration context it only shifts the decode base


def model_facts(model_path: Path) -> dict[str, float]:
    """Sizes the profile needs from a Hugging Face config.json."""
    config = json.loads((model_path / "config.json").read_text())
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    layers = config["num_hidden_layers"]
    return {
        "attention_layers": layers,
        "attention_width": config["num_attention_heads"] * head,
        # K and V, in the dtype the CPU engines run (serving.cpu.cpu_dtype)
        "kv_bytes_per_token": layers * config["num_key_value_heads"] * head * 2 * dtype_bytes(cpu_dtype()),
    }


async def _timed(backend: Backend, ids: Sequence[int], tokens: int, key: str) -> Generation:
    request = GenerationRequest(tuple(ids), max_tokens=tokens, min_tokens=tokens, routing_key=key)
    return await backend.generate(request)


async def measure(
    backend: Backend, prompt: Sequence[int], *, decode_tokens: int = 48, batch: int = 6
) -> tuple[PrefillPoint, list[DecodePoint], list[str]]:
    """The three measurements (see the module docstring); `prompt` must not be cached anywhere yet."""
    key = f"calibrate-{uuid.uuid4().hex[:8]}"
    cold = await _timed(backend, prompt, 1, key)
    if cold.cached_prompt_tokens:
        raise RuntimeError(f"the calibration prompt was already cached ({cold.cached_prompt_tokens} tokens)")
    rate = len(prompt) / cold.latency_s
    single = await _timed(backend, prompt, decode_tokens, key)
    step1 = (single.latency_s - single.computed_prefill_tokens / rate) / decode_tokens
    endings = [[*prompt, 1000 + 7 * i, 2000 + 11 * i, 3000 + 13 * i] for i in range(batch)]
    many = await asyncio.gather(*(_timed(backend, ids, decode_tokens, key) for ids in endings))
    prefills = sum(g.computed_prefill_tokens for g in many) / rate
    step_b = (max(g.latency_s for g in many) - prefills) / decode_tokens
    context = len(prompt) + decode_tokens // 2
    points = [DecodePoint(batch=1, context=context, seconds=round(max(step1, 1e-4), 5))]
    points.append(DecodePoint(batch=batch, context=context, seconds=round(max(step_b, step1, 1e-4), 5)))
    notes = [
        f"cold prefill of {len(prompt)} tokens: {cold.latency_s:.3f} s",
        f"{decode_tokens} forced tokens at batch 1 on the cached prompt: {single.latency_s:.3f} s "
        f"({single.computed_prefill_tokens} prompt tokens computed)",
        f"{batch} x {decode_tokens} forced tokens together: {max(g.latency_s for g in many):.3f} s "
        f"({sum(g.computed_prefill_tokens for g in many)} prompt tokens computed)",
    ]
    return PrefillPoint(tokens=len(prompt), seconds=round(cold.latency_s, 4)), points, notes


def calibration_prompt(tokenizer: ChatTokenizer, history: Sequence[int], tokens: int) -> list[int]:
    """A fresh nonce, then `history` cut to `tokens` tokens in all: never cached before."""
    nonce = tokenizer.encode(f"Calibration run {uuid.uuid4().hex}.\n")
    return [*nonce, *history][:tokens]


async def calibrate(
    backend: Backend,
    prompt: Sequence[int],
    *,
    model_path: Path,
    block_size: int,
    kv_tokens: int,
    where: str,
    decode_tokens: int = 48,
    batch: int = 6,
    host_parallelism: int = 1,
) -> EngineProfile:
    """A CPU profile of SmolLM2 on vLLM-CPU from live measurements.

    `host_parallelism`: replicas of this machine that run at full speed at once: with each replica on cores of its
    own (`serving.placement`), as many as the host has such core sets (`ModelSpec.host_parallelism`); with
    vLLM's automatic binding every engine computes on the same cores, so two busy replicas each run at half speed: 1.
    """
    prefill, decode, notes = await measure(backend, prompt, decode_tokens=decode_tokens, batch=batch)
    return EngineProfile(
        name="cpu-smollm2",
        model="smollm2-135m-instruct",
        hardware="vLLM-CPU replicas on this machine's cores",
        host_parallelism=host_parallelism,
        block_size=block_size,
        kv_tokens=kv_tokens,
        max_num_seqs=128,  # vLLM's CPU defaults for the OpenAI server, which ray.serve.llm uses
        max_batched_tokens=2048,
        active_params_b=0.135,
        memory_bytes_per_s=CPU_MEMORY_BYTES_PER_S,
        prefill=prefill,
        decode=decode,
        sources=[Source(figure=note, url=where) for note in notes],
        **model_facts(model_path),
    )


def write_profile(profile: EngineProfile, path: Path) -> Path:
    header = "# Measured by `python -m jobs.sim calibrate` (figures are this machine's; re-run to refresh).\n"
    path.write_text(header + yaml.safe_dump(profile.model_dump(), sort_keys=False))
    return path


def cpu_kv_tokens(kv_cache_gib: int, model_path: Path) -> int:
    """Tokens a vLLM-CPU replica's KV cache holds: VLLM_CPU_KVCACHE_SPACE over the bytes one token takes."""
    return int(kv_cache_gib * 2**30 // model_facts(model_path)["kv_bytes_per_token"])
