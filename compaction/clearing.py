"""The cheapest tier: old tool output cleared, not summarised.

Most of a coding agent's history is tool output it has read already (the JetBrains study: 84 % of the
tokens). With the option `clearing`, a compaction first replaces the tool results of the span it
compacts by a one-line stub (how long it was, how it began, and with `archive`, the handle it is recalled
by; it quotes the output's first line and the line that names the most), and long string arguments of the
tool calls likewise (an edit's old and new text; a path stays); the
agent's own words, its calls and the user's messages stay verbatim.

`auto` (tiers): the newest turns of the span are cleared and kept, the older ones summarised as before,
and the border is chosen so that the compacted span is no larger than a summary of all of it would be (its
chunks times `max_chunk_summary_tokens`): clearing takes as much of the span as that room allows, the
summaries the rest. When the whole span fits cleared, no model is asked. `only`: the whole span cleared,
nothing summarised. `off`: summaries only. A tool result marked to keep (`compaction.keep`) is never cleared.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from compaction.archive import ArchivedChunk, handle_of, marker
from compaction.checks.grounding import salient_tokens
from compaction.history import Message, ToolCall
from compaction.keep import holds_marked
from compaction.options import CompactionOptions
from compaction.render import RenderedHistory
from compaction.tokenizer import ChatTokenizer

STUB = "[tool output cleared to save context"
MIN_CLEARED_TOKENS = 48  # shorter output stays: its stub would save little
INPUT_CHARS = 400  # a tool call's string argument longer than this is cleared too
LINE_CHARS = 120  # a line a stub quotes is cut past this


@dataclass(frozen=True)
class Clearing:
    """The tool output of messages [start, end) cleared: those messages as kept, and what they held."""

    start: int  # the first message kept cleared (the summarised span ends here)
    end: int  # one past the last (the verbatim tail starts here)
    messages: tuple[Message, ...]  # messages [start, end), cleared
    archived: tuple[ArchivedChunk, ...]  # each cleared output or input, verbatim
    saved_tokens: int  # tokens the clearing took out (estimated per message)

    @property
    def cleared(self) -> int:
        return len(self.archived)


def _short(line: str) -> str:
    line = line.strip().replace('"', "'")
    return line if len(line) <= LINE_CHARS else line[: LINE_CHARS - 1] + "…"


def key_line(text: str) -> str:
    """The output's line that names the most (salient tokens: numbers, paths, identifiers; a number counts
    once more), the first of equals; "" when no line names anything."""

    def names(line: str) -> int:
        return len(salient_tokens(line)) + any(c.isdigit() for c in line)  # a count or a port above a word

    lines = [line for line in text.splitlines() if line.strip() and len(line.strip()) <= LINE_CHARS]
    best = max(lines, key=names, default="")
    return best.strip() if best and names(best) else ""


def stub(text: str, tokens: int, handle: str | None) -> str:
    """The line a cleared tool result keeps: its size, how it began, the line that names the most (a count, a
    port, the failing test: what the agent most likely came for) and, archived, its handle."""
    first = next((line for line in text.splitlines() if line.strip()), "")
    key = key_line(text)
    held = f', it held "{_short(key)}"' if key and key != first.strip() else ""
    return f'{STUB}: {tokens} tokens, it began "{_short(first)}"{held}]' + (marker(handle) if handle else "")


def _cleared_result(
    message: Message, tokenizer: ChatTokenizer, archive: bool, tokens: int | None
) -> tuple[Message, ArchivedChunk, int]:
    text = message.text()
    tokens = len(tokenizer.encode(text)) if tokens is None else tokens
    handle = handle_of(text)
    kept = stub(text, tokens, handle if archive else None)
    saved = tokens - len(tokenizer.encode(kept))
    return (
        message.model_copy(update={"content": kept}),
        ArchivedChunk(handle=handle, chunk=-1, tokens=tokens, text=text),
        saved,
    )


def _cleared_call(
    call: ToolCall, tokenizer: ChatTokenizer, archive: bool
) -> tuple[ToolCall, ArchivedChunk, int] | None:
    """The call with its long string arguments cleared (None when none is long, or they are not JSON)."""
    try:
        arguments = json.loads(call.function.arguments or "{}")
    except ValueError:
        return None
    if not isinstance(arguments, dict):
        return None
    long = [k for k, v in arguments.items() if isinstance(v, str) and len(v) > INPUT_CHARS]
    if not long:
        return None
    text = f"{call.function.name}({call.function.arguments})"
    handle = handle_of(text)
    label = f"[cleared: {{}} chars{marker(handle) if archive else ''}]"
    new = {k: label.format(len(v)) if k in long else v for k, v in arguments.items()}
    cleared = json.dumps(new, ensure_ascii=False)
    saved = len(tokenizer.encode(call.function.arguments)) - len(tokenizer.encode(cleared))
    tokens = len(tokenizer.encode(text))
    function = call.function.model_copy(update={"arguments": cleared})
    return (
        call.model_copy(update={"function": function}),
        ArchivedChunk(handle=handle, chunk=-1, tokens=tokens, text=text),
        saved,
    )


@dataclass(frozen=True)
class Cleared:
    """One message with its tool output cleared (itself when nothing was), what it held, and the tokens saved."""

    message: Message
    archived: tuple[ArchivedChunk, ...]
    saved: int


def clear_one(message: Message, tokenizer: ChatTokenizer, archive: bool, tokens: int | None = None) -> Cleared:
    """The message with its tool output (a result, or long arguments of its calls) cleared, the originals kept.
    `tokens`: its content's tokens when known (the rendered history's), else they are counted."""
    dumped = message.model_dump(exclude_none=True)
    if holds_marked(dumped):
        return Cleared(message, (), 0)
    if message.role == "tool" and not message.text().startswith(STUB):
        cleared, original, saved = _cleared_result(message, tokenizer, archive, tokens)
        return Cleared(cleared, (original,), saved) if saved >= MIN_CLEARED_TOKENS else Cleared(message, (), 0)
    if message.role == "assistant" and message.tool_calls:
        done = [(call, _cleared_call(call, tokenizer, archive)) for call in message.tool_calls]
        if any(d for _, d in done):
            calls = [d[0] if d else call for call, d in done]
            return Cleared(
                message.model_copy(update={"tool_calls": calls}),
                tuple(d[1] for _, d in done if d),
                sum(d[2] for _, d in done if d),
            )
    return Cleared(message, (), 0)


def summary_room(tokens: int, options: CompactionOptions) -> int:
    """What summaries of `tokens` history tokens would take: their chunks times the budget (one when sequential)."""
    if tokens <= 0:
        return 0
    chunks = 1 if options.strategy == "sequential" else math.ceil(tokens / options.chunk_tokens)
    return chunks * options.max_chunk_summary_tokens


def tiers(
    history: RenderedHistory, head: int, tail_from: int, options: CompactionOptions, tokenizer: ChatTokenizer
) -> Clearing | None:
    """Where the summarised span ends and the cleared turns begin, and those turns cleared (None: clearing off,
    or it would take nothing)."""
    if options.clearing == "off" or tail_from <= head:
        return None
    sizes = [b - a for a, b in history.contents] if history.contents else [None] * len(history.messages)
    span = [clear_one(history.messages[i], tokenizer, options.archive, sizes[i]) for i in range(head, tail_from)]
    starts = (*history.message_starts, len(history.token_ids))
    start = head
    if options.clearing == "auto":  # the newest turns cleared, as many as the summaries' room allows
        room = summary_room(starts[tail_from] - starts[head], options)
        kept, start = 0, tail_from  # kept: tokens of messages [i, tail_from) once cleared
        for i in range(tail_from - 1, head - 1, -1):
            kept += starts[i + 1] - starts[i] - span[i - head].saved
            if history.messages[i].role != "tool" and kept + summary_room(starts[i] - starts[head], options) <= room:
                start = i
    mine = span[start - head :]
    archived = tuple(a for c in mine for a in c.archived)
    if not archived:
        return None
    return Clearing(start, tail_from, tuple(c.message for c in mine), archived, sum(c.saved for c in mine))
