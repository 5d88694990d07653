"""Extractive summaries: the most salient lines of a chunk, verbatim, in order. No model call.

`strategy: extractive` summarises every chunk this way (milliseconds), and it replaces a model
summary that stays ungrounded after its retry. A line scores for what an agent needs later:
the user's instructions and constraints, errors and stack-trace heads, file paths, decisions,
numbers, the first line of each tool result and the tool calls whose result reports a failure
(the command that reproduces it). A line that names nothing (no path, number, name or
identifier) gets no bonus for sounding like a constraint or a decision ("I'll do my best"),
unless it is an instruction in the imperative ("Never edit ..."); a name on most of the span's
lines names nothing in particular; and a line of a shape that repeats (listings, "saved
plots/p_12.png", "count 41.5") weighs less the more copies there are: routine output, not a
fact.

A conversation between people (no tool in the span; most messages open with their speaker's
name, "Caroline: ...", as LoCoMo's turns do) is weighed for the facts its lines state, whoever
says them: what someone did or plans, when (yesterday, last week, 2022), the people, places and
groups it names (the speakers' own names, "Mel" for "Melanie", name nothing). A sentence that
only greets, thanks, reacts, compliments or asks ("Hey Caroline! Good to see you!", "Wow, that's
great!", "What now?") states nothing, and a line of such sentences scores 0.

The best lines that fit the token budget are kept word for word, each labelled with its
speaker, in their original order; nothing is invented, so such a summary is grounded by
construction.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from compaction.checks.grounding import salient_tokens
from compaction.history import template_view
from compaction.render import RenderedHistory
from compaction.tokenizer import ChatTokenizer

MAX_LINE_CHARS = 300  # a longer line is cut at a word border (minified files, long logs)
LONG_LINE_CHARS = 120  # a longer line of prose is taken sentence by sentence
_CONSTRAINT = re.compile(
    r"\b(must|never|always|don't|do not|only|should|shouldn't|need to|needs to|required?|make sure|please|"
    r"avoid|without|keep|no longer)\b",
    re.IGNORECASE,
)
# An instruction in the imperative ("Never edit ...", "Please count only ...") weighs even if it names nothing.
_IMPERATIVE = re.compile(r"^\W*(please|never|always|only|do not|don't|avoid|make sure|keep|use|must)\b", re.IGNORECASE)
# Test and runtime failures, not code that merely names an exception (`raise ValueError(...)`).
_ERROR = re.compile(
    r"^(FAILED|ERROR|E {2,}|Traceback)|\b\w*(Error|Exception)\b:|\berror:|"
    r"\b(failed|failure|fatal|panic|errno|denied|segmentation fault|not found)\b",
    re.IGNORECASE,
)
_DECISION = re.compile(
    r"\b(decided?|decision|will|i'll|we'll|let's|plan|chose|choose|going to|found it|root cause|because|instead|"
    r"the fix|fix(?:ed)? by|switch(?:ed)? to|conclu\w*|comes from|caused by|turns out)\b",
    re.IGNORECASE,
)
_TOOL_CALL = re.compile(r"^\[tool call\b")
_CALL_LINE = re.compile(r"^\[tool call\b", re.MULTILINE)
CALL_TAG = re.compile(r"^\[tool (call|result)[^\]]*\]")
_CALL_ID = re.compile(r"^\[tool (?:call|result) ([^\]]+)\]", re.MULTILINE)
_DIGITS = re.compile(r"\d+")
_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z\[\"'(`])")
_HAS_WORD = re.compile(r"\w")
_CUT_WORD_START = re.compile(r"^\S+")
_CUT_WORD_END = re.compile(r"\S+$")
_LABELLED = re.compile(r"^(?:system|user|assistant|tool): ")
_FILE = re.compile(r"\w\.[a-z]{1,5}$")
# Dialogue (`_dialogue_score`). A message voiced by a named speaker: "Caroline: ..." at a line start.
_SPEAKER = re.compile(r"^([A-Z][\w'-]*): ", re.MULTILINE)
_CLAUSE = re.compile(r"(?<=[.!?])\s+")
_FIRST_PERSON = re.compile(r"\b(i|me|my|mine|we|us|our)\b", re.IGNORECASE)
_SECOND_PERSON = re.compile(r"\b(you|your|yours|yourself)\b", re.IGNORECASE)
# A sentence opened by a greeting, thanks, a farewell, agreement or a reaction to the other speaker states nothing
# unless it gives a time ("Hey Mel!", "Thanks so much!", "I 100% agree, Mel.", "I'm so proud of you!").
_PHATIC = re.compile(
    r"^\W*(hey|hi|hello|thanks|thank you|bye|goodbye|take care|talk (to you )?(soon|later)|see you|good to see|"
    r"(i )?(\S+ )?agree|i'm (so |really )?(glad|happy|proud|sorry) (for |of |to hear |that )?you)\b",
    re.IGNORECASE,
)
_WHEN = re.compile(
    r"\b(yesterday|today|tonight|tomorrow|recently|\w+ ago|weekends?|(mon|tues|wednes|thurs|fri|satur|sun)days?|"
    r"(last|next|this|every) (week|month|year|night|morning|evening|summer|winter|spring|fall)|(19|20)\d\d|"
    r"\d+ (years?|months?|weeks?|days?))\b",
    re.IGNORECASE,
)
_MONTH = re.compile(r"\b(January|February|March|April|May|June|July|August|September|October|November|December)\b")
# What someone did or will do: a first person's past-tense verb, or a plan.
_ACT = re.compile(
    r"\b(i|we)( just| recently| finally| also| actually)? (\w+ed|went|ran|saw|made|took|got|met|bought|began|did|"
    r"gave|found|left|came|won|wrote|read|told|sang|swam|drove|flew|built|heard|held|lost|paid|sent|spent|taught)\b|"
    r"\b(gonna|going to|(plan|want|hope|dream)(s|ed|ing)? (to|of)|(thinking|thought) (of|about)|keen on|looking into|"
    r"about to|will|i'll|we'll|i'd love to)\b",
    re.IGNORECASE,
)
COMMON_LINES, COMMON_SHARE = 8, 0.05  # a salient token in this many lines, and this share of them, is common


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

    A message wholly inside is its content as `template_view` writes it; a message cut by a border is its
    content's tokens in the range, decoded (no template markup), without the word the border cuts (a token
    border can split `retry_out` into `retry` | `_out`), with the view's text before the content (a tool
    result's tag) when the range holds the content's start and after it (an assistant's calls) when it holds
    the message's end.
    """
    bounds = (*history.message_starts, len(history.token_ids))
    out: list[Segment] = []
    for i, message in enumerate(history.messages):
        first, last = bounds[i], bounds[i + 1]
        if last <= start or first >= end:
            continue
        view = template_view(message)["content"]
        if first >= start and last <= end:
            text = view
        else:
            a, b = history.contents[i]
            own = message.text()
            before, _, after = view.partition(own) if own else ("", "", view)
            text = tokenizer.decode(history.token_ids[max(a, start) : min(b, end)])
            text = _CUT_WORD_START.sub("", text) if a < start else before + text
            text = _CUT_WORD_END.sub("", text) if b > end else text + (after if last <= end else "")
        out.append(Segment(i, message.role, text, first >= start))
    return out


def _score(segment: Segment, text: str, first_line: bool, w: Weights) -> float:
    """Salience of one line: who says it, what kind of line it is, what it names (`w`: the span's weights)."""
    salient = [t for t in salient_tokens(text) if t not in w.common]
    if w.speakers:
        return _dialogue_score(text, salient, w.speakers)
    if not salient and len(text.split()) < 3:
        return 0.0  # "ok", "thanks": nothing to keep
    tool = segment.role == "tool"
    call = _TOOL_CALL.match(text) is not None
    names = 1.0 if salient else 0.0  # a constraint or a decision that names nothing weighs little
    score = min(1.0 if tool else 2.0, 0.5 * len(salient))
    if segment.role == "user":
        instruction = _CONSTRAINT.search(text) and (salient or _IMPERATIVE.match(text))
        score += 2.0 + (5.0 if instruction else 0.0)
    elif segment.role == "assistant" and not call:
        score += 3.0 + (4.0 * names if _DECISION.search(text) else 0.0)
    if _ERROR.search(text):
        score += 4.0 if salient or tool else 1.0
    if any("/" in t or _FILE.search(t) for t in salient):
        score += 2.0
    if any(t[0].isdigit() for t in salient):
        score += 1.0
    if tool and first_line:
        score += 2.0
    if call:
        score += 1.0 + (4.0 if _failure(text, w.failed) else 0.0)
    return score


def _speaker(token: str, speakers: frozenset[str]) -> bool:
    """A speaker's name, or its short form ("mel" for "melanie")."""
    return any(name == token or (len(token) >= 3 and name.startswith(token)) for name in speakers)


def _states(sentence: str, named: Sequence[str]) -> bool:
    """A sentence of a conversation states something: it gives a time; else, neither a question nor a greeting
    (`_PHATIC`), it names something, speaks of the speaker ("I", "we") or of an act or a plan not the listener's
    ("Researching adoption agencies - it's been a dream to have a family."). A reaction or a compliment ("That's
    so cool!", "You'd be a great counselor!") does not."""
    if sentence.rstrip().endswith("?"):
        return False
    if _WHEN.search(sentence) or _MONTH.search(sentence):
        return True
    if _PHATIC.match(sentence):
        return False
    if named or _FIRST_PERSON.search(sentence):
        return True
    return _ACT.search(sentence) is not None and _SECOND_PERSON.search(sentence) is None


def _dialogue_score(text: str, salient: Sequence[str], speakers: frozenset[str]) -> float:
    """Salience of a line of a conversation between people, whoever says it: 0 unless one of its sentences
    states something (`_states`); then 1, plus what those sentences name (0.5 a name, up to 2), a time (2; a
    date is a time, not names and numbers), else a number (1), and an act or a plan of someone's (1)."""
    said = []
    for sentence in _CLAUSE.split(_SPEAKER.sub("", text, count=1)):
        named = [t for t in salient_tokens(sentence) if t in salient and not _speaker(t, speakers)]
        if _states(sentence, named):
            said.append((sentence, named))
    if not said:
        return 0.0  # greetings, thanks, reactions, questions
    stated = " ".join(sentence for sentence, _ in said)
    tokens = {t for _, named in said for t in named}
    names = [t for t in tokens if not t[0].isdigit() and not _MONTH.fullmatch(t.capitalize())]
    score = 1.0 + min(2.0, 0.5 * len(names))
    if _WHEN.search(stated) or _MONTH.search(stated):
        score += 2.0
    elif len(names) < len(tokens):
        score += 1.0  # a number
    if _ACT.search(stated):
        score += 1.0
    return score


def _shape(text: str) -> str:
    """A line with its numbers and salient tokens blanked: lines of one shape are copies of one routine."""
    out = _DIGITS.sub("#", CALL_TAG.sub("", text).lower())
    for token in salient_tokens(text):
        out = out.replace(_DIGITS.sub("#", token), "")
    return " ".join(out.split())


def _failure(text: str, failed: frozenset[str]) -> bool:
    """The line reports a failure, or is a tool call whose result does."""
    tag = _CALL_ID.match(text)
    return _ERROR.search(text) is not None or (tag is not None and tag.group(1) in failed)


def _failed_calls(parts: Sequence[Segment]) -> frozenset[str]:
    """Ids of the tool calls whose result (in these segments) reports a failure."""
    out = set()
    for segment in parts:
        if segment.role == "tool" and _ERROR.search(segment.text):
            out.update(_CALL_ID.findall(segment.text[:200]))
    return frozenset(out)


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


def _texts(parts: Sequence[Segment]) -> list[tuple[Segment, str, bool]]:
    """(segment, line, opens its message) for every distinct non-trivial line (call ids aside), cut to length."""
    seen: set[str] = set()
    out: list[tuple[Segment, str, bool]] = []
    for segment in parts:
        first = segment.opens_message
        for text in _units(segment.text):
            key = " ".join(CALL_TAG.sub("", text).lower().split())
            if not _HAS_WORD.search(text) or key in seen:
                continue
            seen.add(key)
            out.append((segment, _cut(text), first))
            first = False
    return out


@dataclass(frozen=True)
class Weights:
    """What a span's lines weigh against each other (`weights`)."""

    common: frozenset[str]  # salient tokens too frequent to name anything in particular
    shapes: Counter[str]  # lines per shape
    failed: frozenset[str]  # ids of the tool calls whose result reports a failure
    speakers: frozenset[str] = frozenset()  # the speakers' names (lower case) when the span is a dialogue


def _speakers(parts: Sequence[Segment]) -> frozenset[str]:
    """The speakers' names, lower case, when the segments are a conversation between people: no tool result
    or call, and at least half of the messages they open name their speaker ("Caroline: ..."); else none."""
    if any(p.role == "tool" or _CALL_LINE.search(p.text) for p in parts):
        return frozenset()
    opened = [p for p in parts if p.opens_message]
    names = [m.group(1).lower() for m in (_SPEAKER.search(p.text) for p in opened) if m]
    return frozenset(names) if opened and 2 * len(names) >= len(opened) else frozenset()


def weights(parts: Sequence[Segment]) -> Weights:
    """Counted over a span: a salient token that many lines name (the two speakers' names, the project's
    name) names nothing in particular, and a line of a shape many lines share is routine; and whether the
    span is a dialogue, between whom."""
    texts = _texts(parts)
    named = Counter(t for _, text, _ in texts for t in salient_tokens(text))
    common = frozenset(t for t, n in named.items() if n >= max(COMMON_LINES, COMMON_SHARE * len(texts)))
    shapes = Counter(_shape(text) for _, text, _ in texts)
    return Weights(common, shapes, _failed_calls(parts), _speakers(parts))


def candidate_lines(parts: Sequence[Segment], weighed: Weights | None = None) -> list[Line]:
    """Every distinct non-trivial line of the segments, scored (a repeated line counts once, call ids aside).

    `weighed`: the span's weights (default: the segments' own). A line whose shape n lines share loses
    log2(n) of its score, at most 3, unless it reports a failure.
    """
    texts = _texts(parts)
    w = weighed or weights(parts)
    lines: list[Line] = []
    for segment, text, first in texts:
        score = _score(segment, text, first, w)
        routine = 0.0 if _failure(text, w.failed) else min(3.0, math.log2(max(1, w.shapes[_shape(text)])))
        lines.append(Line(len(lines), segment.role, text, max(0.0, score - routine)))
    return lines


def written(line: Line) -> str:
    """A kept line as a summary writes it: after its speaker's label, unless it has one (a line pinned in an
    earlier compaction's summary, met again when that summary is compacted: "user: assistant: …" would grow)."""
    return line.text if _LABELLED.match(line.text) else f"{line.label}: {line.text}"


def render_lines(lines: Sequence[Line]) -> str:
    """Kept lines, each as `written`, in their original order."""
    return "\n".join(written(line) for line in sorted(lines, key=lambda x: x.position))


def select(lines: Sequence[Line], tokenizer: ChatTokenizer, budget: int, chars_per_token: float) -> str:
    """The best lines that fit `budget` tokens, in their original order (a line scoring 0 never, unless all do).

    Lines are costed by characters (`chars_per_token`, the chunk's own ratio), and the result is
    then tokenised once and trimmed from its least salient line until it fits: one tokenizer call
    per chunk instead of one per line. If not even the best line fits, its first `budget` tokens
    are kept (less the word the cut splits), so a chunk never vanishes without a trace.
    """
    ranked = sorted([line for line in lines if line.score > 0] or lines, key=lambda line: (-line.score, line.position))
    kept: list[Line] = []
    used = 0.0
    for line in ranked:
        cost = (len(written(line)) + 1) / chars_per_token
        if used + cost <= budget:
            kept.append(line)
            used += cost
    while kept and len(tokenizer.encode(render_lines(kept))) > budget:
        kept.remove(min(kept, key=lambda line: (line.score, -line.position)))
    if kept or not ranked:
        return render_lines(kept)
    cut = tokenizer.decode(tokenizer.encode(written(ranked[0]))[:budget]).strip()
    return _CUT_WORD_END.sub("", cut).rstrip() or cut  # not the word the cut split ("38128" is not "38")


def extract(history: RenderedHistory, tokenizer: ChatTokenizer, start: int, end: int, budget: int) -> str:
    """The extractive summary of history tokens [start, end) within `budget` tokens."""
    parts = segments(history, tokenizer, start, end)
    chars = sum(len(p.text) for p in parts)
    return select(candidate_lines(parts), tokenizer, budget, max(1.0, chars / max(1, end - start)))
