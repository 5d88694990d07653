"""Detecting empty and runaway summaries, and cleaning up a runaway one.

Small models loop: SmolLM2's sequential summary of a 4k-token LoCoMo history repeated one line
until max_tokens. Reasoning models can return empty text. Neither may be spliced in silently.
"""

from __future__ import annotations

import re
from typing import Literal

Verdict = Literal["ok", "empty", "runaway"]


def _ngrams(words: list[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]


def repetition_ratio(text: str, n: int = 6) -> float:
    """Share of word n-grams that repeat an earlier one (0 = none repeat, near 1 = a loop)."""
    grams = _ngrams(text.lower().split(), n)
    if not grams:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


def judge(text: str, finish_reason: str, threshold: float = 0.35) -> Verdict:
    """`empty` if nothing but white space came back; `runaway` if it hit max_tokens while repeating."""
    if not text.strip():
        return "empty"
    if finish_reason == "length" and repetition_ratio(text) >= threshold:
        return "runaway"
    return "ok"


def collapse_repeats(text: str) -> str:
    """Keep each sentence or line once, in first-seen order: what is left of a runaway summary."""
    seen: set[str] = set()
    kept: list[str] = []
    for piece in re.split(r"(?<=[.!?])\s+|\n+", text):
        key = re.sub(r"\W+", " ", piece).strip().lower()
        if key and key not in seen:
            seen.add(key)
            kept.append(piece.strip())
    return " ".join(kept)
