"""What a caller can ask of one compaction: pydantic at the edge, frozen once validated."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from compaction.errors import InvalidInput

Strategy = Literal["parallel", "sequential", "extractive"]
Layout = Literal["auto", "prefix_exact", "windowed", "prefix_exact_marked", "paper", "independent", "shared_full"]
Variant = Literal["concise", "default", "detailed"]
# The layouts the layout benchmark compares (auto resolves to prefix_exact or windowed).
LAYOUTS: tuple[Layout, ...] = ("prefix_exact", "prefix_exact_marked", "paper", "independent", "shared_full")
VARIANTS: tuple[Variant, ...] = ("concise", "default", "detailed")
# Retry/fallback below 70 % grounded salient tokens, prune above. The retention benchmark's `thresholds`
# block (jobs/configs/retention-cpu.yaml) measures recall, invention and fallbacks at 0, 0.7 and 0.9.
GROUNDING_THRESHOLD = 0.7
STRATEGIES: tuple[Strategy, ...] = ("parallel", "sequential", "extractive")


class CompactionOptions(BaseModel):
    """How to compact. Every field has a bound; unknown fields are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    strategy: Strategy = Field(
        "parallel",
        description="parallel: one prompt per chunk, all at once; sequential: one prompt overall; extractive: "
        "no model, the most salient lines of each chunk kept verbatim within the budget.",
    )
    chunk_tokens: int = Field(
        2048, ge=1, le=1_048_576, description="B, the chunk size in tokens (parallel, extractive); N = ceil(|X| / B)."
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
    grounding_threshold: float = Field(
        GROUNDING_THRESHOLD,
        ge=0.0,
        le=1.0,
        description="Least share of a summary's salient tokens (numbers, identifiers, paths, quotes, names) that "
        "must occur in its chunk or the history before it. Below it the summary is retried once with a stricter "
        "tail, then replaced by the chunk's extractive summary; above it, sentences stating an invented token "
        "are dropped. 0 turns the check off (scores are still reported).",
    )
    keep_recent_tokens: int = Field(
        0, ge=0, le=1_048_576, description="Newest whole messages up to this many tokens are kept verbatim."
    )
    keep_current_turn: bool = Field(
        False,
        description="Also keep the agent's current turn verbatim: the last user message and everything after it "
        "(on by default in chat-side compaction).",
    )
    carry_summary_tokens: int = Field(
        4096,
        ge=0,
        le=1_048_576,
        description="Summaries of earlier compactions at the head of the history are carried verbatim (not "
        "summarised again) while together they stay within this many tokens; beyond it they are summarised "
        "again, as chunks of their own (a second level). 0 always summarises them again.",
    )
    reuse_chunks: bool = Field(
        True,
        description="Take a chunk's summary from the chunk-summary cache when an earlier compaction summarised "
        "the same prompt (reported as reused_chunks). False summarises every chunk afresh (cold benchmarks).",
    )
    chunk_instructions: dict[int, str] | None = Field(
        None, description="Extra instructions for particular chunks, keyed by 0-based chunk index."
    )
    instructions: str | None = Field(
        None,
        min_length=1,
        max_length=8192,
        description="Extra instructions for every summary, at the end of each chunk prompt's tail (after the "
        "chunk's own chunk_instructions). Like those, they count as a source of the summary's facts.",
    )
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="Sampling temperature of the summaries.")
    retry_bad_summaries: bool = Field(
        True, description="Retry an empty, runaway or ungrounded chunk summary once with a stricter tail."
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
