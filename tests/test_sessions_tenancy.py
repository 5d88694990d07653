"""Chat-side compaction per tenant (pure: real tokenizer, real coordinator, fake replicas): a tenant that knows
another's session id and first messages can neither take its background result, cancel it, nor evict it."""

from __future__ import annotations

import asyncio
from typing import Any

from compaction.tokenizer import HFChatTokenizer
from serving.background import SessionCompactions
from serving.turns import ChatTurn
from tests.test_coordinator import FakeReplicas
from tests.test_sessions import SYSTEM, Counting, conversation, turn


def of(tenant: str, base: ChatTurn) -> ChatTurn:
    return base.model_copy(update={"tenant": tenant, "cache_salt": f"salt-{tenant}"})


async def settled() -> None:
    """Every background run and its prefill has finished."""
    runs = [t for t in asyncio.all_tasks() if t.get_name().startswith(("background-", "warm-"))]
    await asyncio.gather(*runs, return_exceptions=True)  # an evicted run ends cancelled


async def test_a_tenant_gets_only_its_own_background_result(tokenizer: HFChatTokenizer) -> None:
    compact = Counting(tokenizer, FakeReplicas())
    sessions = SessionCompactions(compact)
    snapshot = [SYSTEM, *conversation(0, 16)]
    started = await sessions.turn(of("b", turn(tokenizer, snapshot, background_threshold=700)), tokenizer)
    assert started.status == "running"
    await settled()
    grown: list[dict[str, Any]] = [*snapshot, *conversation(16, 30)]
    intruder = await sessions.turn(of("a", turn(tokenizer, grown, background_threshold=700)), tokenizer)
    assert intruder.status == "applied" and intruder.source == "blocking"  # compacted its own copy, from scratch
    assert [(j.tenant, j.cache_salt) for j in compact.calls[1:]] == [("a", "salt-a")] * (len(compact.calls) - 1)
    owner = await sessions.turn(of("b", turn(tokenizer, grown, background_threshold=700)), tokenizer)
    assert owner.status == "applied" and owner.source == "background"  # B's run was neither taken nor cancelled
    assert compact.calls[0].tenant == "b" and compact.calls[0].cache_salt == "salt-b"


async def test_one_tenant_cycling_session_ids_evicts_none_of_anothers(tokenizer: HFChatTokenizer) -> None:
    compact = Counting(tokenizer, FakeReplicas())
    sessions = SessionCompactions(compact, max_sessions=1)
    snapshot = [SYSTEM, *conversation(0, 16)]
    await sessions.turn(of("b", turn(tokenizer, snapshot, background_threshold=700)), tokenizer)
    for session in ("s1", "x1", "x2"):  # B's own id among them: a run of A's under it replaces nothing of B's
        await sessions.turn(of("a", turn(tokenizer, snapshot, session, background_threshold=700)), tokenizer)
    await settled()
    assert len(sessions) == 2  # one per tenant: A's last, and B's
    grown = [*snapshot, *conversation(16, 30)]
    owner = await sessions.turn(of("b", turn(tokenizer, grown, background_threshold=700)), tokenizer)
    assert owner.status == "applied" and owner.source == "background"


async def test_a_failed_background_run_says_so_without_its_exception_text(tokenizer: HFChatTokenizer) -> None:
    compact = Counting(tokenizer, FakeReplicas())
    compact.fail = 1
    sessions = SessionCompactions(compact)
    snapshot = [SYSTEM, *conversation(0, 16)]
    await sessions.turn(turn(tokenizer, snapshot, background_threshold=700), tokenizer)
    await settled()
    outcome = await sessions.turn(
        turn(tokenizer, [*snapshot, *conversation(16, 30)], background_threshold=700), tokenizer
    )
    assert outcome.status == "applied" and outcome.source == "blocking"
    assert outcome.note == "the background compaction failed; compacted now"  # "replica died" went to the log
