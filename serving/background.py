"""Compaction inside chat turns, on the coordinator: background snapshots per session, and each turn's outcome.

A plain class (no Ray import) owned by the coordinator. The decisions are `compaction.turn_policy`'s;
this module runs them: it starts a background compaction of a session's snapshot at background
priority (its prompts yield to agent turns on the engines, `compaction.pacing`), keeps it (a
bounded cache of sessions, found again through session affinity), and once it is done prefills the
compacted prompt on the session's replica, still at background priority, so the turn that applies it
reads that prompt from the prefix cache. The session's next turn (or, with apply_background
"threshold", the one that crosses the hard threshold) splices the result onto the grown history; a
turn that passes the hard threshold while the run is still going raises it to the agent's priority
and waits only for what is left. A run is used only by a turn of the same model and options; the session's
first turn from its snapshot with others that comes here (past a threshold) cancels it.
When the prompt a turn is answered from already wants a background run (past background_threshold,
or one more turn like this one would pass compact_threshold), that prompt is the next snapshot.

With apply_background "rolling" a run (one per session at a time; a last turn's before the threshold starts beside
one still in flight, joining its chunks) summarises chunks into the chunk cache, nothing spliced: the turn past the
hard threshold compacts as blocking would, taking them or joining them (see `_job`).

Nothing here is needed for correctness: the client carries the compacted history, so losing this
state (a restart, an eviction) costs only a recomputation. So it is bounded in sessions and in bytes
(`max_bytes`: each session's snapshot job while it runs, its result once done; the least recently
started go first). A background run keeps no more than it must: its messages without their extra
fields, and a run that fails (or is shed) keeps only its error, not the traceback whose frames hold
its plan and every chunk prompt.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Literal

from compaction.bounded import BoundedLRU
from compaction.errors import CompactionError, InvalidInput, NothingToCompact
from compaction.history import Message
from compaction.pacing import Priority
from compaction.tokenizer import ChatTokenizer
from compaction.turn_policy import (
    Background,
    Snapshot,
    decide,
    last_before_threshold,
    message_digests,
    prompt_tokens,
    spliced,
    wants_background,
)
from serving.coordinator import CompactJob, ServiceResult
from serving.runs import Running, lean, lean_message, measure, reply_digest, retrieve, usable_by
from serving.turns import WIRE_FIELD, ChatTurn, Status, TurnCompaction, Wire

DEFAULT_MAX_BYTES = 512 * 2**20  # per coordinator replica: background jobs and results kept for their sessions


# The coordinator's admission entry: (job, urgent) -> result; `urgent` set raises a background job's priority.
CompactFn = Callable[[CompactJob, asyncio.Event], Coroutine[Any, Any, ServiceResult]]


# The coordinator's rolling entry: (job, urgent, sent) -> chunks summarised into the chunk cache (nothing merged);
# `sent` is set once its prompts are in flight.
RollFn = Callable[[CompactJob, asyncio.Event, asyncio.Event], Coroutine[Any, Any, int]]


# Prefill a prompt on the session's replica at background priority: (model, messages, session, cache salt) -> tokens.
WarmFn = Callable[[str, list[Message], str, str | None], Coroutine[Any, Any, int]]


logger = logging.getLogger(__name__)


class SessionCompactions:
    """Per-session background compactions and the turn logic (one instance per coordinator replica)."""

    def __init__(
        self,
        compact: CompactFn,
        *,
        roll: RollFn | None = None,
        warm: WarmFn | None = None,
        max_sessions: int = 4096,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_running_per_tenant: int = 8,
        tenant_cap: Callable[[str], int | None] | None = None,
    ) -> None:
        self._compact = compact
        self._roll = roll  # None: no rolling runs (apply_background "rolling" compacts at the threshold only)
        self._warm = warm
        self.max_sessions = max_sessions
        self.max_bytes = max_bytes
        self.max_running_per_tenant = max_running_per_tenant
        self._tenant_cap = tenant_cap  # a tenant's own cap on requests at once (its max_concurrent_requests)
        # Per tenant (each bounded by max_sessions, so one tenant's sessions never evict another's):
        self._runs: dict[str, BoundedLRU[str, Running]] = {}  # session -> its background run (evicted: cancelled)
        self._formats: dict[str, BoundedLRU[str, Wire]] = {}  # session -> the format it speaks

    def __len__(self) -> int:
        return sum(len(runs) for runs in self._runs.values())

    def _sessions(self, turn: ChatTurn) -> BoundedLRU[str, Running]:
        if turn.tenant not in self._runs:
            self._runs[turn.tenant] = BoundedLRU(self.max_sessions, on_evict=lambda _, run: run.cancel())
        return self._runs[turn.tenant]

    async def turn(self, turn: ChatTurn, tokenizer: ChatTokenizer) -> TurnCompaction:
        """Decide and do this turn's compaction (compaction.turn_policy). Raises only for the caller's own errors."""
        began = time.perf_counter()
        self._check_wire(turn)
        digests = message_digests(turn.messages)
        running = self._sessions(turn).peek(turn.session_id) if turn.session_id else None
        if running is not None and running.superseded(digests, turn):  # its work would only hold the engines
            self._sessions(turn).pop(turn.session_id or "")
            running.cancel()
            running = None
        state: Background = running.state(digests, turn) if running else "absent"
        has_session = turn.session_id is not None
        fresh = turn.prompt_tokens - running.tokens if running is not None and state != "absent" else None
        action = decide(turn.prompt_tokens, turn.entry, state, has_session, turn.growth, turn.idle_s, turn.force, fresh)
        if action == "start_background" and (self._roll is not None or turn.entry.apply_background != "rolling"):
            if not self._room_for(turn):
                full = f"no background compaction: this tenant has {self._cap(turn.tenant)} running already"
                return TurnCompaction(status="none", prompt_tokens=turn.prompt_tokens, note=full)
            started = self._start(turn, turn.messages, digests, turn.prompt_tokens)
            reply_for = len(turn.messages) if started.job is not None else None
            return TurnCompaction(status="running", prompt_tokens=turn.prompt_tokens, reply_for=reply_for)
        if action in ("none", "start_background"):
            status: Status = "running" if state in ("running", "done") else "none"
            return TurnCompaction(status=status, prompt_tokens=turn.prompt_tokens)
        note = None
        result: ServiceResult | int | None = None
        prefer = None
        follows = running is not None and running.followed_by(turn.messages)
        if running is not None and running.last and not follows and state in ("running", "done"):
            prefer = running.snapshot.length  # the reply after its history stays verbatim if it can
            if running.follow is not None:
                running.follow.cancel()  # not done (or not this reply): its chunk would only be waited for
        ended = None  # the session's run, done with here: what it still has in flight is cancelled after this turn
        if running is not None and running.rolling and state != "absent" and (state == "running" or follows):
            running.hurry()  # admitted now if queued; the compaction below joins its prompts, raising those it needs
            await running.in_flight()
            ended = self._sessions(turn).pop(turn.session_id or "")
        elif running is not None and state != "absent":  # apply or wait for it; if it failed, say why
            result, note = await self._finish(running)
            ended = self._sessions(turn).pop(turn.session_id or "")
        if not isinstance(result, ServiceResult):  # rolled (its summaries are in the chunk cache) or none
            result = None
        source: Literal["background", "blocking"] = "background" if result is not None else "blocking"
        try:
            return await self._apply(turn, tokenizer, result, source, began, note, prefer)
        except CompactionError as exc:
            return self._unapplied(turn, exc, note)
        finally:
            if ended is not None:
                ended.cancel()  # e.g. an earlier turn's last chunk, still in flight: no compaction will take it

    def _room_for(self, turn: ChatTurn) -> bool:
        """Whether the turn's tenant may start one more background run (its own session's counts as replaced)."""
        runs = self._sessions(turn)
        others = [r for key, r in runs.items() if key != turn.session_id and r.busy()]
        return len(others) < self._cap(turn.tenant)

    def _cap(self, tenant: str) -> int:
        """Background runs a tenant may have going: chat_background_per_tenant, and never more than its own cap on
        requests at once."""
        own = self._tenant_cap(tenant) if self._tenant_cap is not None else None
        return self.max_running_per_tenant if own is None else min(own, self.max_running_per_tenant)

    def _check_wire(self, turn: ChatTurn) -> None:
        """A session speaks one API format: a turn of another is refused, never mixed in silently."""
        if not turn.session_id:
            return
        wires = self._formats.setdefault(turn.tenant, BoundedLRU(self.max_sessions))
        known = wires.get(turn.session_id) or turn.wire
        if known != turn.wire:
            raise InvalidInput(
                WIRE_FIELD,
                f"session {turn.session_id!r} has {known} turns; a {turn.wire} turn cannot join it: "
                "use another session id for this API",
            )
        wires.put(turn.session_id, known)

    def running(self) -> int:
        """How many background runs are still compacting or prefilling."""
        return sum(r.busy() for runs in self._runs.values() for r in runs.values())

    def bytes(self) -> int:
        """What the kept background runs hold, about (see `Running.bytes`)."""
        return sum(r.held() for runs in self._runs.values() for r in runs.values())

    def replied(self, model: str, tenant: str, session: str, messages: int, reply: Message) -> None:
        """The reply to the turn that started the session's last rolling run before its threshold (a history of
        `messages` messages) was sent: a follow-up run summarises that history with the reply, so the compaction at
        the threshold finds blocking's own last chunk (the reply in it) summarised or in flight."""
        running = self._runs[tenant].peek(session) if tenant in self._runs else None
        if self._roll is None or running is None or running.job is None or running.follow is not None:
            return
        job = running.job
        if job.model != model or len(job.messages) != messages or running.warmed.cancelled():
            return
        follow = job.model_copy(update={"messages": [*job.messages, lean_message(reply)], "roll_reply": True})
        running.follow_digest = reply_digest(reply)
        roll, urgent, sent = self._roll, running.urgent, running.follow_sent
        running.follow = asyncio.create_task(lean(lambda: roll(follow, urgent, sent)), name=f"reply-{session}")
        running.follow.add_done_callback(retrieve)
        running.follow_bytes = len(follow.model_dump_json())
        running.followed.set()
        self._shed()

    async def settled(self, tenant: str, session: str, timeout_s: float) -> bool:
        """Until the session's background work has ended, a last run's follow-up with its reply included (once the
        reply is handed on); False if it had not within `timeout_s`. For tools and tests that need a session at
        rest."""
        running = self._runs[tenant].peek(session) if tenant in self._runs else None
        if running is None:
            return True
        try:
            async with asyncio.timeout(timeout_s):
                if running.job is not None:
                    await running.followed.wait()
                await asyncio.wait([t for t in (running.warmed, running.follow) if t is not None])
        except TimeoutError:
            return False
        return True

    def _start(self, turn: ChatTurn, messages: Sequence[Message], digests: Sequence[str], tokens: int) -> Running:
        session = turn.session_id or ""
        urgent, sent = asyncio.Event(), asyncio.Event()
        roll = self._roll if turn.entry.apply_background == "rolling" else None
        last = roll is not None and last_before_threshold(tokens, turn.growth, turn.entry)
        job = self._job(turn, [lean_message(m) for m in messages], "background", last)
        work: Callable[[], Coroutine[Any, Any, ServiceResult | int]]
        work = (lambda: roll(job, urgent, sent)) if roll is not None else (lambda: self._compact(job, urgent))
        compaction: asyncio.Task[ServiceResult | int] = asyncio.create_task(lean(work), name=f"background-{session}")
        warmed = asyncio.create_task(lean(lambda: self._warmed(compaction, job, urgent)), name=f"warm-{session}")
        for task in (compaction, warmed):
            task.add_done_callback(retrieve)
        warmed.add_done_callback(lambda _: retrieve(compaction))  # re-raised in _warmed: its frames again
        sessions, beside = self._sessions(turn), None
        if (stale := sessions.pop(session)) is not None:
            if last and stale.rolling and stale.state(digests, turn) != "absent" and stale.busy():
                beside = stale  # a run of this history still in flight: it goes on, its chunks joined by this one
            else:  # a history the client no longer has, or other options
                stale.cancel()
        snapshot, size = Snapshot.of(digests), len(job.model_dump_json())
        running = Running(
            snapshot, usable_by(turn), compaction, warmed, urgent, size, tokens, roll is not None, sent, last, beside,
            job if last else None,
        )  # fmt: skip
        if beside is not None:  # once it ends, only the chunk cache keeps what it made

            def ended(_: asyncio.Task[Any]) -> None:
                if not beside.busy():
                    running.beside = None

            for part in (beside.warmed, beside.follow):
                if part is not None:
                    part.add_done_callback(ended)
        compaction.add_done_callback(lambda task: measure(running, task))
        sessions.put(session, running)
        self._shed()
        return running

    def _shed(self) -> None:
        """Runs dropped until what they hold is within max_bytes: the heaviest tenant's oldest first."""
        while self.bytes() > self.max_bytes and len(self) > 1:
            heaviest = max(self._runs.values(), key=lambda runs: sum(r.held() for r in runs.values()))
            heaviest.pop_oldest()

    async def _warmed(
        self, compaction: asyncio.Task[ServiceResult | int], job: CompactJob, urgent: asyncio.Event
    ) -> ServiceResult | int:
        """The background result once its compacted prompt is prefilled on the session's replica (unless a turn
        is already waiting for it: that turn's own prefill does it), so the turn that applies it reads it there."""
        result = await compaction
        if isinstance(result, ServiceResult) and self._warm is not None and job.session_id and not urgent.is_set():
            prompt = spliced(result.messages[: result.head_messages], result.replaces_through, job.messages)
            with contextlib.suppress(CompactionError):  # a cache warm-up only; the turn prefills it otherwise
                await self._warm(job.model, prompt, job.session_id, job.cache_salt)
        return result

    @staticmethod
    async def _finish(running: Running) -> tuple[ServiceResult | int | None, str | None]:
        """The background result, waiting for what is left of it at the agent's priority; None (and why) if it
        failed."""
        running.hurry()
        try:
            return await asyncio.shield(running.compaction), None
        except asyncio.CancelledError:
            if not running.compaction.cancelled():
                raise  # this turn itself was cancelled (client gone); the background run goes on
            return None, "the background compaction was cancelled; compacted now"
        except Exception:  # whatever went wrong in the background, this turn compacts now instead (details: log)
            logger.warning("a background compaction failed; the turn compacts now", exc_info=True)
            return None, "the background compaction failed; compacted now"

    async def _apply(
        self,
        turn: ChatTurn,
        tokenizer: ChatTokenizer,
        result: ServiceResult | None,
        source: Literal["background", "blocking"],
        began: float,
        note: str | None,
        prefer: int | None = None,
    ) -> TurnCompaction:
        """Splice a finished compaction (or make one now); compact again if the splice still crosses the threshold."""
        if result is None:
            result = await self._compact(self._job(turn, turn.messages, prefer=prefer), asyncio.Event())
            if turn.entry.apply_background == "rolling" and result.stats.reused_chunks:
                source = "background"  # made of summaries rolled in the background (and the chunks that were not)
        head, through = result.messages[: result.head_messages], result.replaces_through
        prompt = spliced(head, through, turn.messages)
        tokens = prompt_tokens(prompt, tokenizer, turn.tools)
        if tokens > turn.entry.compact_threshold:  # the history grew past the threshold again since the snapshot
            try:
                again = await self._compact(self._job(turn, prompt), asyncio.Event())
            except NothingToCompact:  # the splice is as short as a compaction makes it: it is applied as it is
                again = None
            if again is not None:
                result = again
                head, through = _compose(result, len(head), through, prompt)
                prompt = spliced(head, through, turn.messages)
                tokens = prompt_tokens(prompt, tokenizer, turn.tools)
        reply_for = None
        if turn.session_id and wants_background(tokens, turn.growth, turn.entry, turn.idle_s) and self._room_for(turn):
            started = self._start(turn, prompt, message_digests(prompt), tokens)  # the compacted prompt: next snapshot
            reply_for = len(prompt) if started.job is not None else None
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
            reply_for=reply_for,
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
    def _job(
        turn: ChatTurn,
        messages: Sequence[Message],
        priority: Priority = "agent",
        last: bool = False,
        prefer: int | None = None,
    ) -> CompactJob:
        """A compaction of `messages` with the turn's options. A background snapshot keeps `growth` fewer recent
        tokens verbatim: one more turn (about that long) stays verbatim after it by the time it is applied, as in a
        blocking compaction's prompt; a rolling run's whole chunks so are those a compaction one such turn later
        takes. `last`: the rolling run of the last turn before the threshold summarises its whole history, last
        chunk too; the compaction at the threshold then keeps the turns after it verbatim if it can (`prefer`:
        their first message, `compaction.plan.kept_ends`) and finds every chunk done."""
        options = turn.entry.options()
        if priority == "background":
            keep = 0 if last else max(0, options.keep_recent_tokens - turn.growth)
            update: dict[str, Any] = {"keep_recent_tokens": keep}
            options = options.model_copy(update={**update, "keep_current_turn": False} if last else update)
        return CompactJob(
            model=turn.model,
            messages=list(messages),
            options=options,
            session_id=turn.session_id,
            priority=priority,
            tenant=turn.tenant,
            cache_salt=turn.cache_salt,
            roll_last=last,
            prefer_tail_from=prefer,
            tools=turn.tools,
        )


def _compose(
    result: ServiceResult, head_len: int, through: int, prompt: Sequence[Message]
) -> tuple[list[Message], int]:
    """A compaction of a spliced prompt (head + request[through:]) as a head and index into the request."""
    head = result.messages[: result.head_messages]
    if result.replaces_through < head_len:  # part of the earlier head stayed verbatim after the new summary
        return [*head, *prompt[result.replaces_through : head_len]], through
    return head, through + result.replaces_through - head_len
