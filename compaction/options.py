"""What a caller can ask of one compaction: pydantic at the edge, frozen once validated."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from compaction.errors import InvalidInput

Strategy = Literal["parallel", "sequential"]
Layout = Literal["auto", "prefix_exact", "windowed", "prefix_exact_marked", "paper", "independent", "shared_full"]
Variant = Literal["concise", "default", "detailed"]
# The layouts the layout benchmark compares (auto resolves to prefix_exact or windowed).
LAYOUTS: tuple[Layout, ...] = ("prefix_exact", "prefix_exact_marked", "paper", "independent", "shared_full")
VARIANTS: tuple[Variant, ...] = ("concise", "default", "detailed")


class CompactionOptions(BaseModel):
    """How to compact. Every field has a bound; unknown fields are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    strategy: Strategy = Field(
        "parallel", description="parallel: one prompt per chunk, all at once; sequential: one prompt overall."
    )
    chunk_tokens: int = Field(
        2048, ge=1, le=1_048_576, description="B, the chunk size in tokens (parallel); N = ceil(|X| / B)."
    )
    layout: Layout = Field(
        "auto",
        description=(
            "How chunk prompts are built. auto: prefix_exact when every chunk prompt fits the model window, "
            "else windowed; prefix_exact: the raw history up to the chunk, target named at the tail; "
            "windowed: the kept system messages, then as much history before the chunk as fits, consecutive "
            "chunks sharing a start; prefix_exact_marked: every chunk between identical segment markers; paper: "
            "chunk k wrapped in <target> tags after chunks 1..k-1; independent: chunk k alone; "
            "shared_full: the whole snapshot with chunk k wrapped in <target> tags."
        ),
    )
    variant: Variant = Field("default", description="Instruction variant: concise, default or detailed.")
    max_chunk_summary_tokens: int = Field(
        256,
        ge=1,
        le=32_768,
        description="Output budget per chunk summary (the whole summary when sequential).",
    )
    keep_recent_tokens: int = Field(
        0, ge=0, le=1_048_576, description="Newest whole messages up to this many tokens are kept verbatim."
    )
    chunk_instructions: dict[int, str] | None = Field(
        None, description="Extra instructions for particular chunks, keyed by 0-based chunk index."
    )
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="Sampling temperature of the summaries.")
    retry_bad_summaries: bool = Field(
        True, description="Retry an empty or runaway chunk summary once with a stricter tail."
    )
    fixed_output_tokens: bool = Field(
        False,
        description="Benchmarks only: every summary emits exactly its budget, to compare at matched decode volume.",
    )

    @classmethod
    def parse(cls, raw: Mapping[str, Any] | CompactionOptions | None) -> CompactionOptions:
        """Validate caller data; any problem becomes one InvalidInput naming the field."""
        if isinstance(raw, CompactionOptions):
            return raw
        try:
            return cls.model_validate(dict(raw or {}))
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or "options"
            raise InvalidInput(field, first["msg"]) from exc
