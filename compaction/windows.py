"""The windowed layout's plan: which chunk prompts share which window of the history.

When prefix_exact prompts (the whole history up to chunk k) outgrow the model window, prompt k
holds the kept head (the template's preamble and the kept system messages: the history's own
first tokens), then the history from a window start s to the end of chunk k, then its tail.
Consecutive chunks form a group that shares one start, so within a group every prompt minus its
tail is a token prefix of the next one (one cached prefix chain per group), exactly as in
prefix_exact; the first group starts right after the head, so its prompts ARE the prefix_exact
prompts (and reuse the agent's own cache).

Choices, and why:
- The head leads every prompt: its full cache blocks are the history's own first blocks (served
  from cache for every group), and the model keeps its role and the session's setting (the
  agent's system prompt: repository, tools) when it sees a window from the middle.
- A later group starts at least `min_context` tokens before its first target chunk (a quarter of
  the room by default), so even a group's first prompt sees what led up to it; the group then
  takes as many chunks as fit. A larger overlap gives more context but recomputes more: the
  overlap is prefill no other prompt can share.
- A start sits just before a chunk border, at a position ≡ head_end (mod block), so that every
  chunk end lands on a cache-block border inside the prompt and the next prompt of the group
  reuses all of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from compaction.errors import ContextOverflow
from compaction.partition import Chunk

MIN_CONTEXT_SHARE = 0.25  # of the room: the least history before a later group's first target


@dataclass(frozen=True)
class Window:
    """One group of chunk prompts sharing a start."""

    start: int  # first history token after the head; prompt k holds head + history[start:end_k]
    chunks: tuple[int, ...]  # indices of the chunks whose prompts use this start, in order

    def overlap(self, chunks: Sequence[Chunk]) -> int:
        """History tokens before the group's first target: context already summarised elsewhere."""
        return chunks[self.chunks[0]].start - self.start


def _start(border: int, head_end: int, block_size: int) -> int:
    """The latest position <= border that is ≡ head_end (mod block): chunk ends then fall on block borders."""
    return border - (border - head_end) % block_size


def plan_windows(
    chunks: Sequence[Chunk], head_end: int, room: Sequence[int], block_size: int, min_context: int | None = None
) -> tuple[Window, ...]:
    """Group the chunks into windows; `room[k]` is how many history tokens prompt k may hold (head included).

    Raises ContextOverflow when a chunk does not fit beside the head on its own.
    """

    def fits(k: int, start: int) -> bool:
        return head_end + chunks[k].end - start <= room[k]

    if min_context is None:
        min_context = int(MIN_CONTEXT_SHARE * max(0, min(room) - head_end))
    groups: list[Window] = []
    a = 0
    while a < len(chunks):
        j = a
        while j > 0 and chunks[a].start - _start(chunks[j].start, head_end, block_size) < min_context:
            j -= 1
        while j < a and not fits(a, _start(chunks[j].start, head_end, block_size)):
            j += 1
        start = _start(chunks[j].start, head_end, block_size)
        if not fits(a, start):
            need = head_end + chunks[a].end - start
            raise ContextOverflow(
                "chunk_tokens",
                f"chunk {a} needs {need} history tokens beside the kept head ({head_end} tokens), over the "
                f"{room[a]} the model window leaves; use chunk_tokens of at most {max(1, room[a] - head_end)}",
            )
        b = a
        while b + 1 < len(chunks) and fits(b + 1, start):
            b += 1
        groups.append(Window(start, tuple(range(a, b + 1))))
        a = b + 1
    return tuple(groups)


def windowed_floor(
    windows: Sequence[Window], chunks: Sequence[Chunk], head_end: int, own_tokens: int, history_end: int, block: int
) -> int:
    """The least prefill of the windowed layout: the history once, plus the overlaps, plus the tails.

    Every later group recomputes its overlap and the head's partial last block (the head's full
    blocks are the history's own); `own_tokens` is the prompts' tails plus the partial block each
    prompt's history part ends in, as in `layouts.prefill_floor`.
    """
    history = -(-history_end // block) * block
    overlaps = sum(head_end % block + w.overlap(chunks) for w in windows if w.start != head_end)
    return history + overlaps + own_tokens
