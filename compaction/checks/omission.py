"""The omission check: what a compaction must never drop is looked for in its result, and pinned back if missing.

What must survive: every archive handle the summarised span carried (in the stubs of cleared tool output,
and in the summaries of earlier compactions summarised again: the model's summary of them may leave a
handle out), and each of the user's constraints the state ledger holds (`compaction.ledger`: its budget
may trim them last). Each one missing from the compacted history is written back, verbatim, in a block
of the compacted head; the stats count them (`omissions_repaired`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from compaction.archive import marker
from compaction.history import Message, template_view

HANDLES = re.compile(r"\barc-[0-9a-f]{24}\b")
REPAIRED_HEADER = "Kept by the omission check (verbatim; the recall tool returns what a handle names):"


def handles_in(messages: Iterable[Message]) -> tuple[str, ...]:
    """The distinct archive handles the messages name, in order (tool calls' arguments included)."""
    return tuple(dict.fromkeys(h for m in messages for h in HANDLES.findall(template_view(m)["content"])))


def missing(required: Sequence[str], messages: Sequence[Message]) -> list[str]:
    """The required texts (handles, constraint lines) that occur nowhere in `messages`."""
    text = "\n".join(template_view(m)["content"] for m in messages)
    return [item for item in dict.fromkeys(required) if item not in text]


def repaired(items: Sequence[str]) -> str:
    """The head's block for what went missing; empty when nothing did."""
    lines = [marker(i).strip() if HANDLES.fullmatch(i) else f"- {i}" for i in items]
    return "\n".join([REPAIRED_HEADER, *lines]) if items else ""
