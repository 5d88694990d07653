"""The user's own words, kept verbatim beside the summary: what a compaction must never paraphrase away.

Of the compacted span's user messages (never tool results, never the summaries of earlier
compactions), the newest are kept while together they fit a token budget; a message that does
not fit is left to the summary and older ones are still tried. Repeats are kept once, and the
kept ones are written in their original order under a header, in the compacted head. Codex CLI
keeps the user's recent messages the same way (up to 20,000 tokens of a 272k window); the
default budget is the same share of the model's window.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from compaction.history import ChatTokenizer, Message
from compaction.options import CompactionOptions

USER_WORDS_HEADER = "The user's words, verbatim:"
WINDOW_SHARE = 0.075  # Codex: 20,000 tokens of a 272,000-token window


def budget(options: CompactionOptions, context_window: int) -> int:
    """The user-words budget: the option, or its share of the model window."""
    if options.user_words_tokens is not None:
        return options.user_words_tokens
    return int(context_window * WINDOW_SHARE)


@dataclass(frozen=True)
class UserWords:
    """The user messages kept verbatim, in their original order, and how many were not."""

    texts: tuple[str, ...]  # kept, oldest first
    total: int  # distinct user messages in the span
    tokens: int  # tokens of the kept texts (each tokenised alone)

    @property
    def dropped(self) -> int:
        return self.total - len(self.texts)

    def render(self) -> str:
        """The block written after the summary in the compacted head; empty when nothing is kept."""
        if not self.texts:
            return ""
        return "\n".join([USER_WORDS_HEADER, *(f"- {t}" for t in self.texts)])


def keep(
    messages: Sequence[Message], tokenizer: ChatTokenizer, limit: int, skip: Callable[[Message], bool]
) -> UserWords:
    """The newest distinct user messages of `messages` within `limit` tokens (`skip`: earlier summaries)."""
    seen: set[str] = set()
    distinct: list[str] = []
    for message in messages:
        text = message.text().strip()
        key = " ".join(text.lower().split())
        if message.role == "user" and key and key not in seen and not skip(message):
            seen.add(key)
            distinct.append(text)
    kept: list[str] = []
    used = 0
    for text in reversed(distinct):
        if limit <= used:
            break
        cost = len(tokenizer.encode(text)) + 2  # the "- " and the line break
        if used + cost <= limit:
            kept.append(text)
            used += cost
    return UserWords(tuple(reversed(kept)), len(distinct), used)
