"""Pinned facts: beside the model's summary of each chunk, the most salient lines of the chunk, word for word.

A chunk's budget is split (`pinned_share`): the model writes its summary within the rest, and what
the summaries leave of their chunks' budgets is pooled for pinned lines, so a chunk dense in facts
(a failing run, the decision) may use room a quiet chunk left. The lines are the extractive
ranking's best (the user's constraints, errors and stack-trace heads, paths, commands, decisions,
numbers), chosen over the whole span, each written after its own chunk's summary. A line whose
facts a summary or the kept user words already state is not pinned, and a summary sentence whose
facts a pinned line states is dropped: no fact is stated twice. Pinned lines are copied from the
history (less a tool call's id tag), so they are grounded by construction; the summaries keep
their own grounding check. No model call: pinning is cheap, done at merge time over the span of
each compaction, so the chunk-summary cache holds the model summaries and the lines are chosen anew.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

from compaction.extractive import CALL_TAG, Line, Segment, candidate_lines, weights
from compaction.grounding import Source, salient_tokens
from compaction.history import ChatTokenizer
from compaction.options import CompactionOptions

_SENTENCE = re.compile(r"(?<=[.!?])\s+")
MAX_CANDIDATES = 200  # the best lines are costed exactly (one tokenizer call each); the rest are never reached


def model_budget(options: CompactionOptions) -> int:
    """Tokens the model's summary of one chunk may use: the budget less the pinned share."""
    budget = options.max_chunk_summary_tokens
    if options.strategy == "extractive" or options.pinned_share == 0:
        return budget
    return max(1, round(budget * (1 - options.pinned_share)))


@dataclass(frozen=True)
class ChunkText:
    """One chunk's part of the merge: its kept summary, its segments, and whether lines may be pinned to it."""

    summary: str
    parts: Sequence[Segment]
    tokens: int  # history tokens of the chunk
    open: bool  # False for a fallback text (the chunk verbatim or extractive): nothing is pinned to it


@dataclass(frozen=True)
class Pinned:
    """A chunk's text after pinning: its summary (less sentences a pinned line states) and its pinned lines."""

    text: str
    lines: int
    dropped_sentences: int


_WORD = re.compile(r"[a-z0-9_][\w./:-]*")
NEW_WORDS = 0.25  # a line adds a fact when over a quarter of its words are not stated yet


def _key(text: str) -> str:
    return " ".join(text.lower().split())


def _words(text: str) -> set[str]:
    return {w.strip(".:-/") for w in _WORD.findall(text.lower()) if len(w) > 2}


def _repeats(line: Line, stated: Source, words: set[str]) -> bool:
    """Everything the line names is stated already (its salient tokens, and all but a quarter of its words)."""
    mine = _words(line.text)
    if any(not stated.contains(t) for t in salient_tokens(line.text)):
        return False
    return not mine or len(mine - words) <= NEW_WORDS * len(mine)


def _dedupe(summary: str, pinned: Source) -> tuple[str, int]:
    """The summary without the sentences whose salient tokens the pinned lines all state."""
    kept, dropped = [], 0
    for sentence in (s for line in summary.splitlines() for s in _SENTENCE.split(line) if s.strip()):
        tokens = salient_tokens(sentence)
        if tokens and all(pinned.contains(t) for t in tokens):
            dropped += 1
        else:
            kept.append(sentence.strip())
    return " ".join(kept), dropped


def _candidates(chunks: Sequence[ChunkText], stated: Source, said: str) -> list[tuple[int, Line]]:
    """(chunk, line) for every distinct line of the open chunks not stated yet, call tags removed."""
    seen: set[str] = set()
    out: list[tuple[int, Line]] = []
    span = weights([part for chunk in chunks if chunk.open for part in chunk.parts])
    words = _words(said)
    for k, chunk in enumerate(chunks):
        if not chunk.open:
            continue
        for line in candidate_lines(chunk.parts, span):
            line = replace(line, text=CALL_TAG.sub("", line.text).strip())
            stated_already = _key(line.text) in said or _repeats(line, stated, words)
            if line.score > 0 and _key(line.text) not in seen and not stated_already:
                seen.add(_key(line.text))
                out.append((k, line))
    return out


def _render(lines: Sequence[Line]) -> str:
    return "\n".join(f"{line.label}: {line.text}" for line in sorted(lines, key=lambda x: x.position))


def pin(chunks: Sequence[ChunkText], tokenizer: ChatTokenizer, budget: int, elsewhere: str = "") -> list[Pinned]:
    """Each chunk's summary with its pinned lines, within `budget` tokens per chunk, pooled over the chunks.

    `elsewhere`: text the compacted head states anyway (the kept user words).
    """
    sizes = [len(tokenizer.encode(c.summary)) + 1 if c.summary else 0 for c in chunks]
    room = sum(budget - size for c, size in zip(chunks, sizes, strict=True) if c.open)
    texts = [c.summary for c in chunks]
    said = _key(" ".join([*texts, elsewhere]))
    ranked = sorted(_candidates(chunks, Source(*texts, elsewhere), said), key=lambda kl: (-kl[1].score, kl[0]))
    kept: list[tuple[int, Line]] = []
    used = 0
    covered, words = Source(), set[str]()
    for k, line in ranked[:MAX_CANDIDATES]:
        if _repeats(line, covered, words):
            continue  # what it says, a line kept already says
        cost = len(tokenizer.encode(f"{line.label}: {line.text}")) + 1  # + its line break
        if used + cost <= room:
            kept.append((k, line))
            covered, words = Source(covered.text, line.text), words | _words(line.text)
            used += cost
    out = []
    for k, chunk in enumerate(chunks):
        mine = [line for at, line in kept if at == k]
        if not mine:
            out.append(Pinned(chunk.summary, 0, 0))
            continue
        lines = _render(mine)
        summary, dropped = _dedupe(chunk.summary, Source(lines))
        out.append(Pinned(f"{summary}\n{lines}" if summary else lines, len(mine), dropped))
    return out
