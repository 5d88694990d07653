"""Prompt layouts, built in token space from the once-rendered history.

Every prompt is `body + tail`. The body holds history tokens (and, in some layouts, marker
tokens); the tail closes the open turn and holds the instructions and the generation prompt.

- prefix_exact: body k = history[0:end_k] verbatim. Body k is a strict token prefix of body k+1
  and of the agent's own rendered history, so the chunk prompts reuse each other's cache and the
  cache the agent's turns already filled. The tail names the target by number and opening words.
- prefix_exact_marked: every chunk between identical <segment> markers in every prompt; body k is
  still a strict prefix of body k+1, but the markers break reuse of the agent's own cache.
- paper: chunks 1..k-1, then chunk k inside <target> tags (the reference layout; body k+1 holds
  chunk k without tags, so it cannot reuse body k past chunk k's start).
- independent: chunk k alone (ablation).
- shared_full: the whole snapshot with chunk k inside <target> tags (ablation).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from compaction.history import ChatTokenizer, RenderedHistory
from compaction.instructions import instruction_text, target_phrase
from compaction.options import CompactionOptions, Layout
from compaction.partition import Chunk

SEGMENT = ("\n<segment>\n", "\n</segment>\n")
TARGET = ("\n<target>\n", "\n</target>\n")
_PROBE = "\x00"


@dataclass(frozen=True)
class ChunkPrompt:
    """One prompt of a compaction, in token ids."""

    chunk: Chunk  # the history slice this prompt asks to summarise
    body: tuple[int, ...]  # history (+ markers); identical between a prompt and its retry
    tail: tuple[int, ...]  # turn close + instructions + generation prompt
    raw_prefix: int  # body[:raw_prefix] == history[:raw_prefix]: what the agent's own cache can serve
    history_tokens: int  # how many history tokens the body holds (markers excluded)

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.body + self.tail

    def __len__(self) -> int:
        return len(self.body) + len(self.tail)


def opening_words(tokenizer: ChatTokenizer, ids: Sequence[int], words: int = 10) -> str:
    """The first words of a chunk, as the tail quotes them to point at the target."""
    text = re.sub(r"\s+", " ", tokenizer.decode(ids[:32])).strip().replace("“", "").replace("”", "")
    return " ".join(text.split(" ")[:words])


def tail_ids(tokenizer: ChatTokenizer, closed: bool, instructions: str) -> tuple[int, ...]:
    """Close the open turn, then a user turn holding the instructions, then the generation prompt.

    The instructions are tokenised as text: they quote the chunk's opening words, which are
    conversation content and may spell control tokens.
    """
    before, after = tokenizer.user_turn(_PROBE).split(_PROBE)
    markup = ("" if closed else tokenizer.end_of_turn) + before
    text, _ = tokenizer.encode_with_offsets(instructions, as_text=True)
    return (*tokenizer.encode(markup), *text, *tokenizer.encode(after))


def _body(
    layout: Layout,
    ids: tuple[int, ...],
    chunks: Sequence[Chunk],
    k: int,
    span_end: int,
    markers: dict[str, list[int]],
) -> tuple[tuple[int, ...], int, int]:
    """(body, raw_prefix, history_tokens) of chunk k's prompt."""
    chunk = chunks[k]
    if layout == "prefix_exact":
        return ids[: chunk.end], chunk.end, chunk.end
    if layout == "independent":
        return ids[chunk.start : chunk.end], 0, chunk.size
    if layout == "prefix_exact_marked":
        first = chunks[0].start
        marked = list(ids[:first])
        for c in chunks[: k + 1]:
            marked += markers["segment_open"] + list(ids[c.start : c.end]) + markers["segment_close"]
        return tuple(marked), first, chunk.end
    tagged = markers["target_open"] + list(ids[chunk.start : chunk.end]) + markers["target_close"]
    after = list(ids[chunk.end : span_end]) if layout == "shared_full" else []
    return (*ids[: chunk.start], *tagged, *after), chunk.start, chunk.end + len(after)


def build_prompts(
    history: RenderedHistory,
    tokenizer: ChatTokenizer,
    options: CompactionOptions,
    chunks: Sequence[Chunk],
    span_end: int,
    strict: bool = False,
) -> tuple[ChunkPrompt, ...]:
    """One prompt per chunk (a single whole-span prompt when sequential)."""
    ids = history.token_ids
    borders = set(history.message_starts) | {len(ids)}
    markers = {
        "segment_open": tokenizer.encode(SEGMENT[0]),
        "segment_close": tokenizer.encode(SEGMENT[1]),
        "target_open": tokenizer.encode(TARGET[0]),
        "target_close": tokenizer.encode(TARGET[1]),
    }
    sequential = options.strategy == "sequential"
    prompts = []
    for k, chunk in enumerate(chunks):
        if sequential:
            body, raw, hist = ids[:span_end], span_end, span_end
        else:
            body, raw, hist = _body(options.layout, ids, chunks, k, span_end, markers)
        last_history_token = span_end if sequential or options.layout == "shared_full" else chunk.end
        closed = last_history_token in borders
        target = target_phrase(
            None if sequential else options.layout,
            k,
            len(chunks),
            opening_words(tokenizer, ids[chunk.start : chunk.end]),
        )
        extra = (options.chunk_instructions or {}).get(k)
        text = instruction_text(options.variant, target, options.max_chunk_summary_tokens, extra, strict)
        tail = tail_ids(tokenizer, closed, text)
        prompts.append(ChunkPrompt(chunk, tuple(body), tail, raw, hist))
    return tuple(prompts)


def prefill_floor(prompts: Sequence[ChunkPrompt], history_end: int, block_size: int) -> int:
    """The least prefill any prefix cache can do: the history once plus every prompt's own tokens.

    History tokens are counted once, rounded up to a block; each prompt adds what it holds beyond
    history tokens (tail, markers) plus the partial block its history part ends in, which the
    next prompt cannot reuse because their tails differ.
    """
    history = -(-history_end // block_size) * block_size
    own = sum(len(p) - p.history_tokens + (p.chunk.end % block_size if p.raw_prefix else 0) for p in prompts)
    return history + own
