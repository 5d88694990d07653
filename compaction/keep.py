"""What the user marked to keep is never summarised away: `<keep>…</keep>` spans, and messages or text parts
sent with `"keep": true`.

Any message of the compacted span (the user's, the agent's, a tool result, an earlier summary) may
hold spans marked `<keep>…</keep>`; a message or a text part may be marked whole by its `keep` field
(its text then stands as if it were wrapped in the markers, markers inside it dropped). Each marked
text is written verbatim, markers included, under a header in the compacted head, in the order met,
each distinct text once: a later compaction that summarises that head again finds the same spans and
keeps them again, so a marked rule survives a chain of compactions. The marked text must leave room
for the rest: at most a quarter of the model's window, or the compaction is refused naming `messages`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from compaction.errors import InvalidInput
from compaction.history import Message, template_view
from compaction.tokenizer import ChatTokenizer

KEEP = re.compile(r"<keep>(.*?)</keep>", re.DOTALL | re.IGNORECASE)
MARKERS = re.compile(r"</?keep>", re.IGNORECASE)
KEPT_HEADER = "Marked to keep, verbatim:"
WINDOW_SHARE = 0.25  # of the model's window, at most, for the marked spans


def marked_to_keep(messages: Sequence[Message]) -> tuple[str, ...]:
    """The distinct `<keep>` spans of `messages` (their inner text, stripped), in order."""
    kept: dict[str, None] = {}
    for message in messages:
        for marked in _marked(message):
            text = marked.strip()
            if text:
                kept.setdefault(text)
    return tuple(kept)


def _marked(message: Message) -> list[str]:
    """The marked texts of one message: all of it (tool calls and the tool result's id included) when its
    `keep` is true, else its text parts marked `keep` and the `<keep>` spans of the rest."""
    if message.keep:
        return [MARKERS.sub("", template_view(message)["content"])]
    parts = message.content if isinstance(message.content, list) else []
    whole = [MARKERS.sub("", part.text) for part in parts if part.keep]
    rest = "".join(part.text for part in parts if not part.keep) if parts else message.text()
    return [*whole, *(match.group(1) for match in KEEP.finditer(rest))]


def holds_marked(message: dict[str, Any]) -> bool:
    """Whether a chat message (a dict, as the wire formats pass them) is marked to keep, whole or in part."""
    content = message.get("content")
    parts = content if isinstance(content, list) else [{"text": content}]
    return message.get("keep") is True or any(
        isinstance(p, dict) and (p.get("keep") is True or KEEP.search(str(p.get("text") or ""))) for p in parts
    )


def wrapped(text: str) -> str:
    """The text between the markers, as the compacted head writes it."""
    return f"<keep>{text}</keep>"


def render_kept(texts: Sequence[str]) -> str:
    """The block written in the compacted head; empty when nothing is marked."""
    return "\n".join([KEPT_HEADER, *(wrapped(t) for t in texts)]) if texts else ""


def check_kept(texts: Sequence[str], tokenizer: ChatTokenizer, context_window: int) -> None:
    """The marked spans fit their share of the window, or InvalidInput says how much they hold."""
    if not texts:
        return
    tokens = len(tokenizer.encode(render_kept(texts)))
    if tokens > context_window * WINDOW_SHARE:
        raise InvalidInput(
            "messages",
            f"the <keep>…</keep> spans of the messages to compact hold {tokens} tokens, over a quarter of the "
            f"model's {context_window}-token window; mark less to keep, or let the rest be summarised",
        )


def keep_flag(item: dict[str, Any], at: str) -> bool:
    """An item's `keep` field as the wire formats take it: true, false or absent (null); anything else is refused."""
    value = item.get("keep")
    if value is not None and not isinstance(value, bool):
        raise InvalidInput(f"{at}.keep", "must be true or false: true keeps the text verbatim through compactions")
    return value is True


def keep_field(item: dict[str, Any], at: str) -> dict[str, bool]:
    """`{"keep": True}` for a wire item marked to keep (to spread into its chat message), else nothing."""
    return {"keep": True} if keep_flag(item, at) else {}
