"""Caps on the work one compaction may plan, per model: chunks per compaction and history tokens.

Planning and running a compaction grow with its chunk count N and its history H (each chunk is one
prompt of up to a model window, and one summary). Without caps the only bound on N is
`chunk_tokens` >= one cache block, so one request of a few hundred kilobytes could ask a
coordinator for ten thousand prompts. The defaults follow from the model and its deployment:

- `max_chunks` = the sequences one replica's engine batches (vLLM `max_num_seqs`: 128 on the CPU,
  1,024 on an H100): every chunk prompt of a compaction fits one engine's batch, so one compaction
  never needs more than one engine pass of prompts, and admission (`serving.admission`) can hold it.
- `max_history_tokens` = `HISTORY_WINDOWS` model windows (131,072 tokens for the CPU default's 8,192,
  2,097,152 for a 131,072-token window): an agent's prompt fits one window, so a history beyond a
  few windows is one that was never compacted; sixteen leave room for late compaction while
  bounding rendering, the chunk-summary work and the summary itself (N x the chunk budget).

A request over a cap is refused before anything is laid out (`OverLimit`, 422), saying what to change.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from compaction.errors import OverLimit
from compaction.partition import Chunk

HISTORY_WINDOWS = 16  # max_history_tokens, in model windows, when the catalogue sets none


@dataclass(frozen=True)
class PlanLimits:
    """The caps of one model (see the module docstring for the defaults)."""

    max_chunks: int  # chunk prompts one compaction may plan
    max_history_tokens: int  # tokens the rendered history may hold

    @classmethod
    def for_window(cls, window: int, sequences: int) -> PlanLimits:
        """The defaults: one engine's batch of chunks, HISTORY_WINDOWS windows of history."""
        return cls(max_chunks=sequences, max_history_tokens=HISTORY_WINDOWS * window)

    def check_history(self, tokens: int) -> None:
        if tokens > self.max_history_tokens:
            raise OverLimit(
                "messages",
                f"the history renders to {tokens} tokens, over this model's max_history_tokens of "
                f"{self.max_history_tokens}; compact a shorter history (compact earlier, or send only the part "
                "to summarise), or use a model with a larger window",
            )

    def check_chunks(
        self, chunks: Sequence[Chunk], chunk_tokens: int, cut: Callable[[int], Sequence[Chunk]], span: int
    ) -> None:
        """Refuse more than max_chunks chunks, naming the least chunk_tokens that fits (`cut(B)` partitions)."""
        if len(chunks) <= self.max_chunks:
            return
        least = max(chunk_tokens + 1, -(-span // self.max_chunks))
        while len(cut(least)) > self.max_chunks:
            least = max(least + 1, least * 9 // 8)
        raise OverLimit(
            "chunk_tokens",
            f"{len(chunks)} chunks of {chunk_tokens} tokens, over this model's max_chunks of {self.max_chunks}; "
            f"use chunk_tokens >= {least} for this history",
        )
