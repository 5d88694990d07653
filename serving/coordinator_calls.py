"""Calls from the ingress (HTTP handlers, chat path) to the coordinator deployment, in one place.

    outcome = await call_coordinator(handle, "compact", job, session_id=job.session_id)

- Sticky by session: a call that carries a session id goes through `handle.options(session_id=...)`,
  and the coordinator deployment's router (`serving.ray_adapter.SessionRouter`, a consistent hash)
  sends every call of a session to the same coordinator replica, which keeps the session's cached
  state. Calls without a session go to any replica.
- Retried on a live replica: when the coordinator replica is unreachable or none is ready, the
  router drops it and the call is sent again (the session's ring walk goes on to a live replica).
  Compaction has no side effects, so a repeat is safe. `attempts` bounds the tries, with a short
  backoff while Serve notices the death.
- Never a poison pill: when the coordinator replica dies while it runs a job (a compaction or a chat
  turn, given with a `Suspects` table), the job is not sent to the next one: a request that brought
  one coordinator down would bring the next down too. The caller gets 503, and an identical job is
  refused for `POISON_TTL_S` (the ingress's table, bounded). A replica lost within `UNDELIVERED_S`
  of the send was most likely gone before it (Serve's router had not noticed yet): that job is sent
  once more, and not again.
- Cancelled with the caller: when the caller is cancelled (client disconnect, deadline), the call
  is cancelled on the coordinator explicitly, which cancels the compaction there.
- Errors: a `Failure` the coordinator returned becomes its `CompactionError`; when no coordinator
  replica can take the call, `BackendError` (503 + Retry-After). Ray's exception text never reaches
  a response; it goes to the log.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from typing import Any

from pydantic import BaseModel
from ray.exceptions import ActorUnavailableError, RayActorError, RayError, TaskCancelledError
from ray.serve.exceptions import BackPressureError, RequestCancelledError
from ray.serve.handle import DeploymentHandle

from compaction.errors import BackendError
from serving.coordinator import Failure
from serving.metrics import record_coordinator_retry

logger = logging.getLogger(__name__)
# A dead replica, an unreachable one, or a Serve router with none to offer right now.
RETRIABLE: tuple[type[Exception], ...] = (RayActorError, ActorUnavailableError, BackPressureError)
BACKOFF_S = (0.5, 1.0, 2.0, 4.0)
POISON_TTL_S = 300.0  # an identical job is refused this long after its coordinator died running it
UNDELIVERED_S = 1.0  # a replica lost within this of the send was gone already (the router had not noticed)


class Suspects:
    """Jobs that were running on a coordinator replica when it died: refused for a while (bounded, LRU)."""

    def __init__(self, ttl_s: float = POISON_TTL_S, max_entries: int = 4096) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._until: OrderedDict[str, float] = OrderedDict()  # job fingerprint -> monotonic time it is refused to

    def __len__(self) -> int:
        return len(self._until)

    @staticmethod
    def fingerprint(job: BaseModel) -> str:
        return hashlib.sha256(job.model_dump_json(exclude={"timeout_s"}).encode()).hexdigest()

    def add(self, key: str) -> None:
        self._until[key] = time.monotonic() + self.ttl_s
        self._until.move_to_end(key)
        while len(self._until) > self.max_entries:
            self._until.popitem(last=False)

    def check(self, key: str) -> None:
        """Raise BackendError (503) while the job is refused."""
        until = self._until.get(key)
        if until is None:
            return
        left = until - time.monotonic()
        if left <= 0:
            del self._until[key]
            return
        raise BackendError(
            f"an identical request was running on a compaction coordinator when it stopped; it is refused for "
            f"another {left:.0f} s: compact a shorter history or use larger chunk_tokens"
        )


def _not_resent(method: str, key: str, suspects: Suspects) -> BackendError:
    logger.warning(
        "a coordinator stopped running %s (job %s); not resent, refused for %.0f s", method, key[:12], suspects.ttl_s
    )
    suspects.add(key)
    return BackendError(
        "the compaction coordinator stopped while running this request; it was not resent, since a request that "
        f"stops a coordinator would stop the next one, and an identical request is refused for {suspects.ttl_s:.0f} "
        "s: compact a shorter history or use larger chunk_tokens"
    )


async def call_coordinator(
    handle: DeploymentHandle,
    method: str,
    *args: Any,
    session_id: str | None = None,
    attempts: int = 4,
    suspects: Suspects | None = None,
) -> Any:
    """`handle.<method>.remote(*args)` on a live coordinator replica; a returned Failure is raised.

    With `suspects`, args[0] is a job (a pydantic model): refused while suspect, never resent after the
    coordinator died running it.
    """
    target = handle.options(method_name=method)
    if session_id:
        target = target.options(session_id=session_id)
    key = Suspects.fingerprint(args[0]) if suspects is not None and args else None
    if key is not None and suspects:
        suspects.check(key)
    lost = 0  # replicas lost during this call
    for attempt in range(attempts):
        response = target.remote(*args)
        sent = time.monotonic()
        try:
            outcome = await response
        except (asyncio.CancelledError, RequestCancelledError, TaskCancelledError):
            response.cancel()
            raise
        except RETRIABLE as exc:
            if isinstance(exc, RayActorError) and key is not None and suspects is not None:
                lost += 1
                # Running when the replica died (not a send to a replica already gone), or lost twice: not resent.
                if time.monotonic() - sent >= UNDELIVERED_S or lost > 1:
                    raise _not_resent(method, key, suspects) from exc
            logger.warning("coordinator call %s failed (attempt %d of %d): %r", method, attempt + 1, attempts, exc)
            if attempt + 1 == attempts:
                raise BackendError(
                    "no compaction coordinator could take the request right now; retry after the Retry-After seconds"
                ) from exc
            record_coordinator_retry(method)
            await asyncio.sleep(BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)])
            continue
        except RayError as exc:  # a coordinator bug: logged in full, answered without internals
            logger.exception("coordinator call %s raised", method)
            raise BackendError(f"the compaction coordinator failed ({type(exc).__name__}); retry shortly") from exc
        if isinstance(outcome, Failure):
            raise outcome.exception()
        return outcome
    raise BackendError("no compaction coordinator was tried")  # attempts < 1
