"""Detecting empty, runaway and echoed summaries, and cleaning up a runaway one.

Small models loop: SmolLM2's sequential summary of a 4k-token LoCoMo history repeated one line
until max_tokens. Reasoning models can return empty text. SmolLM2 also answers a chunk prompt now
and then with its instructions and nothing else ("This part is a conversation: keep who said what").
None of them may be spliced in silently.
"""

from __future__ import annotations

import re
from typing import Literal

from compaction.checks.grounding import salient_tokens

Verdict = Literal["ok", "empty", "runaway", "echo"]


def _ngrams(words: list[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]


def repetition_ratio(text: str, n: int = 6) -> float:
    """Share of word n-grams that repeat an earlier one (0 = none repeat, near 1 = a loop)."""
    grams = _ngrams(text.lower().split(), n)
    if not grams:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


_PIECES = re.compile(r"(?<=[.!?])\s+|\n+")
MIN_SENTENCE_WORDS = 4  # shorter sentences ("Thanks.", "All tests pass.") may well repeat


def _key(piece: str) -> tuple[str, ...]:
    return tuple(re.sub(r"\W+", " ", piece).lower().split())


def _echoes(key: tuple[str, ...], earlier: tuple[str, ...]) -> bool:
    """`key` repeats `earlier`: the same words, or one starts with the whole of the other (a loop cut by
    max_tokens ends inside a word: "I'm so glad y")."""
    if min(len(key), len(earlier)) < MIN_SENTENCE_WORDS:
        return False
    a, b = " ".join(key), " ".join(earlier)
    return a.startswith(b) or b.startswith(a)


def repeated_sentences(text: str) -> int:
    """Sentences (or lines) that repeat an earlier one: the same words, or one extends the other.

    "I'm so glad you're doing great. I'm so glad you're doing great too." holds one.
    """
    keys: list[tuple[str, ...]] = []
    repeats = 0
    for piece in _PIECES.split(text):
        key = _key(piece)
        if not key:
            continue
        if any(_echoes(key, k) for k in keys):
            repeats += 1
        keys.append(key)
    return repeats


def judge(text: str, finish_reason: str, threshold: float = 0.35, instructions: str = "") -> Verdict:
    """`empty` if nothing but white space came back; `echo` if every sentence restates `instructions` (the
    prompt's, `drop_instructions`); `runaway` if it repeats a sentence, or repeats its word 6-grams (at least
    `threshold` of them) while running to max_tokens."""
    if not text.strip():
        return "empty"
    rest, restated = drop_instructions(text, instructions) if instructions else (text, 0)
    if restated and not rest:
        return "echo"
    if repeated_sentences(text) or (finish_reason == "length" and repetition_ratio(text) >= threshold):
        return "runaway"
    return "ok"


def collapse_repeats(text: str) -> str:
    """Keep each sentence or line once (a sentence repeating an earlier one goes), in first-seen order:
    what is left of a runaway summary."""
    keys: list[tuple[str, ...]] = []
    kept: list[str] = []
    for piece in _PIECES.split(text):
        key = _key(piece)
        if key and key not in keys and not any(_echoes(key, k) for k in keys):
            keys.append(key)
            kept.append(piece.strip())
    return " ".join(kept)


ECHO_SHARE = 0.8  # a sentence whose words are mostly the instructions' restates them
_QUOTED = re.compile(r"“[^”]*”")


def drop_instructions(text: str, instructions: str) -> tuple[str, int]:
    """`text` without the sentences that restate the prompt's instructions ("This is a conversation: keep who
    said what,"), and how many went. A sentence that names anything (a salient token) is content, kept; what the
    instructions quote (the chunk's opening words) is content too, not instructions."""
    words = set(_key(_QUOTED.sub(" ", instructions)))
    kept, dropped = [], 0
    for piece in _PIECES.split(text):
        key = _key(piece)
        echo = len(key) >= 3 and sum(w in words for w in key) >= ECHO_SHARE * len(key)
        if echo and not salient_tokens(piece):
            dropped += 1
        elif piece.strip():
            kept.append(piece.strip())
    return (" ".join(kept), dropped) if dropped else (text, 0)


def drop_seen(text: str, seen: list[tuple[str, ...]]) -> str:
    """`text` without the sentences (of 4 words or more) that repeat one in `seen` or earlier in `text`;
    line breaks kept.

    `seen` grows by the sentences kept: the merge passes one list through every chunk's text, so no
    sentence of a compacted summary repeats another.
    """
    lines = []
    for line in text.splitlines():
        kept = []
        for piece in re.split(r"(?<=[.!?])\s+", line):
            key = _key(piece)
            if key and any(_echoes(key, k) for k in seen):
                continue
            if key:
                seen.append(key)
            kept.append(piece.strip())
        if any(kept):
            lines.append(" ".join(p for p in kept if p))
    return "\n".join(lines)
