"""What a compaction returns: the compacted history and the stats that explain its cost."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from compaction.archive import ArchivedChunk
from compaction.checks.quality import Verdict
from compaction.history import Message

ChunkStatus = Literal["ok", "retried", "runaway_trimmed", "kept_verbatim", "extractive_fallback", "extractive"]


class ChunkStats(BaseModel):
    """One chunk's prompt(s) and summary. Token counts include the retry, if there was one."""

    model_config = ConfigDict(frozen=True)
    index: int = Field(description="0-based chunk position; summaries are merged in this order.")
    start: int = Field(description="First token of the chunk in the rendered history.")
    end: int = Field(description="One past the chunk's last token.")
    prompt_tokens: int = Field(description="Prompt tokens sent, over all attempts.")
    cached_prompt_tokens: int = Field(description="Prompt tokens the engine served from its prefix cache.")
    computed_prefill_tokens: int = Field(description="prompt_tokens - cached_prompt_tokens.")
    output_tokens: int = Field(description="Tokens generated, over all attempts.")
    summary_tokens: int = Field(description="Tokens of the summary text kept for this chunk.")
    latency_s: float = Field(description="Wall time from dispatch to the kept summary.")
    retries: int = Field(description="Attempts repeated because the summary was empty or a runaway.")
    failovers: int = Field(description="Times a request moved to another replica after a failure.")
    status: ChunkStatus = Field(
        description="ok; retried (a second attempt was made and a model summary kept); runaway_trimmed "
        "(repeated sentences collapsed); kept_verbatim (no usable summary, the chunk text kept so nothing is lost); "
        "extractive_fallback (the summary stayed ungrounded: the chunk's extractive summary instead); "
        "extractive (strategy extractive)."
    )
    first_verdict: Verdict | None = Field(
        default=None,
        description="The first summary: ok, empty, runaway or echo (its instructions and nothing else). None when "
        "no model was asked.",
    )
    first_grounding: float | None = Field(
        default=None,
        description="Share of the first summary's salient tokens found in the chunk or the history before it, "
        "before any retry, pruning or fallback. None when no model was asked.",
    )
    first_salient_tokens: int = Field(default=0, description="Distinct salient tokens the first summary stated.")
    first_ungrounded: list[str] = Field(
        default_factory=list, description="Salient tokens of the first summary found nowhere in its source."
    )
    grounding: float = Field(
        default=1.0, description="The same share for the text kept for this chunk (1.0 when it states none)."
    )
    salient_tokens: int = Field(default=0, description="Distinct salient tokens the kept text states.")
    ungrounded: list[str] = Field(
        default_factory=list, description="Salient tokens of the kept text found nowhere in its source."
    )
    dropped_sentences: int = Field(
        default=0,
        description="Sentences of the kept summary dropped because they stated an invented token, or facts a "
        "pinned line states.",
    )
    pinned_lines: int = Field(
        default=0, description="Salient lines of the chunk kept word for word beside its summary (pinned_share)."
    )
    content: str | None = Field(
        default=None,
        description="What the chunk's tail asked for: tool_output, code, requests or dialogue (chosen by the "
        "chunk's content), caller (its chunk_instructions entry), or None (tail_by_content off, or no model asked).",
    )
    replica: str | None = Field(default=None, description="Replica that served the kept attempt.")
    given_up: bool = Field(
        default=False,
        description="A background run asked this chunk again (a strict prompt for an echo, or both prompts after a "
        "fallback) and a turn raised the run before that answer came: the asking was given up on the engine and the "
        "chunk kept the text it had (extractive, or its first fallback).",
    )
    reused: bool = Field(
        default=False,
        description="The summary came from the chunk-summary cache (same prompt summarised before); the token "
        "and latency figures are then zero: no work was done for it.",
    )


class CompactionStats(BaseModel):
    """Totals of one compaction, from the engine's own counts."""

    model_config = ConfigDict(frozen=True)
    strategy: str
    layout: str = Field(description="The layout actually used (auto resolved), or sequential.")
    variant: str
    history_tokens: int = Field(description="Tokens of the whole rendered history.")
    input_tokens: int = Field(description="Tokens compacted (history minus kept system and recent turns).")
    chunks: int
    prompt_tokens: int
    cached_prompt_tokens: int
    computed_prefill_tokens: int
    prefill_floor_tokens: int = Field(
        description="History once plus every prompt's own tokens, in blocks (windowed: plus the overlaps)."
    )
    windows: int = Field(
        1, description="Groups of chunk prompts sharing a window start (layout windowed); 1 for the others."
    )
    output_tokens: int
    summary_tokens: int
    compacted_tokens: int = Field(description="Tokens of the compacted history, rendered.")
    latency_s: float
    retries: int
    failovers: int
    reused_chunks: int = Field(0, description="Chunks whose summary came from the chunk-summary cache.")
    carried_summary_tokens: int = Field(
        0, description="Tokens of earlier compaction summaries kept verbatim at the head (not summarised again)."
    )
    user_words_kept: int = Field(
        0, description="User messages of the compacted span kept verbatim in the compacted head (user_words_tokens)."
    )
    user_words_dropped: int = Field(0, description="User messages of the span over that budget: only summarised.")
    user_words_tokens: int = Field(0, description="Tokens of the user-words block in the compacted head.")
    empty_or_runaway_chunks: list[int] = Field(
        description="Chunks whose first summary was empty, a runaway or an echo of its instructions."
    )
    grounding_threshold: float = Field(default=0.0, description="The grounding threshold applied (0: no check).")
    ungrounded_chunks: list[int] = Field(
        default_factory=list, description="Chunks whose first summary fell below the grounding threshold."
    )
    extractive_fallback_chunks: list[int] = Field(
        default_factory=list, description="Chunks whose kept text is the extractive fallback."
    )
    given_up_chunks: list[int] = Field(
        default_factory=list, description="Chunks whose background asking again was given up (see given_up)."
    )
    replicas: list[str | None] = Field(description="Replica of each chunk, in chunk order.")
    archived_handles: list[str] = Field(
        default_factory=list, description="With archive: the handles of the chunks stored, in chunk order."
    )
    archive_note: str | None = Field(None, description="With archive: why the chunks were not stored, if not.")
    cleared_tool_outputs: int = Field(
        0, description="With clearing: tool results and tool-call inputs replaced by a stub in the kept turns."
    )
    cleared_tokens: int = Field(0, description="With clearing: tokens the stubs saved (estimated per message).")
    ledger_entries: int = Field(0, description="With ledger_tokens: entries of the state ledger in the head.")
    ledger_tokens: int = Field(0, description="With ledger_tokens: tokens of the state ledger block.")
    omissions_repaired: int = Field(
        0,
        description="Archive handles of the summarised span and constraints of the ledger that the compacted history "
        "had lost, written back verbatim in its head by the omission check.",
    )
    per_chunk: list[ChunkStats]


class CompactionResult(BaseModel):
    model_config = ConfigDict(frozen=True)
    messages: list[Message] = Field(description="The compacted history: kept system turns, summary, recent turns.")
    summary: str = Field(description="The merged chunk summaries, in chunk order.")
    kept_head: int = Field(
        0, description="Leading input messages kept verbatim before the summary (system messages, carried summaries)."
    )
    replaces_through: int = Field(
        0,
        description="Index of the first input message kept as it was sent: "
        "messages == messages[:head_messages] + input[replaces_through:].",
    )
    head_messages: int = Field(
        description="Leading messages that stand for input[:replaces_through]: the kept head, the summary, and the "
        "turns kept with their tool output cleared (clearing): messages[:kept_head] == input[:kept_head].",
    )
    stats: CompactionStats
    archived: list[ArchivedChunk] = Field(
        default_factory=list, exclude=True, description="With archive: each chunk's text, for the store (not sent)."
    )
