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

MAX_LINE_CHARS = 300
_CONSTRAINT = re.compile(
    r"\b(must|never|always|don't|do not|only|should|shouldn't|need to|needs to|required?|make sure|please|"
    r"avoid|without|keep|no longer)\b",
    re.IGNORECASE,
)
_ERROR = re.compile(
    r"\b(error|exception|traceback|failed|failure|fails|assert(?:ion)?|panic|fatal|errno|denied|not found|"
    r"segmentation fault)\b|\w+Error\b",
    re.IGNORECASE,
)
_DECISION = re.compile(
    r"\b(decided?|decision|will|i'll|we'll|let's|plan|chose|choose|going to|root cause|because|instead|"
    r"the fix|fix(?:ed)? by|switch(?:ed)? to)\b",
    re.IGNORECASE,
)
_TOOL_CALL = re.compile(r"^\[tool call\b")
_HAS_WORD = re.compile(r"\w")


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
    its tokens in the range, without the role header line the template writes before content.
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
        out.append(Segment(i, message.role, text, first >= start))
    return out


def _score(segment: Segment, text: str, first_line: bool) -> float:
    salient = salient_tokens(text)
    score = min(2.0, 0.5 * len(salient))
    if segment.role == "user":
        score += 1.0 + (3.0 if _CONSTRAINT.search(text) else 0.0)
    if segment.role == "assistant" and _DECISION.search(text):
        score += 3.0
    if _ERROR.search(text):
        score += 4.0
    if any("/" in t or re.search(r"\w\.[a-z]{1,5}$", t) for t in salient):
        score += 2.0
    if any(t[0].isdigit() for t in salient):
        score += 1.0
    if segment.role == "tool" and first_line:
        score += 3.0
    if _TOOL_CALL.match(text):
        score += 2.0
    return score


def _cut(text: str) -> str:
    if len(text) <= MAX_LINE_CHARS:
        return text
    return text[:MAX_LINE_CHARS].rsplit(" ", 1)[0] + " …"


def candidate_lines(parts: Sequence[Segment]) -> list[Line]:
    """Every distinct non-trivial line of the segments, scored."""
    seen: set[str] = set()
    lines: list[Line] = []
    for segment in parts:
        first = segment.opens_message
        for raw in segment.text.splitlines():
            text = raw.strip()
            key = " ".join(text.lower().split())
            if not _HAS_WORD.search(text) or key in seen:
                continue
            seen.add(key)
            lines.append(Line(len(lines), segment.role, _cut(text), _score(segment, text, first)))
            first = False
    return lines


def _render(lines: Sequence[Line]) -> str:
    return "\n".join(f"{line.label}: {line.text}" for line in sorted(lines, key=lambda x: x.position))


def select(lines: Sequence[Line], tokenizer: ChatTokenizer, budget: int) -> str:
    """The best lines that fit `budget` tokens, in their original order.

    If not even the best line fits, its first `budget` tokens are kept, so a chunk never
    vanishes without a trace.
    """
    ranked = sorted(lines, key=lambda line: (-line.score, line.position))
    kept: list[Line] = []
    used = 0
    for line in ranked:
        cost = len(tokenizer.encode(f"{line.label}: {line.text}\n"))
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
    return select(candidate_lines(segments(history, tokenizer, start, end)), tokenizer, budget)
