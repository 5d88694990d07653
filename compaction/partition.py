"""Cutting the compactable span of a rendered history into contiguous chunks of B tokens."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from compaction.errors import InvalidInput, NothingToCompact


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
    of carried summaries): each segment between them is partitioned as above on its own.
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
        count = -(-(b - a) // chunk_tokens)
        borders += [(a + k * chunk_tokens) // block_size * block_size for k in range(1, count)] + [b]
    return tuple(Chunk(i, a, b) for i, (a, b) in enumerate(itertools.pairwise(borders)))
