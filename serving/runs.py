"""A session's background run (`serving.background`): its tasks and events, what it holds, and its failure kept
lean (the error alone, never the traceback whose frames hold its plan and every chunk prompt)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel

from compaction.errors import BackendError, CompactionError
from compaction.history import Message
from compaction.turn_policy import Background, Snapshot, message_digests
from serving.coordinator import CompactJob, ServiceResult
from serving.errors import Failure
from serving.turns import ChatTurn

Result = TypeVar("Result")


@dataclass
class Running:
    """A background compaction of one session's snapshot, then its compacted prompt prefilled (`warmed`)."""

    snapshot: Snapshot  # the messages it summarises
    made_for: tuple[str, str, str, str | None]  # model, options, tenant, salt: only a turn with the same may use it
    compaction: asyncio.Task[ServiceResult | int]  # a rolling run's result: the chunks it put in the chunk cache
    warmed: asyncio.Task[ServiceResult | int]  # the compaction's result once its prompt is prefilled (or that failed)
    urgent: asyncio.Event  # set when a turn waits for it: its prompts then go at the agent's priority
    bytes: int = 0  # what it holds: its job's JSON while it runs, its result's once done, about 0 if it failed
    tokens: int = 0  # the snapshot's prompt tokens
    rolling: bool = False  # summaries for the chunk cache (apply_background "rolling"), never spliced
    sent: asyncio.Event = field(default_factory=asyncio.Event)  # rolling: its chunk prompts are in flight
    last: bool = False  # rolling: the last turn's run, which summarised its whole snapshot (`serving.background`)
    beside: Running | None = None  # last: a run still in flight when it started, which goes on (its chunks joined)
    job: CompactJob | None = None  # last: its job, which the turn's reply extends once it is sent (`follow`)
    follow: asyncio.Task[ServiceResult | int] | None = None  # last: the run of its history and the turn's reply
    follow_sent: asyncio.Event = field(default_factory=asyncio.Event)  # its chunk prompts are in flight
    follow_bytes: int = 0  # what the follow-up's job holds while it runs
    follow_digest: str | None = None  # the reply it took (`compaction.turn_policy.message_digests`, lean)
    followed: asyncio.Event = field(default_factory=asyncio.Event)  # its follow-up has started

    def state(self, digests: Sequence[str], turn: ChatTurn) -> Background:
        if self.made_for != usable_by(turn) or not self.snapshot.covers(digests):
            return "absent"  # other options, or the client's history moved on (edited, compacted by other means)
        if not self.warmed.done():
            return "running"
        return "failed" if self.warmed.cancelled() or self.warmed.exception() is not None else "done"

    def superseded(self, digests: Sequence[str], turn: ChatTurn) -> bool:
        """The session went on from its snapshot with another model, other options or another salt: no turn of it
        will use this run. (A turn with another history, e.g. a side request on the same session id, supersedes
        nothing: the conversation may still come back to this one.)"""
        return self.made_for != usable_by(turn) and self.snapshot.covers(digests)

    def followed_by(self, messages: Sequence[Message]) -> bool:
        """Its follow-up has summarised its history with the reply, and the history goes on with that reply (as the
        template reads it): that run's chunks are the ones a compaction of this history cuts."""
        length, digest, follow = self.snapshot.length, self.follow_digest, self.follow
        done = follow is not None and follow.done() and not follow.cancelled() and follow.exception() is None
        return done and len(messages) > length and reply_digest(messages[length]) == digest

    def busy(self) -> bool:
        """Still compacting or prefilling (its follow-up included)."""
        return not self.warmed.done() or (self.follow is not None and not self.follow.done())

    def cancel(self) -> None:
        self.compaction.cancel()
        self.warmed.cancel()
        if self.follow is not None:
            self.follow.cancel()
        if self.beside is not None:
            self.beside.cancel()

    async def in_flight(self) -> None:
        """Until its chunk prompts (and its follow-up's) are in flight, or it has ended: a compaction started
        after that joins them instead of sending them again."""
        for sent, task in ((self.sent, self.compaction), (self.follow_sent, self.follow)):
            if task is None:
                continue
            waiting = asyncio.ensure_future(sent.wait())
            try:
                await asyncio.wait({waiting, task}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiting.cancel()

    def hurry(self) -> None:
        """A turn waits for it: it and the run beside it are admitted at once, and their prompts go on at the agent's
        priority (a rolling run's: those the turn's compaction joins, `compaction.compactor`)."""
        self.urgent.set()
        if self.beside is not None:
            self.beside.urgent.set()

    def held(self) -> int:
        """Bytes it holds, with its follow-up and the run beside it while those run."""
        beside, follow = self.beside, self.follow
        extra = self.follow_bytes if follow is not None and not follow.done() else 0
        return self.bytes + extra + (beside.held() if beside is not None and beside.busy() else 0)


def usable_by(turn: ChatTurn) -> tuple[str, str, str, str | None]:
    """What a run made for this turn may be used by: turns of the same model, options, tenant and salt."""
    return turn.model, turn.entry.options().model_dump_json(), turn.tenant, turn.cache_salt


def reply_digest(message: Message) -> str:
    """A message's digest as the template reads it: its declared fields alone."""
    return message_digests([lean_message(message)])[0]


def lean_message(message: Message) -> Message:
    """The message rebuilt from its declared fields alone, at every level (content parts and tool calls too): the
    template reads no extra field, so a background run keeps none."""
    return Message.model_validate(_declared(message))


def _declared(model: BaseModel) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            value = _declared(value)
        elif isinstance(value, list):
            value = [_declared(v) if isinstance(v, BaseModel) else v for v in value]
        if value is not None:
            out[name] = value
    return out


async def lean(work: Callable[[], Coroutine[Any, Any, Result]]) -> Result:
    """`work()`'s result, or its error alone: raised afresh, without the traceback whose frames hold its plan."""
    try:
        return await work()
    except CompactionError as exc:
        error: Exception = Failure.of(exc).exception()
    except Exception as exc:  # whatever failed, the turn that uses the run compacts again
        error = BackendError(f"{type(exc).__name__}: {exc}")
    del work  # the task keeps the error's traceback, which holds this frame: not the job `work` closes over
    raise error


def measure(running: Running, task: asyncio.Task[ServiceResult | int]) -> None:
    """A finished run holds its result (or, failed or rolled, almost nothing)."""
    done = not task.cancelled() and task.exception() is None
    result = task.result() if done else None
    running.bytes = len(result.model_dump_json()) if isinstance(result, ServiceResult) else 0


def retrieve(task: asyncio.Task[Any]) -> None:
    """Mark a background failure as seen (it is reported on the turn that uses it), so asyncio does not log it,
    and keep the error alone: its traceback's frames hold the job (every message of the snapshot)."""
    if not task.cancelled() and (error := task.exception()) is not None:
        error.__traceback__ = error.__context__ = error.__cause__ = None
