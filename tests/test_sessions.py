"""Chat-side compaction on the coordinator (pure: real tokenizer, real coordinator, fake replicas)."""

from __future__ import annotations

import asyncio
import functools
from collections import Counter
from typing import Any

import pytest

from compaction.backend import GenerationRequest
from compaction.chunk_cache import ChunkCache
from compaction.compactor import FALLBACKS, Compactor
from compaction.errors import BackendError, InvalidInput
from compaction.history import Message, chat_view, parse_messages
from compaction.pacing import BACKGROUND
from compaction.plan import is_summary
from compaction.tokenizer import HFChatTokenizer
from compaction.turn_policy import parse_context_management, prompt_tokens
from jobs.data.traces import TOOLS, coding_trace
from serving.background import SessionCompactions
from serving.coordinator import AdmissionConfig, CompactJob, Coordinator, ModelRuntime, ServiceResult
from serving.turns import WIRE_FIELD, ChatTurn, TurnCompaction
from serving.wire.tools import engine_tools
from tests.fakes import short_summary
from tests.support import until
from tests.test_coordinator import MODEL, FakeReplicas, coordinator

SYSTEM = {"role": "system", "content": "You are a travel agent."}


def conversation(first: int, last: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i in range(first, last):
        out.append({"role": "user", "content": f"Turn {i}: please book trip number {i} to city {i} on day {i}."})
        out.append({"role": "assistant", "content": f"Booked trip {i}; confirmation code C{i:04d}."})
    return out


class Counting:
    """The coordinator's compact entry, counting calls and optionally failing the next ones."""

    def __init__(self, tokenizer: HFChatTokenizer, replicas: FakeReplicas) -> None:
        self.coordinator = coordinator(tokenizer, replicas)
        self.calls: list[CompactJob] = []
        self.finished = 0
        self.fail = 0

    async def __call__(self, job: CompactJob, urgent: asyncio.Event | None = None) -> ServiceResult:
        self.calls.append(job)
        try:
            if self.fail:
                self.fail -= 1
                raise BackendError("replica died")
            return await self.coordinator.compact(job, urgent)
        finally:
            self.finished += 1


ENTRY = {"type": "compaction", "compact_threshold": 1200, "chunk_tokens": 256, "max_chunk_summary_tokens": 16}


def turn(
    tokenizer: HFChatTokenizer, messages: list[dict[str, Any]], session: str | None = "s1", **entry: Any
) -> ChatTurn:
    parsed = parse_messages(messages)
    cm = parse_context_management([{**ENTRY, **entry}])
    assert cm is not None
    tokens = prompt_tokens(parsed, tokenizer)
    return ChatTurn(model=MODEL, messages=parsed, entry=cm, session_id=session, prompt_tokens=tokens, room=8192 - 64)


def prompt_after(outcome: Any, messages: list[dict[str, Any]]) -> list[Any]:
    return [*outcome.messages, *parse_messages(messages)[outcome.replaces_through :]]


async def test_below_the_threshold_nothing_happens(tokenizer: HFChatTokenizer) -> None:
    compact = Counting(tokenizer, FakeReplicas())
    outcome = await SessionCompactions(compact).turn(turn(tokenizer, [SYSTEM, *conversation(0, 5)]), tokenizer)
    assert outcome.status == "none" and outcome.messages is None and not compact.calls


async def test_a_session_keeps_the_api_format_it_began_with(tokenizer: HFChatTokenizer) -> None:
    compact = Counting(tokenizer, FakeReplicas())
    sessions = SessionCompactions(compact, max_sessions=1)
    chat = turn(tokenizer, [SYSTEM, *conversation(0, 5)])
    assert (await sessions.turn(chat, tokenizer)).status == "none"
    with pytest.raises(InvalidInput) as caught:
        await sessions.turn(chat.model_copy(update={"wire": "messages"}), tokenizer)
    assert caught.value.field == WIRE_FIELD and "'s1' has chat turns; a messages turn" in caught.value.message
    anonymous = chat.model_copy(update={"session_id": None, "wire": "responses"})
    assert (await sessions.turn(anonymous, tokenizer)).status == "none"  # no session, nothing to keep apart
    other = chat.model_copy(update={"session_id": "s2", "wire": "responses"})
    assert (await sessions.turn(other, tokenizer)).status == "none"  # s1 is forgotten past max_sessions
    assert (await sessions.turn(chat.model_copy(update={"wire": "messages"}), tokenizer)).status == "none"
    assert not compact.calls


async def test_past_the_threshold_a_blocking_compaction_keeps_the_current_turn(tokenizer: HFChatTokenizer) -> None:
    compact = Counting(tokenizer, FakeReplicas())
    messages = [SYSTEM, *conversation(0, 30), {"role": "user", "content": "Which trips are booked?"}]
    request = turn(tokenizer, messages)
    assert request.prompt_tokens > 1200
    outcome = await SessionCompactions(compact).turn(request, tokenizer)
    assert outcome.status == "applied" and outcome.source == "blocking" and len(compact.calls) == 1
    assert outcome.messages is not None and outcome.messages[0].role == "system" and is_summary(outcome.messages[-1])
    assert outcome.replaces_through is not None and outcome.replaces_through <= len(messages) - 1  # current turn kept
    assert prompt_after(outcome, messages)[-1].content == "Which trips are booked?"
    assert outcome.compacted_prompt_tokens is not None and outcome.compacted_prompt_tokens < 1200
    assert outcome.stall_s > 0 and outcome.stats is not None and outcome.stats.chunks >= 1


async def test_background_snapshot_is_applied_later_with_nothing_lost_or_summarised_twice(
    tokenizer: HFChatTokenizer,
) -> None:
    compact = Counting(tokenizer, FakeReplicas())
    sessions = SessionCompactions(compact)
    snapshot = [SYSTEM, *conversation(0, 16)]
    first = turn(tokenizer, snapshot, background_threshold=700)
    assert 700 < first.prompt_tokens <= 1200
    outcomes = await asyncio.gather(sessions.turn(first, tokenizer), sessions.turn(first, tokenizer))
    assert [o.status for o in outcomes] == ["running", "running"] and len(compact.calls) == 1  # one snapshot, once
    await until(lambda: compact.finished == 1 and not sessions.running())  # it finishes while the agent works
    grown = [*snapshot, *conversation(16, 30)]
    late = await sessions.turn(turn(tokenizer, grown, background_threshold=700), tokenizer)
    # The finished run is applied: no compaction started for this turn (one call in all), none waited for.
    assert late.status == "applied" and late.source == "background" and len(compact.calls) == 1
    assert late.replaces_through is not None
    assert late.replaces_through <= len(snapshot)  # everything after the snapshot is kept verbatim...
    kept = prompt_after(late, grown)
    assert [m.content for m in kept[-28:]] == [m["content"] for m in grown[-28:]]  # ...nothing lost
    assert sum(is_summary(m) for m in kept) == 1  # one summary, of the snapshot only
    assert late.compacted_prompt_tokens is not None and late.compacted_prompt_tokens > 700
    await until(lambda: len(compact.calls) == 2)  # past the soft threshold again: the next snapshot starts
    assert len(sessions) == 1 and len(compact.calls) == 2 and compact.calls[1].messages == kept


async def test_a_running_background_compaction_is_waited_for_not_restarted(tokenizer: HFChatTokenizer) -> None:
    gate = asyncio.Event()
    compact = Counting(tokenizer, FakeReplicas(gate=gate))
    sessions = SessionCompactions(compact)
    snapshot = [SYSTEM, *conversation(0, 16)]
    assert (await sessions.turn(turn(tokenizer, snapshot, background_threshold=700), tokenizer)).status == "running"
    over = asyncio.create_task(
        sessions.turn(turn(tokenizer, [*snapshot, *conversation(16, 30)], background_threshold=700), tokenizer)
    )
    await asyncio.sleep(0.05)
    assert not over.done()
    gate.set()
    outcome = await over
    assert outcome.status == "applied" and outcome.source == "background"
    assert [c.messages for c in compact.calls].count(parse_messages(snapshot)) == 1  # the snapshot, once
    assert outcome.stall_s >= 0.05


async def test_a_failed_background_compaction_falls_back_to_blocking(tokenizer: HFChatTokenizer) -> None:
    compact = Counting(tokenizer, FakeReplicas())
    sessions = SessionCompactions(compact)
    compact.fail = 1
    snapshot = [SYSTEM, *conversation(0, 16)]
    assert (await sessions.turn(turn(tokenizer, snapshot, background_threshold=700), tokenizer)).status == "running"
    await asyncio.sleep(0.01)
    outcome = await sessions.turn(
        turn(tokenizer, [*snapshot, *conversation(16, 30)], background_threshold=700), tokenizer
    )
    assert outcome.status == "applied" and outcome.source == "blocking" and len(compact.calls) == 2
    assert outcome.note is not None and "background compaction failed" in outcome.note


async def test_an_edited_history_does_not_use_a_stale_snapshot(tokenizer: HFChatTokenizer) -> None:
    compact = Counting(tokenizer, FakeReplicas())
    sessions = SessionCompactions(compact)
    snapshot = [SYSTEM, *conversation(0, 16)]
    await sessions.turn(turn(tokenizer, snapshot, background_threshold=700), tokenizer)
    edited = [SYSTEM, {"role": "user", "content": "Start over."}, *conversation(1, 30)]
    outcome = await sessions.turn(turn(tokenizer, edited, background_threshold=700), tokenizer)
    assert outcome.status == "applied" and outcome.source == "blocking" and len(compact.calls) == 2


async def test_when_compaction_is_impossible_the_turn_is_served_as_sent_if_it_fits(tokenizer: HFChatTokenizer) -> None:
    compact = Counting(tokenizer, FakeReplicas(dead=("a", "b")))
    messages = [SYSTEM, *conversation(0, 30)]
    outcome = await SessionCompactions(compact).turn(turn(tokenizer, messages), tokenizer)
    assert outcome.status == "none" and outcome.note is not None and "died" in outcome.note
    request = turn(tokenizer, messages).model_copy(update={"room": 1000})
    with pytest.raises(BackendError):
        await SessionCompactions(compact).turn(request, tokenizer)
    current = [SYSTEM, {"role": "user", "content": "word " * 1500}]  # only the current turn: nothing to compact
    outcome = await SessionCompactions(compact).turn(turn(tokenizer, current), tokenizer)
    assert outcome.status == "none" and "nothing to compact" in (outcome.note or "")


async def test_sessions_are_bounded(tokenizer: HFChatTokenizer) -> None:
    compact = Counting(tokenizer, FakeReplicas())
    sessions = SessionCompactions(compact, max_sessions=2)
    snapshot = [SYSTEM, *conversation(0, 16)]
    for s in ("s1", "s2", "s3"):
        await sessions.turn(turn(tokenizer, snapshot, session=s, background_threshold=700), tokenizer)
    assert len(sessions) == 2


async def test_a_turn_longer_than_the_gap_between_thresholds_does_not_skip_the_background_run(
    tokenizer: HFChatTokenizer,
) -> None:
    compact = Counting(tokenizer, FakeReplicas())
    sessions = SessionCompactions(compact)
    entry = {"background_threshold": 1100}  # a 100-token gap below compact_threshold=1200
    snapshot = [SYSTEM, *conversation(0, 16)]
    below = turn(tokenizer, snapshot, **entry)
    assert below.prompt_tokens < 1100
    assert (await sessions.turn(below, tokenizer)).status == "none"  # growth unknown: nothing to foresee
    growing = below.model_copy(update={"growth": 1200 - below.prompt_tokens + 1})  # one more turn passes 1200
    assert (await sessions.turn(growing, tokenizer)).status == "running" and len(sessions) == 1
    await until(lambda: compact.finished == 1 and not sessions.running())
    over = await sessions.turn(turn(tokenizer, [*snapshot, *conversation(16, 30)], **entry), tokenizer)
    assert over.status == "applied" and over.source == "background" and compact.calls[0].messages == below.messages


async def test_a_blocking_compaction_starts_the_next_snapshot_when_the_next_turn_would_pass(
    tokenizer: HFChatTokenizer,
) -> None:
    compact = Counting(tokenizer, FakeReplicas())
    sessions = SessionCompactions(compact)
    messages = [SYSTEM, *conversation(0, 30), {"role": "user", "content": "Which trips are booked?"}]
    request = turn(tokenizer, messages, background_threshold=1100)
    quiet = await sessions.turn(request, tokenizer)  # no growth known: the compacted prompt waits for a turn
    assert quiet.status == "applied" and quiet.source == "blocking" and len(sessions) == 0
    assert quiet.compacted_prompt_tokens is not None and quiet.compacted_prompt_tokens < 1100
    grows = request.model_copy(update={"growth": 1200 - quiet.compacted_prompt_tokens + 1})
    outcome = await SessionCompactions(compact).turn(grows, tokenizer)
    assert outcome.status == "applied" and outcome.messages is not None
    assert len(compact.calls) == 2
    await until(lambda: len(compact.calls) == 3)
    assert len(compact.calls) == 3 and compact.calls[2].messages == prompt_after(outcome, messages)


async def test_a_finished_background_run_is_applied_at_the_next_turn_from_a_prefilled_prompt(
    tokenizer: HFChatTokenizer,
) -> None:
    compact = Counting(tokenizer, FakeReplicas())
    warmed: list[Any] = []

    async def warm(model: str, messages: list[Any], session: str, cache_salt: str | None) -> int:
        warmed.append((model, messages, session))
        return len(messages)

    sessions = SessionCompactions(compact, warm=warm)
    snapshot = [SYSTEM, *conversation(0, 16)]
    assert (await sessions.turn(turn(tokenizer, snapshot, background_threshold=700), tokenizer)).status == "running"
    await until(lambda: compact.finished == 1 and not sessions.running())  # the background run finishes
    assert compact.calls[0].priority == "background"
    grown = [*snapshot, *conversation(16, 17)]  # one more exchange: still under compact_threshold
    request = turn(tokenizer, grown, background_threshold=700)
    assert request.prompt_tokens <= 1200
    outcome = await sessions.turn(request, tokenizer)
    assert outcome.status == "applied" and outcome.source == "background" and outcome.stall_s < 0.05
    assert outcome.stats is not None and outcome.stats.priority == "background"
    assert outcome.compacted_prompt_tokens is not None and outcome.compacted_prompt_tokens < request.prompt_tokens
    ((model, prefilled, session),) = warmed  # the compacted snapshot, prefilled before this turn
    assert (model, session) == (MODEL, "s1") and prefilled == prompt_after(outcome, snapshot)


async def test_a_background_run_is_used_only_by_a_turn_with_its_options(tokenizer: HFChatTokenizer) -> None:
    compact = Counting(tokenizer, FakeReplicas())
    sessions = SessionCompactions(compact)
    snapshot = [SYSTEM, *conversation(0, 16)]
    await sessions.turn(turn(tokenizer, snapshot, background_threshold=700), tokenizer)
    await until(lambda: compact.finished == 1 and not sessions.running())
    grown = [*snapshot, *conversation(16, 30)]
    other = await sessions.turn(turn(tokenizer, grown, background_threshold=700, variant="detailed"), tokenizer)
    assert other.status == "applied" and other.source == "blocking" and len(compact.calls) >= 2
    assert compact.calls[1].options.variant == "detailed"


async def gated_run(
    tokenizer: HFChatTokenizer,
) -> tuple[asyncio.Event, FakeReplicas, Counting, SessionCompactions, list[dict[str, Any]]]:
    """A session's background run of a 16-turn snapshot, its prompts held at the replicas until the gate opens."""
    gate = asyncio.Event()
    replicas = FakeReplicas(gate=gate)
    compact = Counting(tokenizer, replicas)
    sessions = SessionCompactions(compact)
    snapshot = [SYSTEM, *conversation(0, 16)]
    await sessions.turn(turn(tokenizer, snapshot, background_threshold=700), tokenizer)
    return gate, replicas, compact, sessions, snapshot


async def test_a_session_going_on_with_other_options_cancels_its_run_and_another_history_does_not(
    tokenizer: HFChatTokenizer,
) -> None:
    gate, replicas, compact, sessions, snapshot = await gated_run(tokenizer)
    await until(lambda: replicas.parked > 0)  # the run's prompts wait at the replicas
    side = [SYSTEM, {"role": "user", "content": "Name this conversation in three words."}]
    assert (await sessions.turn(turn(tokenizer, side, variant="detailed"), tokenizer)).status == "none"
    assert sessions.running() == 1 and compact.finished == 0  # a side request on the session id: the run goes on
    went_on = [*snapshot, *conversation(16, 18)]
    outcome = await sessions.turn(
        turn(tokenizer, went_on, variant="detailed", compact_threshold=6000, background_threshold=5000), tokenizer
    )
    assert outcome.status == "none" and len(sessions) == 0  # not kept
    await until(lambda: compact.finished == 1)  # cancelled: its prompts leave the replicas
    gate.set()
    await asyncio.sleep(0.05)
    assert not replicas.served  # none of them ran


async def test_a_turn_that_needs_a_running_background_run_raises_it_to_the_agents_priority(
    tokenizer: HFChatTokenizer,
) -> None:
    gate, replicas, compact, sessions, snapshot = await gated_run(tokenizer)
    await until(lambda: compact.calls)
    (job,) = compact.calls
    chunks = len(compact.coordinator.runtime(MODEL).compactor.plan(job.messages, job.options).prompts)
    await until(lambda: replicas.parked == chunks)  # every chunk prompt at the replicas (planned in a worker thread)
    over = asyncio.create_task(
        sessions.turn(turn(tokenizer, [*snapshot, *conversation(16, 30)], background_threshold=700), tokenizer)
    )
    await until(lambda: len(replicas.raised) == chunks)  # each raised to the agent's priority where it is
    gate.set()
    outcome = await over
    assert outcome.status == "applied" and outcome.source == "background" and outcome.stats is not None
    assert outcome.stats.priority == "background" and outcome.stats.escalated_prompts == outcome.stats.chunks
    served = [r.priority for backend in replicas.replicas.values() for r in backend.requests]
    assert served and set(served[: outcome.stats.chunks]) == {0}  # what completed ran at the agent's priority


async def test_a_failed_background_run_keeps_only_its_error_and_runs_keep_no_extra_fields(
    tokenizer: HFChatTokenizer,
) -> None:
    """The failure's traceback (whose frames hold the plan and every prompt) is dropped at once."""
    import gc
    import weakref

    class Plan:
        pass

    kept: list[weakref.ref[Plan]] = []
    jobs: list[weakref.ref[CompactJob]] = []
    extras: list[Any] = []

    async def failing(job: CompactJob, urgent: asyncio.Event | None = None) -> ServiceResult:
        plan = Plan()  # stands for the plan: held by this frame when the error is raised
        kept.append(weakref.ref(plan))
        jobs.append(weakref.ref(job))
        extras.extend(m.model_dump(exclude_none=True) for m in job.messages)
        raise BackendError("shed: the queue is full")

    sessions = SessionCompactions(failing)
    snapshot = [SYSTEM, *conversation(0, 16)]
    snapshot[1] = {**snapshot[1], "reasoning_blob": "x" * 10_000}  # an extra field the template never reads
    snapshot[3] = {"role": "user", "content": [{"type": "text", "text": "Hi.", "cache_control": {"type": "x" * 9}}]}
    assert (await sessions.turn(turn(tokenizer, snapshot, background_threshold=700), tokenizer)).status == "running"
    for _ in range(100):
        await asyncio.sleep(0.01)
        if kept and sessions.bytes() == 0 and sessions.running() == 0:
            break
    await asyncio.sleep(0)  # the finished tasks' done callbacks
    gc.collect()
    assert kept and kept[0]() is None  # freed while the failed run is still kept for the session's next turn
    assert jobs and jobs[0]() is None  # the job (the snapshot's messages) too: the error holds no frame
    assert len(sessions) == 1 and sessions.bytes() == 0
    assert "reasoning_blob" not in extras[1] and extras[3]["content"] == [{"type": "text", "text": "Hi."}]


async def test_background_runs_are_bounded_in_bytes(tokenizer: HFChatTokenizer) -> None:
    gate = asyncio.Event()
    compact = Counting(tokenizer, FakeReplicas(gate=gate))
    snapshot = [SYSTEM, *conversation(0, 16)]
    one = len(
        CompactJob(
            model=MODEL, messages=parse_messages(snapshot), options=turn(tokenizer, snapshot).entry.options()
        ).model_dump_json()
    )
    sessions = SessionCompactions(compact, max_bytes=int(2.5 * one))
    for session in ("a", "b", "c", "d"):
        first = turn(tokenizer, snapshot, session=session, background_threshold=700)
        assert (await sessions.turn(first, tokenizer)).status == "running"
    assert len(sessions) == 2 and sessions.bytes() <= 2.5 * one  # the least recently started went first
    gate.set()


async def test_one_tenants_flood_of_background_runs_is_capped_and_others_still_start(
    tokenizer: HFChatTokenizer,
) -> None:
    gate = asyncio.Event()

    async def slow(job: CompactJob, urgent: asyncio.Event | None = None) -> ServiceResult:
        await gate.wait()
        raise BackendError("released")

    sessions = SessionCompactions(slow, max_running_per_tenant=2, tenant_cap=lambda t: 1 if t == "c" else None)
    history = [SYSTEM, *conversation(0, 16)]

    def of(tenant: str, session: str) -> ChatTurn:
        return turn(tokenizer, history, session, background_threshold=700).model_copy(update={"tenant": tenant})

    flood = [await sessions.turn(of("a", f"s{i}"), tokenizer) for i in range(3)]
    assert [o.status for o in flood] == ["running", "running", "none"]
    assert flood[2].note is not None and "has 2 running already" in flood[2].note
    assert (await sessions.turn(of("b", "s0"), tokenizer)).status == "running"  # another tenant is not held back
    capped = [await sessions.turn(of("c", f"s{i}"), tokenizer) for i in range(2)]  # its own cap: 1 at once
    assert [o.status for o in capped] == ["running", "none"] and "has 1 running already" in (capped[1].note or "")
    gate.set()
    await until(lambda: sessions.running() == 0)
    assert (await sessions.turn(of("a", "s9"), tokenizer)).status == "running"  # room again once they ended
    await until(lambda: sessions.running() == 0)


def booked(request: GenerationRequest) -> tuple[str, str]:
    """A model summary that passes every check (the fakes' default restates the instructions: it falls back)."""
    return "The user booked trips and got their confirmation codes.", "stop"


def cached_coordinator(tokenizer: HFChatTokenizer, replicas: FakeReplicas, next_beside: bool = True) -> Coordinator:
    for backend in replicas.replicas.values():
        backend.script = booked if backend.script is short_summary else backend.script
    compactor = Compactor(tokenizer, replicas, context_window=8192, block_size=16, cache=ChunkCache())
    runtime = ModelRuntime(compactor, replicas.count, batch_sequences=128, next_beside=next_beside)
    return Coordinator({MODEL: runtime}, AdmissionConfig())


# keep_recent_tokens: a window these short turns pass (the default, a quarter of compact_threshold: test_policy)
ROLLING = {"background_threshold": 700, "apply_background": "rolling", "keep_recent_tokens": 175}


async def rolled(
    tokenizer: HFChatTokenizer, replicas: FakeReplicas, **entry: Any
) -> tuple[Coordinator, SessionCompactions, list[dict[str, Any]]]:
    """A rolling session past its soft threshold, once its first run has ended: (coordinator, sessions, history)."""
    served = cached_coordinator(tokenizer, replicas)
    sessions = SessionCompactions(served.compact, roll=served.roll)
    history: list[dict[str, Any]] = [SYSTEM, *conversation(0, 16)]
    assert (await sessions.turn(turn(tokenizer, history, **ROLLING, **entry), tokenizer)).status == "running"
    await until(lambda: not sessions.running())
    return served, sessions, history


async def test_rolling_summaries_make_the_thresholds_compaction_blockings_with_only_the_new_chunks_sent(
    tokenizer: HFChatTokenizer,
) -> None:
    replicas = FakeReplicas()
    served, sessions, history = await rolled(tokenizer, replicas)
    rolling = ROLLING
    made = len(served.runtime(MODEL).compactor.cache or ())
    assert made >= 1  # the whole chunks older than keep_recent_tokens, summarised while the agent works
    history += conversation(16, 22)  # a chunk's worth more: the next run summarises only what became final
    assert (await sessions.turn(turn(tokenizer, history, **rolling), tokenizer)).status == "running"
    await until(lambda: not sessions.running())
    assert len(served.runtime(MODEL).compactor.cache or ()) > made
    sent_before = sum(len(r.requests) for r in replicas.replicas.values())
    history += [*conversation(22, 30), {"role": "user", "content": "Which trips are booked?"}]
    outcome = await sessions.turn(turn(tokenizer, history, **rolling), tokenizer)
    sent = sum(len(r.requests) for r in replicas.replicas.values()) - sent_before
    # The same compaction a blocking turn makes of this history (on a service that rolled nothing)...
    alone = cached_coordinator(tokenizer, FakeReplicas())
    blocking = await SessionCompactions(alone.compact).turn(turn(tokenizer, history, **rolling), tokenizer)
    assert outcome.status == blocking.status == "applied"
    assert outcome.source == "background" and blocking.source == "blocking"
    assert outcome.messages == blocking.messages and outcome.replaces_through == blocking.replaces_through
    # ...of which only the chunks that were not final before the threshold were summarised at it.
    assert outcome.stats is not None and blocking.stats is not None
    assert outcome.stats.reused_chunks >= 2 and sent == blocking.stats.chunks - outcome.stats.reused_chunks


async def test_at_the_threshold_the_chunks_a_rolling_run_has_in_flight_are_joined_not_sent_again(
    tokenizer: HFChatTokenizer,
) -> None:
    rolling = {"background_threshold": 700, "apply_background": "rolling"}
    start = [SYSTEM, *conversation(0, 16)]
    history = [*start, *conversation(16, 30), {"role": "user", "content": "Which trips are booked?"}]
    alone = cached_coordinator(tokenizer, FakeReplicas())
    blocking = await SessionCompactions(alone.compact).turn(turn(tokenizer, history, **rolling), tokenizer)
    assert blocking.stats is not None
    chunks = blocking.stats.chunks
    gate = asyncio.Event()
    replicas = FakeReplicas(gate=gate)  # every prompt waits on the engines until the gate opens
    served = cached_coordinator(tokenizer, replicas)
    sessions = SessionCompactions(served.compact, roll=served.roll)
    assert (await sessions.turn(turn(tokenizer, start, **rolling), tokenizer)).status == "running"
    await until(lambda: replicas.parked >= 1)
    in_flight = replicas.parked  # the run's whole chunks, in flight at background priority
    over = asyncio.create_task(sessions.turn(turn(tokenizer, history, **rolling), tokenizer))
    # Raised to the agent's priority where they are (never sent again); the compaction sends only the others.
    await until(lambda: replicas.parked == chunks and len(replicas.raised) == in_flight)
    gate.set()
    outcome = await over
    assert outcome.status == "applied" and outcome.source == "background" and outcome.messages == blocking.messages
    assert outcome.stats is not None and outcome.stats.reused_chunks == in_flight
    assert sum(len(r.requests) for r in replicas.replicas.values()) == chunks  # each chunk summarised once


def sent_so_far(replicas: FakeReplicas) -> int:
    return sum(len(r.requests) for r in replicas.replicas.values())


def borders(outcome: TurnCompaction) -> list[tuple[int, int]]:
    assert outcome.stats is not None
    return [(chunk.start, chunk.end) for chunk in outcome.stats.per_chunk]


def notes(items: int) -> str:
    return " ".join(f"item {i} is in drawer {i % 7}" for i in range(items))  # about 8 tokens an item


def turns_around_the_threshold(
    tokenizer: HFChatTokenizer, history: list[dict[str, Any]], first: str, reply: str, then: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
    """(the last turn's messages before the threshold of 1200, the next turn's past it, its growth)."""
    for pairs in range(16, 40):
        before = [*history, *conversation(16, pairs), {"role": "user", "content": first}]
        after = [*before, {"role": "assistant", "content": reply}, {"role": "user", "content": then}]
        below, over = prompt_tokens(parse_messages(before), tokenizer), prompt_tokens(parse_messages(after), tokenizer)
        if below <= 1200 < over:
            return before, after, over - below
    raise AssertionError("no such turns")


async def rolled_to_the_threshold(
    tokenizer: HFChatTokenizer, reply: str, then: str, handed_on: str | None = None, unfinished: bool = False
) -> tuple[TurnCompaction, TurnCompaction, int, int]:
    """A rolling session's last turn before the threshold (its run done; with `handed_on`, the reply the service
    sent, handed to the session as the ingress does, and that run done too, or still in flight, `unfinished`),
    then the turn past it with `reply`: (its outcome, a blocking turn's of the same messages, prompts it sent, how
    many messages the last turn had)."""
    replicas = FakeReplicas()
    _, sessions, history = await rolled(tokenizer, replicas)
    before, after, growth = turns_around_the_threshold(tokenizer, history, f"A: {notes(30)}", reply, then)
    ahead = turn(tokenizer, before, **ROLLING).model_copy(update={"growth": growth})
    started = await sessions.turn(ahead, tokenizer)
    assert started.status == "running" and started.reply_for == len(before)
    assert "reply_for" not in started.model_dump()  # the service's own, never in a response
    await until(lambda: not sessions.running())
    if handed_on is not None:
        replicas.gate = asyncio.Event() if unfinished else None  # the engines hold what is sent from now on
        answer = Message(role="assistant", content=handed_on)
        sessions.replied(MODEL, ahead.tenant, ahead.session_id or "", len(before) - 1, answer)  # not this run's
        sessions.replied(MODEL, ahead.tenant, ahead.session_id or "", len(before), answer)
        await until(lambda: replicas.parked >= 1 if unfinished else not sessions.running())
    sent = sent_so_far(replicas)
    outcome = await sessions.turn(turn(tokenizer, after, **ROLLING).model_copy(update={"growth": growth}), tokenizer)
    if replicas.gate is not None:
        replicas.gate.set()
    alone = cached_coordinator(tokenizer, FakeReplicas())
    blocking = await SessionCompactions(alone.compact).turn(turn(tokenizer, after, **ROLLING), tokenizer)
    assert outcome.status == blocking.status == "applied" and outcome.stats is not None and blocking.stats is not None
    return outcome, blocking, sent_so_far(replicas) - sent, len(before)


async def test_the_last_turn_before_the_threshold_summarises_every_chunk_the_thresholds_compaction_will_take(
    tokenizer: HFChatTokenizer,
) -> None:
    """A turn after which one more like it passes the threshold rolls its whole history, last chunk included: the
    turn past the threshold sends nothing and its compaction is blocking's (here the new turn fits in
    keep_recent_tokens, 175, so blocking's span ends where the last turn's history did)."""
    outcome, blocking, sent, _ = await rolled_to_the_threshold(tokenizer, "Noted.", f"B: {notes(12)}")
    assert outcome.source == "background" and outcome.messages == blocking.messages
    assert outcome.replaces_through == blocking.replaces_through and borders(outcome) == borders(blocking)
    assert outcome.stats is not None and outcome.stats.reused_chunks == outcome.stats.chunks >= 2 and sent == 0


async def test_past_the_threshold_a_short_reply_stays_verbatim_so_every_chunk_was_rolled_ahead(
    tokenizer: HFChatTokenizer,
) -> None:
    """The new turn is longer than keep_recent_tokens, so a blocking compaction summarises the agent's reply to the
    last turn too (a chunk nobody could roll ahead). The rolling session keeps that reply verbatim instead: a few
    tokens more than blocking (at most a quarter of keep_recent_tokens), and nothing sent at the threshold. So it
    does when the reply handed on once sent is not the one the client sends back (the follow-up's chunk is not
    blocking's)."""
    outcome, blocking, sent, last = await rolled_to_the_threshold(tokenizer, "Noted.", f"B: {notes(30)}", "Other.")
    assert blocking.replaces_through == last + 1 and outcome.replaces_through == last  # the reply stays verbatim
    assert outcome.stats is not None and outcome.stats.reused_chunks == outcome.stats.chunks and sent == 0
    assert blocking.compacted_prompt_tokens is not None and outcome.compacted_prompt_tokens is not None
    assert blocking.compacted_prompt_tokens < outcome.compacted_prompt_tokens <= blocking.compacted_prompt_tokens + 43


async def test_the_reply_handed_on_once_sent_is_rolled_too_so_the_threshold_compacts_exactly_as_blocking(
    tokenizer: HFChatTokenizer,
) -> None:
    """The same turns, the reply handed to the session once it was sent: a follow-up run summarises blocking's own
    last chunk (the reply in it) before the threshold, which then compacts as blocking does and sends nothing."""
    outcome, blocking, sent, last = await rolled_to_the_threshold(tokenizer, "Noted.", f"B: {notes(30)}", "Noted.")
    assert outcome.replaces_through == blocking.replaces_through == last + 1 and outcome.messages == blocking.messages
    assert outcome.compacted_prompt_tokens == blocking.compacted_prompt_tokens and borders(outcome) == borders(blocking)
    assert outcome.stats is not None and outcome.stats.reused_chunks == outcome.stats.chunks and sent == 0


async def test_a_follow_up_still_in_flight_at_the_threshold_is_dropped_and_the_reply_stays_verbatim(
    tokenizer: HFChatTokenizer,
) -> None:
    """The reply's follow-up has not finished when the turn past the threshold comes (a tool gap of a few hundredths
    of a second): the turn does not wait for it, it keeps the reply verbatim and sends nothing."""
    outcome, blocking, sent, last = await rolled_to_the_threshold(
        tokenizer, "Noted.", f"B: {notes(30)}", "Noted.", unfinished=True
    )
    assert blocking.replaces_through == last + 1 and outcome.replaces_through == last and sent == 0
    assert outcome.stats is not None and outcome.stats.reused_chunks == outcome.stats.chunks


async def test_a_chunk_summarised_ahead_for_another_span_end_never_cuts_the_thresholds_span_differently(
    tokenizer: HFChatTokenizer,
) -> None:
    """A reply too long to keep verbatim (over a quarter of keep_recent_tokens) is summarised as blocking would: the
    chunk the last run summarised up to the reply's start is not made a border, so the compaction is blocking's."""
    outcome, blocking, sent, last = await rolled_to_the_threshold(tokenizer, f"Reply: {notes(12)}", f"B: {notes(30)}")
    assert outcome.replaces_through == blocking.replaces_through == last + 1
    assert outcome.messages == blocking.messages and outcome.stats is not None and blocking.stats is not None
    assert borders(outcome) == borders(blocking)
    assert outcome.stats.reused_chunks >= 1 and sent == outcome.stats.chunks - outcome.stats.reused_chunks >= 1


async def test_the_last_turn_before_the_threshold_rolls_beside_a_run_still_in_flight_and_joins_its_chunks(
    tokenizer: HFChatTokenizer,
) -> None:
    """A regular rolling run is still in flight (the engines hold every prompt) when the last turn before the
    threshold comes: that turn's run starts beside it, the first run goes on, no chunk prompt is sent twice, and
    the turn past the threshold sends nothing: its compaction is blocking's, every chunk found summarised."""
    gate = asyncio.Event()
    replicas = FakeReplicas(gate=gate)
    served = cached_coordinator(tokenizer, replicas)
    sessions = SessionCompactions(served.compact, roll=served.roll)
    history: list[dict[str, Any]] = [SYSTEM, *conversation(0, 16)]
    assert (await sessions.turn(turn(tokenizer, history, **ROLLING), tokenizer)).status == "running"
    await until(lambda: replicas.parked >= 1)
    first = replicas.parked
    before, after, growth = turns_around_the_threshold(
        tokenizer, history, f"A: {notes(30)}", "Noted.", f"B: {notes(12)}"
    )
    ahead = turn(tokenizer, before, **ROLLING).model_copy(update={"growth": growth})
    assert (await sessions.turn(ahead, tokenizer)).status == "running"
    await until(lambda: replicas.parked > first)  # the last run's own chunks; the first run's are joined
    gate.set()
    await until(lambda: not sessions.running() and sent_so_far(replicas) == replicas.parked)
    prompts = [tuple(r.prompt_token_ids) for b in replicas.replicas.values() for r in b.requests]
    assert len(prompts) == len(set(prompts)) > first  # the first run was not cancelled: nothing sent twice
    sent = sent_so_far(replicas)
    outcome = await sessions.turn(turn(tokenizer, after, **ROLLING).model_copy(update={"growth": growth}), tokenizer)
    alone = cached_coordinator(tokenizer, FakeReplicas())
    blocking = await SessionCompactions(alone.compact).turn(turn(tokenizer, after, **ROLLING), tokenizer)
    assert outcome.status == blocking.status == "applied" and outcome.messages == blocking.messages
    assert outcome.stats is not None and outcome.stats.reused_chunks == outcome.stats.chunks >= 2
    assert sent_so_far(replicas) == sent  # nothing asked at the threshold


def empty_in_the_background(request: GenerationRequest) -> tuple[str, str]:
    return ("", "stop") if request.priority == BACKGROUND else booked(request)


def empty_until_asked_again(request: GenerationRequest, seen: set[tuple[int, ...]]) -> tuple[str, str]:
    """Background summaries empty the first time a prompt is asked (the chunk falls back), good the second."""
    if request.priority != BACKGROUND or tuple(request.prompt_token_ids) in seen:
        return booked(request)
    seen.add(tuple(request.prompt_token_ids))
    return "", "stop"


@pytest.mark.parametrize("second", ["good", "empty"])
async def test_a_chunk_whose_rolled_summary_fell_back_is_asked_again_at_once_and_the_threshold_takes_that_answer(
    tokenizer: HFChatTokenizer, second: str
) -> None:
    """A background chunk whose prompt and strict prompt both came back empty is asked again in the same tool gap,
    both prompts together, as a compaction would ask it; that answer is kept, a fallback too (the chunk was asked
    twice, as the threshold's compaction asked it before), and the threshold sends nothing for the chunk."""
    replicas = FakeReplicas()
    seen: set[tuple[int, ...]] = set()
    for backend in replicas.replicas.values():
        backend.script = (
            functools.partial(empty_until_asked_again, seen=seen) if second == "good" else empty_in_the_background
        )
    served, sessions, history = await rolled(tokenizer, replicas)
    asked = Counter(r.request_id for b in replicas.replicas.values() for r in b.requests)
    rolled_chunks = {rid.split("-")[1] for rid in asked}
    assert rolled_chunks and asked == Counter(
        {f"chunk-{k}-{kind}": 2 for k in rolled_chunks for kind in ("first", "retry")}
    )  # asked, retried strictly, then both at once: four prompts, every one in the background
    cache = served.runtime(MODEL).compactor.cache
    assert cache is not None and len(cache) == len(rolled_chunks)
    sent = sent_so_far(replicas)
    history += [*conversation(16, 30), {"role": "user", "content": "Which trips are booked?"}]
    outcome = await sessions.turn(turn(tokenizer, history, **ROLLING), tokenizer)
    assert outcome.status == "applied" and outcome.stats is not None
    taken = [c for c in outcome.stats.per_chunk if c.reused]
    assert len(taken) == len(rolled_chunks)  # every rolled chunk taken from the cache, none asked at the threshold
    assert {c.status for c in taken} == {"ok"} if second == "good" else {c.status for c in taken} <= FALLBACKS
    again = sent_so_far(replicas) - sent
    assert again == sum(1 + c.retries for c in outcome.stats.per_chunk if not c.reused)  # the new chunks alone


async def test_a_rolled_chunk_that_falls_back_after_the_threshold_raised_it_is_not_asked_a_third_time(
    tokenizer: HFChatTokenizer,
) -> None:
    """The run's prompts are in flight when the threshold comes; raised to the agent's priority, a chunk's prompt
    and its strict one both come back empty, so it falls back: the threshold's compaction takes that (as blocking
    would have), instead of asking both again."""
    probe = FakeReplicas()  # the same run ungated: how many chunks it asks
    await rolled(tokenizer, probe)
    first = len({r.request_id for b in probe.replicas.values() for r in b.requests})
    gate = asyncio.Event()
    replicas = FakeReplicas(gate=gate)
    for backend in replicas.replicas.values():
        backend.script = lambda request: ("", "stop")  # every summary empty: every chunk falls back
    served = cached_coordinator(tokenizer, replicas)
    sessions = SessionCompactions(served.compact, roll=served.roll)
    history: list[dict[str, Any]] = [SYSTEM, *conversation(0, 16)]
    assert (await sessions.turn(turn(tokenizer, history, **ROLLING), tokenizer)).status == "running"
    await until(lambda: replicas.parked >= first)  # every one of its first prompts held
    history += [*conversation(16, 30), {"role": "user", "content": "Which trips are booked?"}]
    past = asyncio.create_task(sessions.turn(turn(tokenizer, history, **ROLLING), tokenizer))
    await until(lambda: replicas.parked >= 2 * first)  # re-sent at the agent's priority, still held
    gate.set()
    outcome = await past
    assert outcome.status == "applied" and outcome.stats is not None, outcome.note
    asked = [tuple(r.prompt_token_ids) for b in replicas.replicas.values() for r in b.requests]
    assert len(asked) >= 2 * first and len(asked) == len(set(asked))  # the re-sent prompts, none asked again


async def test_a_tool_using_agents_compaction_reads_what_its_turns_left_in_the_prefix_cache(
    tokenizer: HFChatTokenizer,
) -> None:
    """The turn's tool list reaches the compaction, whose chunk prompts then start with the agent's own prompt
    tokens (the template over tool calls, the tools in the system turn): they are served from the cache the
    agent's turn filled. Without the list they part from it in the system turn: the first chunk's prompt finds only
    the system message cached (later ones find the earlier chunks' prompts)."""
    messages = coding_trace(0, 3000, tokenizer).messages
    tools = engine_tools(TOOLS)
    views = [chat_view(m) for m in parse_messages(messages)]
    agent = tuple(tokenizer.encode(tokenizer.render(views, add_generation_prompt=True, tools=tools)))
    figures = {}
    for sent in (tools, None):
        replicas = FakeReplicas()
        await replicas.generate(GenerationRequest(prompt_token_ids=agent, max_tokens=8, routing_key="s1"))
        request = turn(tokenizer, messages).model_copy(update={"tools": sent, "prompt_tokens": len(agent)})
        outcome = await SessionCompactions(Counting(tokenizer, replicas)).turn(request, tokenizer)
        assert outcome.status == "applied" and outcome.stats is not None and outcome.stats.chunks > 3
        first = outcome.stats.per_chunk[0]
        figures[sent is not None] = (
            outcome.stats.history_cached_fraction,
            first.cached_prompt_tokens / first.prompt_tokens,
        )
    assert figures[True][0] >= 0.9 and figures[True][1] >= 0.8 and figures[False][1] < 0.5, figures


async def test_the_last_turns_before_the_threshold_share_their_chunks_and_only_the_newest_last_chunk_goes_on(
    tokenizer: HFChatTokenizer,
) -> None:
    """Three last turns before the threshold on CPU engines (their runs at background priority), their prompts held on
    the engines: each later run joins the chunks the first sent and gives up the earlier runs' last chunks (a later
    turn's supersedes them); the turn past the threshold raises what it needs where it is, whichever run sent it, and
    sends no prompt twice."""
    turns = [[SYSTEM, *conversation(0, 16), {"role": "user", "content": "Question 0?"}]]
    for i in (1, 2):
        reply = {"role": "assistant", "content": f"Noted {i}."}
        turns.append([*turns[-1], reply, {"role": "user", "content": f"Question {i}?"}])
    history = [*turns[-1], {"role": "assistant", "content": "Noted."}, *conversation(18, 26)]
    history.append({"role": "user", "content": "Which trips are booked?"})
    alone = cached_coordinator(tokenizer, FakeReplicas())
    blocking = await SessionCompactions(alone.compact).turn(turn(tokenizer, history, **ROLLING), tokenizer)
    gate = asyncio.Event()
    replicas = FakeReplicas(gate=gate)  # every prompt waits on the engines until the gate opens
    served = cached_coordinator(tokenizer, replicas, next_beside=False)  # as on the CPU: last runs in the background
    sessions = SessionCompactions(served.compact, roll=served.roll)
    for messages in turns:  # one more turn this long would pass the threshold: each is a last turn's
        last = turn(tokenizer, messages, **ROLLING).model_copy(update={"growth": 1200})
        parked = replicas.parked
        assert (await sessions.turn(last, tokenizer)).status == "running"
        await until(lambda parked=parked: replicas.parked > parked)
    sent = replicas.parked
    outcome = asyncio.create_task(sessions.turn(turn(tokenizer, history, **ROLLING), tokenizer))
    await until(lambda: replicas.parked > sent and len(replicas.raised) >= 2)
    gate.set()
    done = await outcome
    assert done.status == "applied" and done.messages == blocking.messages and done.stats is not None
    assert done.stats.reused_chunks == len(replicas.raised)  # the chunks in flight, raised where they were
    requests = [r for b in replicas.replicas.values() for r in b.requests]
    prompts = [tuple(r.prompt_token_ids) for r in requests]
    assert len(prompts) == len(set(prompts))  # no prompt summarised twice
    assert len(requests) < replicas.parked  # the earlier last chunks were given up on the engines
