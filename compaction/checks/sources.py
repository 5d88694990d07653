"""What each chunk's summary may state, for every chunk of a plan at once, in one pass over the history.

The source of chunk k is the history up to the chunk's end (`compaction.extractive.segments(0, end_k)`):
every message before it whole, then the content of the message the end cuts, without the template's
markup (role headers, tool-call tags) and the word the border cuts. Built per chunk that is N passes
over the history (a decode of the cut message each time, a lower-cased copy of everything before
it). Here the whole messages are normalised once into one shared text, and each cut message is
decoded once, piece by piece between the chunk ends inside it, into a second shared text; a chunk's
source is a prefix of each (`grounding.Source` searches a shared text up to an end, without copying it).

The pieces of a cut message are decoded apart, so a character that a chunk end splits into two
tokens decodes as replacement characters; everything else reads as the per-chunk decode does.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from compaction.checks.grounding import Source
from compaction.history import template_view
from compaction.render import RenderedHistory
from compaction.tokenizer import ChatTokenizer


class _Normaliser:
    """`" ".join(text.lower().split())` of a text fed in pieces, with its length after each piece."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.length = 0
        self.open_word = False  # the text so far ends inside a word (the next piece may continue it)
        self.word_start = 0  # where the last word begins

    def feed(self, piece: str) -> None:
        lower = piece.lower()
        words = lower.split()
        for i, word in enumerate(words):
            if not (i == 0 and self.open_word and not lower[0].isspace()):  # else: the piece continues the word
                if self.length:
                    self.parts.append(" ")
                    self.length += 1
                self.word_start = self.length
            self.parts.append(word)
            self.length += len(word)
        if lower:
            self.open_word = bool(words) and not lower[-1].isspace()

    def cut_end(self) -> int:
        """The length without the word the piece's end cuts (if it ends inside one), as `segments` drops it."""
        return max(0, self.word_start - 1) if self.open_word else self.length

    def text(self) -> str:
        return "".join(self.parts)


def _normal(text: str) -> str:
    return " ".join(text.lower().split())


@dataclass(frozen=True)
class _Cut:
    """A message that chunk ends cut: its text, decoded piece by piece, and where each end falls in it."""

    text: str  # normalised, header removed
    ends: dict[int, int]  # chunk end (token) -> characters of `text` before it, the cut word excluded


class ChunkSources:
    """The grounding sources of one history's chunks (ends given at construction)."""

    def __init__(self, history: RenderedHistory, tokenizer: ChatTokenizer, ends: Sequence[int]) -> None:
        self._bounds = (*history.message_starts, len(history.token_ids))
        whole = [_normal(template_view(m)["content"]) for m in history.messages]
        self._offsets: list[int] = []  # characters of the shared text through message i
        length = -1
        for text in whole:
            length += 1 + len(text)
            self._offsets.append(length)
        self._whole = " ".join(whole)
        self._cuts: dict[int, _Cut] = {}
        by_message: dict[int, list[int]] = {}
        for end in sorted(set(ends)):
            i = bisect.bisect_right(self._bounds, end) - 1
            if 0 <= i < len(history.messages) and self._bounds[i] < end:
                by_message.setdefault(i, []).append(end)
        for i, cut_ends in by_message.items():
            self._cuts[i] = self._cut(history, tokenizer, i, cut_ends)

    def _cut(self, history: RenderedHistory, tokenizer: ChatTokenizer, i: int, ends: list[int]) -> _Cut:
        """Message i's text up to each end, as `segments` reads it: the view's text before the content (a tool
        result's tag), then the content's tokens decoded (never the template's markup around them: an
        assistant's `<tool_call>` is no source), less the word the end cuts."""
        message, (start, stop) = history.messages[i], history.contents[i]
        own = message.text()
        normaliser, at, offsets = _Normaliser(), start, {}
        normaliser.feed(template_view(message)["content"].partition(own)[0] if own else "")
        for end in ends:
            if min(stop, end) > at:
                normaliser.feed(tokenizer.decode(history.token_ids[at : min(stop, end)]))
                at = min(stop, end)
            offsets[end] = normaliser.cut_end() if end < stop else normaliser.length
        return _Cut(normaliser.text(), offsets)

    def source(self, end: int, *extra: str) -> Source:
        """The source of a chunk ending at `end` (one of the ends given), plus the caller's instructions."""
        i = bisect.bisect_right(self._bounds, end) - 1  # messages before i are whole; i may be cut
        shared = [(self._whole, self._offsets[i - 1])] if i >= 1 else []
        cut = self._cuts.get(i) if 0 <= i < len(self._offsets) and self._bounds[i] < end else None
        if cut is not None:
            shared.append((cut.text, cut.ends[end]))
        return Source(*extra, shared=shared)
