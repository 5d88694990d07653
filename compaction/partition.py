"""Stage 2: cutting the compactable span of a rendered history into contiguous chunks of B tokens, within
the caps on the work one compaction may plan.

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

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from compaction.errors import InvalidInput, NothingToCompact, OverLimit

HISTORY_WINDOWS = 16  # max_history_tokens, in model windows, when the catalogue sets none


@dataclass(frozen=True)
class Chunk:
    """One contiguous slice [start, end) of the rendered history's token ids."""

    index: int  # 0-based position among the chunks; summaries are merged in this order
    start: int  # first token (absolute position in the rendered history)
    end: int  # one past the last token

    @property
    def size(self) -> int:
        return self.end - self.start


def partition(
    start: int, end: int, chunk_tokens: int, block_size: int = 16, fixed: Sequence[int] = ()
) -> tuple[Chunk, ...]:
    """Split [start, end) into contiguous chunks of about B tokens, in order.

    Without `fixed` borders: N = ceil((end - start) / chunk_tokens) chunks. Inner borders sit at
    start + k·B rounded down to a multiple of `block_size` (an absolute position), so every prompt
    that ends at a border ends on a full cache block and the next prompt can reuse all of it.
    Rounding moves a border by less than one block, never past its neighbour, because
    B >= block_size (a gap of at least B - block_size + 1 tokens). The chunks concatenate back to
    [start, end).

    `fixed` are borders that must stay borders (chunks reused from an earlier compaction, the end
    of carried summaries): each segment between them is partitioned as above on its own, from the
    span's grid where the segment starts on it (so borders kept from an earlier plan of the same span
    change nothing).
    """
    if block_size < 1:
        raise InvalidInput("block_size", "must be at least 1")
    if chunk_tokens < block_size:
        raise InvalidInput(
            "chunk_tokens",
            f"{chunk_tokens} is below one cache block ({block_size} tokens); use at least that",
        )
    if not 0 <= start < end:
        raise NothingToCompact("messages", "nothing to compact: the compactable span is empty")
    cuts = [start, *sorted({f for f in fixed if start < f < end}), end]
    borders = [start]
    for a, b in itertools.pairwise(cuts):
        origin = _on_grid(start, a, chunk_tokens, block_size)
        count = -(-(b - origin) // chunk_tokens)
        borders += [(origin + k * chunk_tokens) // block_size * block_size for k in range(1, count)] + [b]
    return tuple(Chunk(i, a, b) for i, (a, b) in enumerate(itertools.pairwise(borders)))


def _on_grid(start: int, at: int, chunk_tokens: int, block_size: int) -> int:
    """Where a segment beginning at `at` is cut from: the unrounded point start + k·B when `at` is that point's
    border (a chunk kept from an earlier plan of the same span, grown since), so the segment's borders are the
    ones the whole span would get without it; else `at` itself."""
    k = (at - start) // chunk_tokens
    return next((p for p in (start + k * chunk_tokens, start + (k + 1) * chunk_tokens) if p - p % block_size == at), at)


@dataclass(frozen=True)
class PlanLimits:
    """The caps of one model (see the module docstring for the defaults)."""

    max_chunks: int  # chunk prompts one compaction may plan
    max_history_tokens: int  # tokens the rendered history may hold

    @classmethod
    def for_window(cls, window: int, sequences: int) -> PlanLimits:
        """The defaults: one engine's batch of chunks, HISTORY_WINDOWS windows of history."""
        return cls(max_chunks=sequences, max_history_tokens=HISTORY_WINDOWS * window)

    def check_history(self, tokens: int, at_least: bool = False) -> None:
        """Refuse a history of `tokens` (`at_least`: a lower bound, compaction.render.token_floor) over the cap."""
        if tokens > self.max_history_tokens:
            raise OverLimit(
                "messages",
                f"the history renders to {'at least ' if at_least else ''}{tokens} tokens, over this model's "
                f"max_history_tokens of "
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
