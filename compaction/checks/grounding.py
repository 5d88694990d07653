"""Is a summary grounded in what it summarises? Salient tokens, their check, and pruning.

A summary *states* salient tokens: numbers, identifiers, file paths, URLs, command flags, quoted
strings and capitalised names. Each must occur in the source (the chunk and the history before
it, plus the prompt's own instructions); one that does not was invented by the model. Small
models invent freely (SmolLM2 turned a coding trace into "the GolfBridge project funded by the
NSF"), and an agent acts on what its summary says, so an invented fact is worse than a lost one.

Extraction favours precision: a capitalised word that opens a sentence is not taken as a name
(it is capitalised by position), single digits are too common to tell anything, and the check is
case-insensitive with word boundaries ("42" is not found inside "C0042"). The price: an invented
plain name that only ever opens a sentence ("Bob came too.") is not checked. Neither are one plain
lower-case word in quotation marks ("what" names nothing; in backticks it is code) and a function
word capitalised inside a sentence ("But", "We").
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

_QUOTED = r"[\"“`]([^\"“”`\n]{3,80})[\"”`]"
_URL = r"https?://[^\s)\]>\"'`]+[\w/]"
_FLAG = r"(?<![\w-])--?[A-Za-z][\w-]*\w"
_RUN = r"[\w$@][\w.\-/:@$\\]*[\w]|\w"
_CANDIDATES = re.compile(f"{_QUOTED}|({_URL})|({_FLAG})|({_RUN})")
_NUMBER = re.compile(r"\d+(?:[.,:/-]\d+)*%?")
_ORDINAL = re.compile(r"(\d+)(?:st|nd|rd|th)")
_DOTTED = re.compile(r"\w\.\w")
_CAMEL = re.compile(r"[a-z][A-Z]")
_ABBREVIATIONS = frozenset({"e.g", "i.e", "etc", "a.m", "p.m", "vs", "u.s"})
# Words that name nothing even when capitalised inside a sentence ("it passed, But then We saw"): not names.
_FUNCTION_WORDS = frozenset(
    re.findall(
        r"\w+",
        "we you he she it they me us him her them my our your his its their this that these those what which who whom "
        "whose when where why how and but or nor so yet for if then else because while although though as at by in on "
        "of to from with without into onto about after before over under no not yes just also only all any some each "
        "every both either neither the an is are was were be been being do does did has have had should would could "
        "here there now very more most",
    )
)
_SENTENCE_END = (".", "!", "?", ":", ";", "\n")
_LEAD = " \t\"'“‘([*-•#>`"
_WORD = "a-z0-9_"
SALIENT_TEXTS = 16384  # texts whose salient tokens are remembered (`salient_tokens`)


@dataclass(frozen=True)
class Grounding:
    """The check of one text against its source."""

    salient: tuple[str, ...]  # distinct salient tokens the text states, normalised, in first-seen order
    ungrounded: tuple[str, ...]  # those not found in the source

    @property
    def score(self) -> float:
        """Share of salient tokens found in the source; 1.0 when the text states none."""
        if not self.salient:
            return 1.0
        return 1.0 - len(self.ungrounded) / len(self.salient)


def _sentence_initial(text: str, start: int) -> bool:
    before = text[max(0, start - 40) : start].rstrip(_LEAD)
    return not before or before.endswith(_SENTENCE_END)


def _classify(run: str, initial: bool) -> str | None:
    """The normalised salient form of a word-like run, or None when it is an ordinary word."""
    ordinal = _ORDINAL.fullmatch(run)
    if ordinal:
        run = ordinal.group(1)
    if _NUMBER.fullmatch(run):
        return run if len(run) >= 2 else None
    lower = run.lower()
    if lower in _ABBREVIATIONS:
        return None
    has_alpha = any(c.isalpha() for c in run)
    if any(c in run for c in "_@$\\") or (has_alpha and any(c.isdigit() for c in run)):
        return lower  # identifiers: snake_case, handles, C0042, py311
    if "/" in run:
        return lower if ("." in run or run.count("/") >= 2 or run.startswith("/")) else None
    if _DOTTED.search(run) or "::" in run:
        return lower  # dotted names and files: os.path.join, main.py
    if _CAMEL.search(run):
        return lower  # camelCase, GolfBridge
    if len(run) >= 2 and run.isupper():
        return lower  # acronyms, even at a sentence start
    if run[0].isupper() and len(run) >= 2 and not initial and lower not in _FUNCTION_WORDS:
        return lower  # a capitalised name inside a sentence
    return None


@lru_cache(maxsize=SALIENT_TEXTS)
def salient_tokens(text: str) -> tuple[str, ...]:
    """The distinct salient tokens of `text`, normalised (lower case), in first-seen order. Remembered for the last
    SALIENT_TEXTS texts: a merge reads each line of a history several times (scores, shapes, repeats), and the next
    compaction of the same session most of the same lines again."""
    found: dict[str, None] = {}
    for match in _CANDIDATES.finditer(text):
        quoted, url, flag, run = match.groups()
        if quoted is not None:
            words = quoted.split()
            plain = len(words) == 1 and words[0].isalpha() and words[0].islower() and text[match.start()] != "`"
            token: str | None = None if plain else " ".join(words).lower()  # "what" in quotes names nothing
        elif url is not None or flag is not None:
            token = (url or flag or "").lower()
        else:
            token = _classify(run, _sentence_initial(text, match.start()))
        if token:
            found.setdefault(token, None)
    return tuple(found)


@lru_cache(maxsize=4096)
def _pattern(token: str) -> re.Pattern[str]:
    head = rf"(?<![{_WORD}])" if token[0].isalnum() or token[0] == "_" else ""
    tail = rf"(?![{_WORD}])" if token[-1].isalnum() or token[-1] == "_" else ""
    if token.isdigit():
        tail = rf"(?:st|nd|rd|th)?{tail}"  # "18th" states 18 (salient_tokens reads ordinals as their number)
    return re.compile(head + re.escape(token) + tail)


class Source:
    """A text that summaries are checked against (lower-cased and white-space-collapsed once).

    `shared`: texts already normalised, each searched up to its end without a copy (`compaction.checks.sources`:
    the chunks of one history share one text of it).
    """

    def __init__(self, *parts: str, shared: Sequence[tuple[str, int]] = ()) -> None:
        self.text = " ".join(" ".join(part.lower().split()) for part in parts)
        self.shared = tuple(shared)

    def contains(self, token: str) -> bool:
        if token in self.text and _pattern(token).search(self.text) is not None:
            return True
        return any(
            text.find(token, 0, end) >= 0 and _pattern(token).search(text, 0, end) is not None
            for text, end in self.shared
        )

    def check(self, text: str) -> Grounding:
        salient = salient_tokens(text)
        return Grounding(salient, tuple(t for t in salient if not self.contains(t)))


def _sentences(line: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", line) if s.strip()]


def prune(text: str, ungrounded: tuple[str, ...]) -> tuple[str, int]:
    """`text` without the sentences that state any of `ungrounded`; also how many were dropped. A line that still
    states one (a quotation spanning a sentence end: `19 passed in 1.89s. 2 failed`) goes whole."""
    bad = set(ungrounded)
    lines: list[str] = []
    dropped = 0
    for line in text.splitlines():
        kept = []
        for sentence in _sentences(line):
            if bad.intersection(salient_tokens(sentence)):
                dropped += 1
            else:
                kept.append(sentence)
        if kept and bad.intersection(salient_tokens(" ".join(kept))):
            dropped += len(kept)
        elif kept:
            lines.append(" ".join(kept))
    return "\n".join(lines).strip(), dropped
