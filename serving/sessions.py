"""Compaction inside chat turns, on the coordinator: background snapshots per session, and each turn's outcome.

A plain class (no Ray import) owned by the coordinator. The decisions are `compaction.policy`'s;
this module runs them: it starts a background compaction of a session's snapshot, keeps it (a
bounded cache of sessions, found again through session affinity), and on the turn that crosses
the hard threshold splices its result onto the grown history, waiting only for what is left of it.
When the prompt a turn is answered from already wants a background run (past background_threshold,
or one more turn like this one would pass compact_threshold), that prompt is the next snapshot.

Nothing here is needed for correctness: the client carries the compacted history, so losing this
state (a restart, an eviction) costs only a recomputation.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from compaction.errors import CompactionError, InvalidInput, NothingToCompact
from compaction.history import ChatTokenizer, Message
from compaction.policy import (
    Background,
    ContextManagement,
    Snapshot,
    decide,
    message_digests,
    prompt_tokens,
    spliced,
    wants_background,
)
from serving.coordinator import CompactJob, ServiceResult, ServiceStats

Status = Literal["applied", "running", "none"]
CompactFn = Callable[[CompactJob], Coroutine[Any, Any, ServiceResult]]  # the coordinator's admission entry


class ChatTurn(BaseModel):
    """One chat turn with context management, as the ingress hands it to the coordinator."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    model: str
    messages: list[Message] = Field(description="The request's messages, validated.")
    entry: ContextManagement = Field(description="The request's compaction entry.")
    session_id: str | None = Field(description="x-session-id; background compaction needs one.")
    prompt_tokens: int = Field(description="Tokens of the request's rendered prompt, counted by the ingress.")
    growth: int = Field(0, description="The most one turn of this session grew its prompt lately (tokens).")
    room: int = Field(description="The most prompt tokens the model window takes beside the reply budget.")


class TurnCompaction(BaseModel):
    """The `compaction` object of a chat response."""

    model_config = ConfigDict(frozen=True)
    status: Status = Field(
        description="applied: the turn was answered from messages + request.messages[replaces_through:]; "
        "running: a background compaction of this session is under way (or done, waiting for the threshold); "
        "none: the prompt was answered as sent."
    )
    messages: list[Message] | None = Field(
        None, description="applied: the compacted head (kept system messages, carried and new summary)."
    )
    replaces_through: int | None = Field(
        None, description="applied: the client continues from messages + history[replaces_through:]."
    )
    stall_s: float = Field(0.0, description="How long this turn waited for compaction.")
    prompt_tokens: int = Field(description="Tokens of the prompt as sent.")
    compacted_prompt_tokens: int | None = Field(None, description="applied: tokens of the prompt answered.")
    source: Literal["background", "blocking"] | None = Field(None, description="applied: which compaction.")
    note: str | None = Field(None, description="Why a compaction was not applied or fell back, when it matters.")
    stats: ServiceStats | None = Field(None, description="applied: the compaction's stats (the last one if two).")


@dataclass
class _Running:
    """A background compaction of one session's snapshot."""

    snapshot: Snapshot  # the messages it summarises
    task: asyncio.Task[ServiceResult]

    def state(self, digests: Sequence[str]) -> Background:
        if not self.snapshot.covers(digests):
            return "absent"  # the client's history moved on (edited, or compacted by other means)
        if not self.task.done():
            return "running"
        return "failed" if self.task.cancelled() or self.task.exception() is not None else "done"


class SessionCompactions:
    """Per-session background compactions and the turn logic (one instance per coordinator replica)."""

    def __init__(
        self, compact: Callable[[CompactJob], Coroutine[Any, Any, ServiceResult]], *, max_sessions: int = 4096
    ) -> None:
        self._compact = compact
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, _Running] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    async def turn(self, turn: ChatTurn, tokenizer: ChatTokenizer) -> TurnCompaction:
        """Decide and do this turn's compaction (see compaction.policy). Raises only for the caller's own errors."""
        began = time.perf_counter()
        digests = message_digests(turn.messages)
        running = self._sessions.get(turn.session_id) if turn.session_id else None
        state: Background = running.state(digests) if running else "absent"
        action = decide(turn.prompt_tokens, turn.entry, state, turn.session_id is not None, turn.growth)
        if action == "start_background":
            self._start(turn, turn.messages, digests)
            return TurnCompaction(status="running", prompt_tokens=turn.prompt_tokens)
        if action == "none":
            status: Status = "running" if state in ("running", "done") else "none"
            return TurnCompaction(status=status, prompt_tokens=turn.prompt_tokens)
        note = None
        result = None
        if running is not None and state != "absent":  # apply or wait for it; if it failed, say why
            result, note = await self._finish(running)
            self._sessions.pop(turn.session_id or "", None)
        source: Literal["background", "blocking"] = "background" if result is not None else "blocking"
        try:
            return await self._apply(turn, tokenizer, result, source, began, note)
        except CompactionError as exc:
            return self._unapplied(turn, exc, note)

    def _start(self, turn: ChatTurn, messages: Sequence[Message], digests: Sequence[str]) -> None:
        session = turn.session_id or ""
        task = asyncio.create_task(self._compact(self._job(turn, messages)), name=f"background-{session}")
        task.add_done_callback(_retrieve)
        stale = self._sessions.get(session)
        if stale is not None:  # a snapshot of a history the client no longer has
            stale.task.cancel()
        self._sessions[session] = _Running(Snapshot.of(digests), task)
        self._sessions.move_to_end(session)
        while len(self._sessions) > self.max_sessions:
            _, old = self._sessions.popitem(last=False)
            old.task.cancel()

    @staticmethod
    async def _finish(running: _Running) -> tuple[ServiceResult | None, str | None]:
        """The background result, waiting for what is left of it; None (and why) if it failed."""
        try:
            return await asyncio.shield(running.task), None
        except asyncio.CancelledError:
            if not running.task.cancelled():
                raise  # this turn itself was cancelled (client gone); the background run goes on
            return None, "the background compaction was cancelled; compacted now"
        except Exception as exc:  # whatever went wrong in the background, this turn compacts now instead
            return None, f"the background compaction failed ({exc}); compacted now"

    async def _apply(
        self,
        turn: ChatTurn,
        tokenizer: ChatTokenizer,
        result: ServiceResult | None,
        source: Literal["background", "blocking"],
        began: float,
        note: str | None,
    ) -> TurnCompaction:
        """Splice a finished compaction (or make one now); compact again if the splice still crosses the threshold."""
        if result is None:
            result = await self._compact(self._job(turn, turn.messages))
        head, through = result.messages[: result.kept_head + 1], result.replaces_through
        prompt = spliced(head, through, turn.messages)
        tokens = prompt_tokens(prompt, tokenizer)
        if tokens > turn.entry.compact_threshold:  # the history grew past the threshold again since the snapshot
            result = await self._compact(self._job(turn, prompt))
            head, through = _compose(result, len(head), through, prompt)
            prompt = spliced(head, through, turn.messages)
            tokens = prompt_tokens(prompt, tokenizer)
        if turn.session_id and wants_background(tokens, turn.growth, turn.entry):
            self._start(turn, prompt, message_digests(prompt))  # the compacted prompt is the next snapshot
        return TurnCompaction(
            status="applied",
            messages=head,
            replaces_through=through,
            stall_s=round(time.perf_counter() - began, 4),
            prompt_tokens=turn.prompt_tokens,
            compacted_prompt_tokens=tokens,
            source=source,
            note=note,
            stats=result.stats,
        )

    @staticmethod
    def _unapplied(turn: ChatTurn, exc: CompactionError, note: str | None) -> TurnCompaction:
        """No compaction could be applied: answer the prompt as sent if it fits, else fail with the cause."""
        if isinstance(exc, InvalidInput) and not isinstance(exc, NothingToCompact):
            raise exc  # the caller's options cannot work (e.g. sequential over the window): say so
        if turn.prompt_tokens > turn.room:
            raise exc
        why = f"not compacted: {exc}" + (f"; {note}" if note else "")
        return TurnCompaction(status="none", prompt_tokens=turn.prompt_tokens, note=why)

    @staticmethod
    def _job(turn: ChatTurn, messages: Sequence[Message]) -> CompactJob:
        return CompactJob(
            model=turn.model, messages=list(messages), options=turn.entry.options(), session_id=turn.session_id
        )


def _compose(
    result: ServiceResult, head_len: int, through: int, prompt: Sequence[Message]
) -> tuple[list[Message], int]:
    """A compaction of a spliced prompt (head + request[through:]) as a head and index into the request."""
    head = result.messages[: result.kept_head + 1]
    if result.replaces_through < head_len:  # part of the earlier head stayed verbatim after the new summary
        return [*head, *prompt[result.replaces_through : head_len]], through
    return head, through + result.replaces_through - head_len


def _retrieve(task: asyncio.Task[ServiceResult]) -> None:
    """Mark a background failure as seen (it is reported on the turn that uses it), so asyncio does not log it."""
    if not task.cancelled():
        task.exception()
