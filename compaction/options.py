"""What a caller can ask of one compaction: pydantic at the edge, frozen once validated."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from compaction.errors import InvalidInput

Strategy = Literal["parallel", "sequential", "extractive"]
Layout = Literal["auto", "prefix_exact", "windowed", "prefix_exact_marked", "paper", "independent", "shared_full"]
Variant = Literal["concise", "default", "detailed"]
Clearing = Literal["auto", "off", "only"]
# The layouts the layout benchmark compares (auto resolves to prefix_exact or windowed).
LAYOUTS: tuple[Layout, ...] = ("prefix_exact", "prefix_exact_marked", "paper", "independent", "shared_full")
VARIANTS: tuple[Variant, ...] = ("concise", "default", "detailed")
# Retry/fallback below 70 % grounded salient tokens, prune above. The retention benchmark's `thresholds`
# block (jobs/configs/retention-cpu.yaml) measures recall, invention and fallbacks at 0, 0.7 and 0.9.
GROUNDING_THRESHOLD = 0.7
STRATEGIES: tuple[Strategy, ...] = ("parallel", "sequential", "extractive")
# The paper's companion repository samples its summaries with 1.05 (docs/benchmarks.md: runaway summaries).
REPETITION_PENALTY = 1.05
LEDGER_SHARE = 0.05  # of the model window, the state ledger's default budget (docs/benchmarks.md: the chain)
# Three quarters of each chunk's budget for pinned lines (docs/benchmarks.md: the retention sweep).
PINNED_SHARE = 0.75


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
    repetition_penalty: float = Field(
        REPETITION_PENALTY,
        ge=1.0,
        le=2.0,
        description="Repetition penalty of the summaries' first attempt (a retry uses at least 1.3). 1 turns it off.",
    )
    user_words_tokens: int | None = Field(
        None,
        ge=0,
        le=1_048_576,
        description="The user's own messages of the compacted span are kept verbatim in the compacted head, newest "
        "first while together they fit this many tokens (deduplicated, written oldest first); older ones are only "
        "summarised. Tool results never count. None: 7.5 % of the model window (Codex keeps 20,000 tokens of a "
        "272k window). 0 keeps none.",
    )
    pinned_share: float = Field(
        PINNED_SHARE,
        ge=0.0,
        le=0.9,
        description="parallel, sequential: share of each chunk's budget kept for the chunk's most salient lines "
        "word for word (the extractive ranking), beside the model's summary of it; the pinned lines also take "
        "whatever the summary leaves unused, and a line whose facts the summary already states is not pinned. "
        "0: the model's summary alone (the strategy extractive pins lines only).",
    )
    tail_by_content: bool = Field(
        True,
        description="Each chunk's tail asks for what its content holds (tool output and logs, code and diffs, "
        "dialogue, the user's requests; named per chunk in the stats as `content`). A chunk_instructions entry "
        "replaces the choice for its chunk.",
    )
    retry_bad_summaries: bool = Field(
        True, description="Retry an empty, runaway or ungrounded chunk summary once with a stricter tail."
    )
    archive: bool = Field(
        False,
        description="Archive each summarised chunk verbatim (per tenant, where the service has an archive) and write "
        "its handle after its summary ([archived: arc-…]); the agent recalls it through the service's MCP endpoint "
        "(recall, search_history). The stats list the handles stored.",
    )
    clearing: Clearing = Field(
        "auto",
        description="Old tool output cleared before anything is summarised (compaction.clearing): each tool result "
        "of the span becomes a one-line stub (its size, how it began, and with archive its handle), long tool-call "
        "arguments too. auto: the newest turns of the span cleared and kept, the older ones summarised, as much "
        "cleared as fits the room a summary of the whole span would take (no model call when all of it fits); "
        "only: the whole span cleared, nothing summarised; off: summaries only.",
    )
    ledger_tokens: int | None = Field(
        None,
        ge=0,
        le=65_536,
        description="A state ledger in the compacted head of a history with tool calls, kept verbatim and carried "
        "across compactions (compaction.ledger): files read and modified, commands and their outcome, open errors, "
        "the task list, the user's constraints, the agent's decisions; at most this many tokens (over it, what is "
        "easiest to find again goes first: files only read, commands that passed; files modified and the "
        "constraints last). None: 5 % of the model window (chat-side: of compact_threshold). 0: no ledger.",
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

    def options(self) -> CompactionOptions:
        """The compaction options alone, of a request that extends them (its own fields left out)."""
        return CompactionOptions.model_validate(self.model_dump(include=set(CompactionOptions.model_fields)))


def model_budget(options: CompactionOptions) -> int:
    """Tokens the model's summary of one chunk may use: the budget less the pinned share."""
    budget = options.max_chunk_summary_tokens
    if options.strategy == "extractive" or options.pinned_share == 0:
        return budget
    return max(1, round(budget * (1 - options.pinned_share)))
