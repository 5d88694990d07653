"""Compaction prompts in token counts: the real partition, the layouts' lengths, and ids the router can compare.

`compaction.partition.partition` cuts the span exactly as the service does. Each layout's prompt k is then
described by its length and its *history prefix* (leading tokens copied verbatim from the session's rendered
history), which is all the cache and the cost model look at; `tests/test_sim.py` checks these lengths against
`compaction.layouts.build_prompts` on a real rendered history.

`SegmentIds` stands in for a prompt's token ids where `serving.routing` compares prompts (common prefixes): a
prompt is a few segments (a slice of a history, then tokens of its own), so slicing and comparing cost O(segments)
instead of O(tokens), and a 96k-token compaction is placed by the real `serving.routing.place`.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, overload

from compaction.options import CompactionOptions
from compaction.partition import partition

Segment = tuple[Hashable, int, int]  # (source, start, stop): tokens [start, stop) of a source


class SegmentIds(Sequence[int]):
    """A token sequence made of slices of named sources; equal slices of equal sources compare equal."""

    def __init__(self, segments: Sequence[Segment]) -> None:
        self.segments = tuple((s, a, b) for s, a, b in segments if b > a)
        self._len = sum(b - a for _, a, b in self.segments)

    def __len__(self) -> int:
        return self._len

    def _canonical(self) -> tuple[Segment, ...]:
        merged: list[Segment] = []
        for source, a, b in self.segments:
            if merged and merged[-1][0] == source and merged[-1][2] == a:
                merged[-1] = (source, merged[-1][1], b)
            else:
                merged.append((source, a, b))
        return tuple(merged)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SegmentIds):
            return NotImplemented
        return self._len == other._len and self._canonical() == other._canonical()

    def __hash__(self) -> int:
        return hash(self._canonical())

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> SegmentIds: ...
    def __getitem__(self, index: int | slice) -> int | SegmentIds:
        if isinstance(index, slice):
            lo, hi, step = index.indices(self._len)
            if step != 1:
                raise ValueError("SegmentIds slices take step 1")
            return SegmentIds(self._clip(lo, hi))
        lo = index if index >= 0 else self._len + index
        ((source, a, _),) = self._clip(lo, lo + 1) or [(None, -1, -1)]
        return hash((source, a))

    def _clip(self, lo: int, hi: int) -> list[Segment]:
        out, at = [], 0
        for source, a, b in self.segments:
            size = b - a
            s, e = max(lo, at), min(hi, at + size)
            if s < e:
                out.append((source, a + s - at, a + e - at))
            at += size
            if at >= hi:
                break
        return out

    def __iter__(self) -> Iterator[int]:
        for source, a, b in self.segments:
            for i in range(a, b):
                yield hash((source, i))


@dataclass(frozen=True)
class PromptLengths:
    """What the cache, the engine and the cost model need of one chunk prompt."""

    tokens: int  # whole prompt
    history_prefix: int  # leading tokens equal to the session's rendered history
    ids: SegmentIds  # for the router's prefix comparisons
    chain: Literal["history", "compaction", "none"] = "history"  # which cached chain its prefix can come from
    chain_prefix: int = -1  # leading tokens of that chain (-1: the history prefix)

    @property
    def cached_prefix(self) -> int:
        return self.history_prefix if self.chain_prefix < 0 else self.chain_prefix


@dataclass(frozen=True)
class ChunkTokens:
    """Token counts the layouts add around history slices (measured once per model's tokenizer)."""

    tail: int = 90  # turn close + instructions + generation prompt
    target_tags: int = 8  # <target> ... </target> around a chunk (paper, shared_full)
    segment_tags: int = 8  # <segment> ... </segment> around every chunk (prefix_exact_marked)


def prompt_lengths(
    history: Hashable,
    span: tuple[int, int],
    options: CompactionOptions,
    block_size: int,
    extra: ChunkTokens = ChunkTokens(),
) -> list[PromptLengths]:
    """Every chunk prompt of compacting `span` of a history, as the layouts in `compaction.layouts` build them."""
    start, end = span
    if options.strategy == "sequential":
        return [_prompt([(history, 0, end)], end, ("tail", 0), extra.tail)]
    # auto is prefix_exact whenever the prompts fit the model window, as every simulated workload's do;
    # the windowed layout (histories beyond the window) is not modelled.
    layout = "prefix_exact" if options.layout == "auto" else options.layout
    if layout == "windowed":
        raise ValueError("the simulator does not model the windowed layout; use auto or prefix_exact")
    chunks = partition(start, end, options.chunk_tokens, block_size)
    out = []
    for c in chunks:
        own = ("own", c.index)
        tail = ("tail", c.index)
        if layout == "prefix_exact":
            out.append(_prompt([(history, 0, c.end)], c.end, tail, extra.tail))
        elif layout == "independent":
            out.append(_prompt([(own, 0, c.size)], 0, tail, extra.tail, "none"))
        elif layout == "prefix_exact_marked":  # prompt k's body is a prefix of prompt k+1's, not of the history
            marked = sum(extra.segment_tags + d.size for d in chunks[: c.index + 1])
            parts: list[Segment] = [(history, 0, start), (("marked", 0), 0, marked)]
            out.append(_prompt(parts, start, tail, extra.tail, "compaction", start + marked))
        else:  # paper, shared_full: history before the chunk, then the tagged chunk (and, shared_full, the rest)
            after = end - c.end if layout == "shared_full" else 0
            parts = [(history, 0, c.start), (own, 0, c.size + extra.target_tags + after)]
            out.append(_prompt(parts, c.start, tail, extra.tail))
    return out


def _prompt(
    parts: list[Segment],
    raw: int,
    tail: Hashable,
    tail_tokens: int,
    chain: Literal["history", "compaction", "none"] = "history",
    chain_prefix: int = -1,
) -> PromptLengths:
    ids = SegmentIds([*parts, (tail, 0, tail_tokens)])
    return PromptLengths(len(ids), raw, ids, chain, chain_prefix)
