"""One error hierarchy for the whole project.

The core raises these; the boundaries (HTTP ingress, CLI, Ray job) translate them once,
in one table, into status codes or exit messages.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

_UNION_TAG = re.compile(r"^(str|none|\w+\[.*\])$")  # pydantic's name of a union member in an error's location


def located(errors: Sequence[Any]) -> tuple[tuple[Any, ...], str]:
    """The location and message of the pydantic error that names the field best: the deepest one (a list
    content's `content[0].keep`, not its str branch), without pydantic's union-member tags."""
    first = max(errors, key=lambda e: len(e["loc"]))
    return tuple(p for p in first["loc"] if not _UNION_TAG.match(str(p))), first["msg"]


class CompactionError(Exception):
    """Base class: anything that made a compaction impossible. The caller's history is untouched."""


class InvalidInput(CompactionError, ValueError):
    """The request itself is wrong; retrying it unchanged cannot succeed."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class NothingToCompact(InvalidInput):
    """Everything in the history is kept verbatim (system messages, carried summaries, recent turns)."""


class ContextOverflow(InvalidInput):
    """A prompt would not fit the model's context window."""


class PromptTooLong(ContextOverflow):
    """A turn's prompt does not fit the model window. Worded as Anthropic's API words it, which agents read to
    compact (Claude Code, OpenCode): "prompt is too long: N tokens > M maximum"."""

    def __init__(self, tokens: int, maximum: int, field: str = "messages") -> None:
        super().__init__(
            field,
            f"prompt is too long: {tokens} tokens > {maximum} maximum; compact the history (context_management) "
            "or send fewer tokens",
        )
        self.tokens = tokens
        self.maximum = maximum


class UnknownModel(InvalidInput):
    """The request names a model the service does not host."""


class InvalidOutput(CompactionError):
    """The core produced a result that breaks its own contract (a bug); it is never returned."""


class BackendError(CompactionError):
    """The model backend failed (engine error, replica died, HTTP error)."""


class Overloaded(BackendError):
    """The backend is saturated; the caller may retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DeadlineExceeded(CompactionError):
    """The request's deadline (`timeout_s`) passed; its work was cancelled. Retry with a longer deadline."""

    def __init__(self, message: str, timeout_s: float) -> None:
        super().__init__(message)
        self.timeout_s = timeout_s


class ModelNotAvailable(CompactionError):
    """Model weights are missing and cannot be obtained (for example: offline)."""


class OverLimit(InvalidInput):
    """The request asks for more work than the model's caps allow (chunks per compaction, history tokens);
    the message says what to change."""
