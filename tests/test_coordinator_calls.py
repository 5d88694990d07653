"""The ingress's calls to the coordinator: a job under which coordinators keep dying is not sent again."""

from __future__ import annotations

import asyncio
from collections.abc import Generator
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import BaseModel
from ray.exceptions import ActorDiedError

from compaction.errors import BackendError
from serving import coordinator_calls
from serving.coordinator_calls import Suspects, call_coordinator


class Job(BaseModel):
    history: str


class Response:
    def __init__(self, behaviour: tuple[float, Any]) -> None:
        self.delay, self.outcome = behaviour

    def __await__(self) -> Generator[Any, None, Any]:
        return self._wait().__await__()

    async def _wait(self) -> Any:
        await asyncio.sleep(self.delay)
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome

    def cancel(self) -> None:
        pass


class Handle:
    """A deployment handle whose replicas answer (delay, outcome) in turn."""

    def __init__(self, *behaviours: tuple[float, Any]) -> None:
        self.behaviours = list(behaviours)
        self.sent: list[Any] = []

    def options(self, **_: Any) -> Handle:
        return self

    def remote(self, *args: Any) -> Response:
        self.sent.append(args)
        return Response(self.behaviours.pop(0))


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(coordinator_calls, "BACKOFF_S", (0.0,))


def test_a_job_is_resent_after_one_coordinator_dies_under_it() -> None:
    suspects = Suspects(ttl_s=60)
    handle = Handle((0.1, ActorDiedError()), (0.0, "done"))
    assert asyncio.run(call_coordinator(handle, "compact", Job(history="x"), suspects=suspects)) == "done"  # type: ignore[arg-type]
    assert len(handle.sent) == 2 and len(suspects) == 1  # one strike, remembered


def test_a_job_that_two_coordinators_died_under_is_not_resent_and_then_refused() -> None:
    suspects = Suspects(ttl_s=60)
    handle = Handle((0.1, ActorDiedError()), (0.1, ActorDiedError()), (0.0, "done"))
    with pytest.raises(BackendError, match="it is not sent again"):
        asyncio.run(call_coordinator(handle, "compact", Job(history="x"), suspects=suspects))  # type: ignore[arg-type]
    assert len(handle.sent) == 2
    with pytest.raises(BackendError, match="refused for another"):
        asyncio.run(call_coordinator(handle, "compact", Job(history="x"), suspects=suspects))  # type: ignore[arg-type]
    assert len(handle.sent) == 2  # refused at the ingress
    assert asyncio.run(call_coordinator(handle, "compact", Job(history="y"), suspects=suspects)) == "done"  # type: ignore[arg-type]


def test_strikes_add_up_over_calls_of_the_same_job() -> None:
    suspects = Suspects(ttl_s=60)
    first = Handle((0.0, ActorDiedError()), (0.0, "done"))
    assert asyncio.run(call_coordinator(first, "compact", Job(history="x"), suspects=suspects)) == "done"  # type: ignore[arg-type]
    again = Handle((0.0, ActorDiedError()), (0.0, "done"))
    with pytest.raises(BackendError, match="it is not sent again"):
        asyncio.run(call_coordinator(again, "compact", Job(history="x"), suspects=suspects))  # type: ignore[arg-type]
    assert len(again.sent) == 1


def test_calls_that_run_no_job_are_retried_on_a_live_replica_as_before() -> None:
    handle = Handle((0.1, ActorDiedError()), (0.0, {"m": 1}))
    assert asyncio.run(call_coordinator(handle, "replicas")) == {"m": 1}  # type: ignore[arg-type]
    assert len(handle.sent) == 2


def test_a_refusal_ends_after_its_time(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]  # the module's clock, moved by hand: the test holds on a machine of any speed
    monkeypatch.setattr(coordinator_calls, "time", SimpleNamespace(monotonic=lambda: now[0]))
    suspects = Suspects(ttl_s=60, strikes=1)
    key = Suspects.fingerprint(Job(history="x"))
    assert suspects.strike(key)
    now[0] += 59
    with pytest.raises(BackendError, match="refused"):
        suspects.check(key)
    now[0] += 2
    suspects.check(key)
    assert len(suspects) == 0
