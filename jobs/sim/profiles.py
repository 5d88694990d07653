"""Engine profiles: how fast one replica prefills and decodes, and how much KV it holds, from cited figures.

A profile YAML keeps the published figures themselves (a time to first token at a prompt length, inter-token
latencies at a few batch sizes), each with its source; the speed model is derived from them here:

    prefill seconds for prompt tokens [a, b) = (b - a) / prefill_tokens_per_s + attention_s * (b^2 - a^2) / 2
    decode step seconds = decode_base_s + decode_seq_s * batch + kv_read_s_per_token * (context tokens in the batch)

`attention_s` is the attention FLOPs per token per context token (4 x layers x heads x head_dim) at the FLOP rate the
linear part implies (2 x active parameters x prefill_tokens_per_s); `kv_read_s_per_token` is the KV bytes one decode
step reads per context token over the memory bandwidth. Both come from the model's config and the hardware sheet, so
a profile's only fitted numbers are the prefill rate and the decode base and per-sequence cost.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from compaction.errors import InvalidInput

PROFILES = Path(__file__).with_name("profiles")


class Source(BaseModel):
    """Where a figure comes from."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    figure: str = Field(min_length=1, description="The figure as published (or the measurement that produced it).")
    url: str = Field(min_length=1, description="The page (or command) it comes from.")


class PrefillPoint(BaseModel):
    """One measured cold prefill: `tokens` prompt tokens took `seconds` (a time to first token)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    tokens: int = Field(ge=1, le=1_048_576, description="Prompt tokens, none served from cache.")
    seconds: float = Field(gt=0, le=3600, description="Time to the first output token.")


class DecodePoint(BaseModel):
    """One measured decode step: `batch` sequences of about `context` tokens each took `seconds` per step."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    batch: int = Field(ge=1, le=4096, description="Sequences decoding together (concurrency).")
    context: int = Field(ge=0, le=1_048_576, description="Tokens in context per sequence (prompt + half the output).")
    seconds: float = Field(gt=0, le=60, description="Seconds per decode step (inter-token latency).")


class EngineProfile(BaseModel):
    """One model on one replica's hardware."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(pattern=r"^[a-z0-9_.-]+$", description="Profile id (the file's stem).")
    model: str = Field(min_length=1, description="Catalogue model name (serving/catalogue.yaml).")
    hardware: str = Field(min_length=1, description="What one replica runs on, in words.")
    block_size: int = Field(ge=1, le=1024, description="Prefix-cache block of the engine, in tokens.")
    kv_tokens: int = Field(ge=1024, le=100_000_000, description="Tokens of KV cache one replica holds.")
    max_num_seqs: int = Field(ge=1, le=4096, description="Sequences the engine runs at once (vLLM max_num_seqs).")
    max_batched_tokens: int = Field(
        ge=16, le=1_048_576, description="Tokens one engine step computes (vLLM max_num_batched_tokens)."
    )
    active_params_b: float = Field(gt=0, le=2000, description="Parameters used per token, in billions.")
    attention_layers: int = Field(ge=0, le=512, description="Full-attention layers (sliding-window layers excluded).")
    attention_width: int = Field(ge=1, le=65_536, description="Query heads x head dim of one attention layer.")
    kv_bytes_per_token: float = Field(gt=0, description="KV bytes one token adds, per GPU (full-attention layers).")
    memory_bytes_per_s: float = Field(gt=0, description="Device memory bandwidth a decode step reads the KV at.")
    host_parallelism: int | None = Field(
        None,
        ge=1,
        le=4096,
        description="Replicas sharing one host's compute that run at full speed at once (busy replicas beyond it "
        "slow each other down in proportion); None: every replica has hardware of its own (a GPU each).",
    )
    prefill: PrefillPoint = Field(description="A cold prefill measurement.")
    decode: list[DecodePoint] = Field(min_length=1, description="Decode steps at one or more batch sizes.")
    sources: list[Source] = Field(min_length=1, description="Where every figure above comes from.")

    @model_validator(mode="after")
    def _two_batches_or_one(self) -> EngineProfile:
        if len({p.batch for p in self.decode}) != len(self.decode):
            raise ValueError("decode points need distinct batch sizes")
        return self

    @cached_property
    def kv_read_s_per_token(self) -> float:
        return self.kv_bytes_per_token / self.memory_bytes_per_s

    @cached_property
    def _attention_flops(self) -> float:
        return 4.0 * self.attention_layers * self.attention_width

    @cached_property
    def prefill_tokens_per_s(self) -> float:
        """The linear prefill rate: the reference prefill's time minus its attention share."""
        n, flops_per_token = self.prefill.tokens, 2e9 * self.active_params_b
        return (n + self._attention_flops * n * n / 2 / flops_per_token) / self.prefill.seconds

    @cached_property
    def attention_s(self) -> float:
        return self._attention_flops / (2e9 * self.active_params_b * self.prefill_tokens_per_s)

    def prefill_seconds(self, start: int, end: int) -> float:
        """Seconds to compute prompt tokens [start, end) with [0, start) already in the KV cache."""
        return (end - start) / self.prefill_tokens_per_s + self.attention_s * (end * end - start * start) / 2

    @cached_property
    def _decode_fit(self) -> tuple[float, float]:
        """(base, per sequence) of the decode step, least squares over the points after their KV reads."""
        xs = [float(p.batch) for p in self.decode]
        ys = [p.seconds - self.kv_read_s_per_token * p.batch * p.context for p in self.decode]
        if len(xs) == 1:
            return ys[0], 0.0
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
        slope = max(0.0, slope)
        return max(1e-5, my - slope * mx), slope

    def decode_step_s(self, batch: int, context_tokens: float) -> float:
        """Seconds per decode step of `batch` sequences holding `context_tokens` tokens in all."""
        base, per_seq = self._decode_fit
        return base + per_seq * batch + self.kv_read_s_per_token * context_tokens

    def summary(self) -> str:
        base, per_seq = self._decode_fit
        return (
            f"{self.name}: prefill {self.prefill_tokens_per_s:,.0f} tok/s (+attention), decode step "
            f"{1000 * base:.2f} ms + {1000 * per_seq:.3f} ms/seq + {1e6 * self.kv_read_s_per_token:.3f} us per "
            f"context token, KV {self.kv_tokens:,} tokens, block {self.block_size}"
        )


def load_profile(name_or_path: str | Path) -> EngineProfile:
    """A profile by name (a file in jobs/sim/profiles) or by path."""
    path = PROFILES / f"{name_or_path}.yaml"
    if not path.exists():
        path = Path(name_or_path)
    if not path.exists():
        known = sorted(p.stem for p in PROFILES.glob("*.yaml"))
        raise InvalidInput("profile", f"no profile {name_or_path!r}; known: {known} (or give a YAML path)")
    try:
        return EngineProfile.model_validate(yaml.safe_load(path.read_text()))
    except (OSError, yaml.YAMLError, ValidationError) as exc:
        raise InvalidInput("profile", f"{path} is invalid: {exc}") from exc


def profile_names() -> list[str]:
    return sorted(p.stem for p in PROFILES.glob("*.yaml"))
