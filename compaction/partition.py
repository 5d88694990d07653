"""Cutting the compactable span of a rendered history into contiguous chunks of B tokens."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from compaction.errors import InvalidInput


@dataclass(frozen=True)
class Chunk:
    """One contiguous slice [start, end) of the rendered history's token ids."""

    index: int  # 0-based position among the chunks; summaries are merged in this order
    start: int  # first token (absolute position in the rendered history)
    end: int  # one past the last token

    @property
    def size(self) -> int:
        return self.end - self.start


def partition(start: int, end: int, chunk_tokens: int, block_size: int = 16) -> tuple[Chunk, ...]:
    """Split [start, end) into N = ceil((end - start) / chunk_tokens) contiguous chunks.

    Inner borders sit at start + k·B rounded down to a multiple of `block_size` (an absolute
    position), so every prompt that ends at a border ends on a full cache block and the next
    prompt can reuse all of it. Rounding moves a border by less than one block, never past
    its neighbour, because B >= block_size (a gap of at least B - block_size + 1 tokens). The chunks
    concatenate back to [start, end).
    """
    if block_size < 1:
        raise InvalidInput("block_size", "must be at least 1")
    if chunk_tokens < block_size:
        raise InvalidInput(
            "chunk_tokens",
            f"{chunk_tokens} is below one cache block ({block_size} tokens); use at least that",
        )
    if not 0 <= start < end:
        raise InvalidInput("messages", "nothing to compact: the compactable span is empty")
    count = -(-(end - start) // chunk_tokens)
    borders = [start]
    for k in range(1, count):
        borders.append((start + k * chunk_tokens) // block_size * block_size)
    borders.append(end)
    return tuple(Chunk(i, a, b) for i, (a, b) in enumerate(itertools.pairwise(borders)))
