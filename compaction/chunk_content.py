"""What a chunk holds, and the tail instructions that ask for it: a pure classifier over the chunk's messages.

Four kinds, by the share of the chunk's tokens each kind of message covers:
- `tool_output`: tool results (test runs, logs, listings) dominate: keep commands, errors, paths, numbers;
- `code`: code or diffs dominate (in tool results or prose): keep files, names, what each change does;
- `requests`: the user speaks most (well over half): keep every request and constraint in the user's words;
- `dialogue`: anything else, a conversation: keep who said what, names, dates, plans.

The choice depends only on the chunk's own messages, so a chunk's tail (and the chunk-summary
cache's key) is the same in every compaction that cuts the same chunk. Instructions are our own
text: they are not a source a summary may take facts from (`compaction.checks.grounding`).
"""

from __future__ import annotations

import bisect
import re
from typing import Literal

from compaction.history import template_view
from compaction.options import CompactionOptions
from compaction.partition import Chunk
from compaction.render import RenderedHistory

ContentKind = Literal["tool_output", "code", "requests", "dialogue"]
Choice = ContentKind | Literal["caller"] | None  # what a tail asks for; caller: a chunk_instructions entry

INSTRUCTIONS: dict[ContentKind, str] = {
    "tool_output": "This part is mostly tool output: keep the commands run, the exact error messages and failing "
    "test names, file paths and the numbers the outputs report.",
    "code": "This part is mostly code: keep the file paths, the function and class names, and what each change "
    "or diff does.",
    "requests": "This part is mostly the user's requests: keep every request, constraint and preference of the "
    "user in their own words.",
    "dialogue": "This part is a conversation: keep who said what, names, dates, places, plans and decisions.",
}

_CODE_LINE = re.compile(
    r"^\s*(def |class |import |from \S+ import |return\b|if .*:$|for .*:$|@@ |[+-]{3} |diff --git|#include|"
    r"(const|let|var|func|fn|pub) \w)|^[+-](?![+-])\S|[;{}]\s*$|^\s{4,}\S"
)
TOOL_SHARE = 0.5  # tool results over half the chunk: tool_output (unless code dominates them)
CODE_SHARE = 0.4  # code-like lines over 40 % of the chunk's text: code
USER_SHARE = 0.6  # user messages over 60 % of the chunk: requests (a two-sided dialogue is about half)


def code_share(text: str) -> float:
    """Share of a text's non-empty lines that look like code or a diff."""
    lines = [line for line in text.splitlines() if line.strip()]
    return sum(_CODE_LINE.search(line) is not None for line in lines) / len(lines) if lines else 0.0


def classify(history: RenderedHistory, chunk: Chunk) -> ContentKind:
    """The kind of content of history tokens [chunk.start, chunk.end), from the messages it overlaps.

    Each message weighs as many tokens as it has inside the chunk; a tool call counts as the assistant's.
    """
    bounds = (*history.message_starts, len(history.token_ids))
    first = max(bisect.bisect_right(history.message_starts, chunk.start) - 1, 0)
    weight = {"tool": 0.0, "user": 0.0, "code": 0.0}
    total = 0.0
    for i in range(first, len(history.messages)):
        if bounds[i] >= chunk.end:
            break
        tokens = min(bounds[i + 1], chunk.end) - max(bounds[i], chunk.start)
        if tokens <= 0:
            continue
        message = history.messages[i]
        total += tokens
        weight["code"] += tokens * code_share(template_view(message)["content"])
        if message.role in weight:
            weight[message.role] += tokens
    if not total:
        return "dialogue"
    if weight["code"] / total >= CODE_SHARE:
        return "code"
    if weight["tool"] / total >= TOOL_SHARE:
        return "tool_output"
    if weight["user"] / total >= USER_SHARE:
        return "requests"
    return "dialogue"


def choice(history: RenderedHistory, options: CompactionOptions, chunk: Chunk) -> Choice:
    """What chunk `chunk.index`'s tail asks for: a kind, `caller` (its chunk_instructions entry), or None (off)."""
    if chunk.index in (options.chunk_instructions or {}):
        return "caller"
    return classify(history, chunk) if options.tail_by_content else None


def content_instructions(history: RenderedHistory, options: CompactionOptions, chunk: Chunk) -> str | None:
    """The instructions chosen for the chunk's content, or None when the caller's own replace them (or off)."""
    kind = choice(history, options, chunk)
    return None if kind is None or kind == "caller" else INSTRUCTIONS[kind]
