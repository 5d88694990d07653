"""Extractive summaries: the most salient lines of a chunk, verbatim, in order. No model call.

`strategy: extractive` summarises every chunk this way (milliseconds), and it replaces a model
summary that stays ungrounded after its retry. A line scores for what an agent needs later:
the user's instructions and constraints, errors and stack-trace heads, file paths, decisions,
numbers and the first line of each tool result. The best lines that fit the token budget are
kept word for word, each labelled with its speaker, in their original order; nothing is
invented, so such a summary is grounded by construction.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from compaction.grounding import salient_tokens
from compaction.history import ChatTokenizer, RenderedHistory, template_view

MAX_LINE_CHARS = 300  # a longer line is cut at a word border (minified files, long logs)
LONG_LINE_CHARS = 120  # a longer line of prose is taken sentence by sentence
_CONSTRAINT = re.compile(
    r"\b(must|never|always|don't|do not|only|should|shouldn't|need to|needs to|required?|make sure|please|"
    r"avoid|without|keep|no longer)\b",
    re.IGNORECASE,
)
# Test and runtime failures, not code that merely names an exception (`raise ValueError(...)`).
_ERROR = re.compile(
    r"^(FAILED|ERROR|E {2,}|Traceback)|\b\w*(Error|Exception)\b:|\berror:|"
    r"\b(failed|failure|fatal|panic|errno|denied|segmentation fault|not found)\b",
    re.IGNORECASE,
)
_DECISION = re.compile(
    r"\b(decided?|decision|will|i'll|we'll|let's|plan|chose|choose|going to|found it|root cause|because|instead|"
    r"the fix|fix(?:ed)? by|switch(?:ed)? to)\b",
    re.IGNORECASE,
)
_TOOL_CALL = re.compile(r"^\[tool call\b")
CALL_TAG = re.compile(r"^\[tool (call|result)[^\]]*\]")
_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z\[\"'(`])")
_HAS_WORD = re.compile(r"\w")
_CUT_WORD_START = re.compile(r"^\S+")
_CUT_WORD_END = re.compile(r"\S+$")
_FILE = re.compile(r"\w\.[a-z]{1,5}$")


@dataclass(frozen=True)
class Segment:
    """The part of one message that lies inside a token range, as text."""

    message: int  # index into the rendered history's messages
    role: str  # the message's role (user, assistant, tool, system)
    text: str  # its content inside the range (the template's role header removed)
    opens_message: bool  # the range holds the message's first line


@dataclass(frozen=True)
class Line:
    position: int  # order in the chunk; kept lines are written in this order
    label: str  # speaker label written before the line
    text: str  # the line, verbatim (cut at MAX_LINE_CHARS)
    score: float  # salience; higher lines are kept first


def segments(history: RenderedHistory, tokenizer: ChatTokenizer, start: int, end: int) -> list[Segment]:
    """The messages overlapping history tokens [start, end), each as the text of its overlap.

    A message wholly inside is its rendered content; a message cut by a border is decoded from
    its tokens in the range, without the role header line the template writes before content, and
    without the word the border cuts (a token border can split `retry_out` into `retry` | `_out`).
    """
    bounds = (*history.message_starts, len(history.token_ids))
    out: list[Segment] = []
    for i, message in enumerate(history.messages):
        first, last = bounds[i], bounds[i + 1]
        if last <= start or first >= end:
            continue
        view = template_view(message)
        if first >= start and last <= end:
            text = view["content"]
        else:
            text = tokenizer.decode(history.token_ids[max(first, start) : min(last, end)])
            if first >= start and text.split("\n", 1)[0].strip() == view["role"]:
                text = text.split("\n", 1)[1] if "\n" in text else ""
            text = _CUT_WORD_START.sub("", text) if first < start else text
            text = _CUT_WORD_END.sub("", text) if last > end else text
        out.append(Segment(i, message.role, text, first >= start))
    return out


def _score(segment: Segment, text: str, first_line: bool) -> float:
    """Salience of one line: who says it, what kind of line it is, what it names."""
    salient = salient_tokens(text)
    if not salient and len(text.split()) < 3:
        return 0.0  # "ok", "thanks": nothing to keep
    tool = segment.role == "tool"
    call = _TOOL_CALL.match(text) is not None
    score = min(1.0 if tool else 2.0, 0.5 * len(salient))
    if segment.role == "user":
        score += 2.0 + (4.0 if _CONSTRAINT.search(text) else 0.0)
    elif segment.role == "assistant" and not call:
        score += 3.0 + (3.0 if _DECISION.search(text) else 0.0)
    if _ERROR.search(text):
        score += 4.0
    if any("/" in t or _FILE.search(t) for t in salient):
        score += 2.0
    if any(t[0].isdigit() for t in salient):
        score += 1.0
    if tool and first_line:
        score += 3.0
    return score + (1.0 if call else 0.0)


def _cut(text: str) -> str:
    if len(text) <= MAX_LINE_CHARS:
        return text
    return text[:MAX_LINE_CHARS].rsplit(" ", 1)[0] + " …"


def _units(text: str) -> list[str]:
    """The lines of a text; a long line of prose is taken sentence by sentence."""
    out: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        out += _SENTENCE.split(line) if len(line) > LONG_LINE_CHARS else [line]
    return out


def candidate_lines(parts: Sequence[Segment]) -> list[Line]:
    """Every distinct non-trivial line of the segments, scored (a repeated line counts once, call ids aside)."""
    seen: set[str] = set()
    lines: list[Line] = []
    for segment in parts:
        first = segment.opens_message
        for text in _units(segment.text):
            key = " ".join(CALL_TAG.sub("", text).lower().split())
            if not _HAS_WORD.search(text) or key in seen:
                continue
            seen.add(key)
            text = _cut(text)
            lines.append(Line(len(lines), segment.role, text, _score(segment, text, first)))
            first = False
    return lines


def _render(lines: Sequence[Line]) -> str:
    return "\n".join(f"{line.label}: {line.text}" for line in sorted(lines, key=lambda x: x.position))


def select(lines: Sequence[Line], tokenizer: ChatTokenizer, budget: int, chars_per_token: float) -> str:
    """The best lines that fit `budget` tokens, in their original order.

    Lines are costed by characters (`chars_per_token`, the chunk's own ratio), and the result is
    then tokenised once and trimmed from its least salient line until it fits: one tokenizer call
    per chunk instead of one per line. If not even the best line fits, its first `budget` tokens
    are kept, so a chunk never vanishes without a trace.
    """
    ranked = sorted(lines, key=lambda line: (-line.score, line.position))
    kept: list[Line] = []
    used = 0.0
    for line in ranked:
        cost = (len(line.label) + len(line.text) + 3) / chars_per_token
        if used + cost <= budget:
            kept.append(line)
            used += cost
    while kept and len(tokenizer.encode(_render(kept))) > budget:
        kept.remove(min(kept, key=lambda line: (line.score, -line.position)))
    if kept or not ranked:
        return _render(kept)
    best = ranked[0]
    return tokenizer.decode(tokenizer.encode(f"{best.label}: {best.text}")[:budget]).strip()


def extract(history: RenderedHistory, tokenizer: ChatTokenizer, start: int, end: int, budget: int) -> str:
    """The extractive summary of history tokens [start, end) within `budget` tokens."""
    parts = segments(history, tokenizer, start, end)
    chars = sum(len(p.text) for p in parts)
    return select(candidate_lines(parts), tokenizer, budget, max(1.0, chars / max(1, end - start)))
