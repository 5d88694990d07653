"""What makes a chat history valid for the OpenAI chat API, and where a kept tail may start.

The rules the OpenAI API (and many chat templates) enforce on tool traffic:
- a `tool` message answers, by `tool_call_id`, one call of the assistant turn that opens its block
  (the assistant message with `tool_calls` right before the run of tool messages it belongs to);
- every call of an assistant `tool_calls` turn is answered, once, in the tool messages right after it.

A compaction keeps the leading messages and a recent tail verbatim around one summary message;
the tail must start on a turn boundary (never on a tool message), so every call stays with all
its results. Inputs are checked with `check_history` (a caller error names the message); every
compaction output is checked with `check_output` (a violation is a bug of the core).
"""

from __future__ import annotations

from collections.abc import Sequence

from compaction.errors import InvalidInput, InvalidOutput
from compaction.history import Message


def problems(messages: Sequence[Message]) -> list[tuple[str, str]]:
    """(field, what is wrong) for every violation, in message order; empty when the history is valid."""
    found: list[tuple[str, str]] = []
    open_calls: dict[str, int] = {}  # unanswered call id -> index of the assistant turn that made it
    opener: int | None = None  # the assistant turn whose results may follow here
    for i, message in enumerate(messages):
        if message.role == "tool":
            field = f"messages[{i}].tool_call_id"
            if opener is None:
                found.append((f"messages[{i}]", "a tool result with no assistant tool_calls turn right before it"))
            elif message.tool_call_id not in open_calls:
                found.append((field, f"{message.tool_call_id!r} answers no open call of messages[{opener}]"))
            else:
                del open_calls[message.tool_call_id]
            continue
        found += [(f"messages[{at}].tool_calls", f"call {cid!r} has no tool result") for cid, at in open_calls.items()]
        open_calls, opener = {}, None
        if message.role == "assistant" and message.tool_calls:
            ids = [call.id for call in message.tool_calls]
            if len(set(ids)) != len(ids) or "" in ids:
                found.append((f"messages[{i}].tool_calls", "every call needs its own non-empty id"))
            open_calls, opener = dict.fromkeys(ids, i), i
    found += [(f"messages[{at}].tool_calls", f"call {cid!r} has no tool result") for cid, at in open_calls.items()]
    return found


def check_history(messages: Sequence[Message]) -> None:
    """Refuse a history the chat API would refuse, naming the first offending message."""
    found = problems(messages)
    if found:
        field, what = found[0]
        raise InvalidInput(field, f"{what}; send every tool result right after the assistant turn that called it")


def check_output(messages: Sequence[Message]) -> None:
    """A compacted history must be valid: anything else is a bug of the compaction, never returned."""
    found = problems(messages)
    if found:
        raise InvalidOutput(f"the compacted history is not a valid chat history ({found[0][0]}: {found[0][1]})")


def turn_start(messages: Sequence[Message], index: int, floor: int) -> int:
    """Where a kept tail that should start at `index` may start: never inside a tool block.

    Moves back to the assistant turn that opened the block (the tail grows, so calls keep all
    their results); if that would reach `floor` (the kept head), moves forward past the block.
    """
    back = index
    while floor < back < len(messages) and messages[back].role == "tool":
        back -= 1
    if back > floor or index >= len(messages) or messages[index].role != "tool":
        return back
    ahead = index
    while ahead < len(messages) and messages[ahead].role == "tool":
        ahead += 1
    return ahead
