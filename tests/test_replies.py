"""The reply hand-on (serving.replies): sent in the background, waited for by the session's next turn, never an
error of the turn's."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from serving import replies
from serving.replies import HandOn


async def test_the_next_turn_waits_for_its_sessions_reply_and_not_for_anothers() -> None:
    arrived: list[tuple[str, Any]] = []
    gates = {"s1": asyncio.Event(), "s2": asyncio.Event()}

    async def send(session: str, reply: Any) -> None:
        await gates[session].wait()
        arrived.append((session, reply))

    hand_on = HandOn(send)
    hand_on("s1", {"content": "one"})
    hand_on("s2", {"content": "two"})
    await asyncio.wait_for(hand_on.handed("s3"), 1)  # nothing on its way: no wait
    waiting = asyncio.ensure_future(hand_on.handed("s1"))
    await asyncio.sleep(0)
    assert not waiting.done()
    gates["s1"].set()
    await asyncio.wait_for(waiting, 1)
    assert arrived == [("s1", {"content": "one"})]
    gates["s2"].set()
    await asyncio.wait_for(hand_on.handed("s2"), 1)
    assert arrived[-1] == ("s2", {"content": "two"}) and not hand_on._pending


async def test_a_reply_that_cannot_be_handed_on_delays_the_next_turn_at_most_the_wait_and_raises_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(replies, "REPLY_WAIT_S", 0.05)
    never = asyncio.Event()

    async def stuck(session: str, reply: Any) -> None:
        await never.wait()

    async def failing(session: str, reply: Any) -> None:
        raise RuntimeError("the coordinator is gone")

    hand_on = HandOn(stuck)
    hand_on("s1", {})
    await asyncio.wait_for(hand_on.handed("s1"), 1)  # bounded by REPLY_WAIT_S
    never.set()
    await asyncio.wait_for(hand_on.handed("s1"), 1)
    broken = HandOn(failing)
    broken("s1", {})
    await asyncio.wait_for(broken.handed("s1"), 1)
    assert not broken._pending
