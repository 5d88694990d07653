"""What the user marked to keep: `<keep>…</keep>` spans are never summarised away.

Any message of the compacted span (the user's, the agent's, a tool result, an earlier summary) may
hold spans marked `<keep>…</keep>`. Each one is written verbatim, markers included, under a header
in the compacted head, in the order met, each distinct text once: a later compaction that
summarises that head again finds the same spans and keeps them again, so a marked rule survives a
chain of compactions. The marked text must leave room for the rest: at most a quarter of the
model's window, or the compaction is refused naming `messages`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from compaction.errors import InvalidInput
from compaction.history import Message
from compaction.tokenizer import ChatTokenizer

KEEP = re.compile(r"<keep>(.*?)</keep>", re.DOTALL | re.IGNORECASE)
KEPT_HEADER = "Marked to keep, verbatim:"
WINDOW_SHARE = 0.25  # of the model's window, at most, for the marked spans


def marked_to_keep(messages: Sequence[Message]) -> tuple[str, ...]:
    """The distinct `<keep>` spans of `messages` (their inner text, stripped), in order."""
    kept: dict[str, None] = {}
    for message in messages:
        for match in KEEP.finditer(message.text()):
            text = match.group(1).strip()
            if text:
                kept.setdefault(text)
    return tuple(kept)


def render_kept(texts: Sequence[str]) -> str:
    """The block written in the compacted head; empty when nothing is marked."""
    return "\n".join([KEPT_HEADER, *(f"<keep>{t}</keep>" for t in texts)]) if texts else ""


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
