"""Calls from the ingress (HTTP handlers, chat path) to the coordinator deployment, in one place.

    outcome = await call_coordinator(handle, "compact", job, session_id=job.session_id)

- Sticky by session: a call that carries a session id goes through `handle.options(session_id=...)`,
  and the coordinator deployment's router (`serving.ray_router.SessionRouter`, a consistent hash)
  sends every call of a session to the same coordinator replica, which keeps the session's cached
  state. Calls without a session go to any replica.
- Retried on a live replica: when the coordinator replica is unreachable or none is ready, the
  router drops it and the call is sent again (the session's ring walk goes on to a live replica).
  Compaction has no side effects, so a repeat is safe. `attempts` bounds the tries, with a short
  backoff while Serve notices the death.
- Never a poison pill: when the coordinator replica dies while it runs a job (a compaction or a chat
  turn, given with a `Suspects` table), the job gets a strike. After its first strike it is sent once
  more, to a live replica (a lost node or a killed process is far more common than a request that
  kills): the caller still gets its answer. A job with `STRIKES` strikes brought down one coordinator
  after another: it is not sent again, the caller gets 503, and an identical job is refused for
  `POISON_TTL_S` (the ingress's table, bounded). So one request can stop at most `STRIKES`
  coordinators in that time.
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
from typing import Any

from pydantic import BaseModel
from ray.exceptions import ActorUnavailableError, RayActorError, RayError, TaskCancelledError
from ray.serve.exceptions import BackPressureError, RequestCancelledError
from ray.serve.handle import DeploymentHandle

from compaction.bounded import BoundedLRU
from compaction.errors import BackendError
from serving.errors import Failure
from serving.metrics import record_coordinator_retry

logger = logging.getLogger(__name__)
# A dead replica, an unreachable one, or a Serve router with none to offer right now.
RETRIABLE: tuple[type[Exception], ...] = (RayActorError, ActorUnavailableError, BackPressureError)
BACKOFF_S = (0.5, 1.0, 2.0, 4.0)
POISON_TTL_S = 300.0  # strikes are remembered this long; a job with STRIKES of them is refused meanwhile
STRIKES = 2  # coordinators a job may see die while it runs before it is refused


class Suspects:
    """Jobs that were running on a coordinator replica when it died, with their strikes (bounded, LRU, timed)."""

    def __init__(self, ttl_s: float = POISON_TTL_S, max_entries: int = 4096, strikes: int = STRIKES) -> None:
        self.ttl_s = ttl_s
        self.strikes = strikes
        self._seen: BoundedLRU[str, tuple[int, float]] = BoundedLRU(max_entries)  # fingerprint -> (strikes, until)

    def __len__(self) -> int:
        return len(self._seen)

    @staticmethod
    def fingerprint(job: BaseModel) -> str:
        return hashlib.sha256(job.model_dump_json(exclude={"timeout_s"}).encode()).hexdigest()

    def strike(self, key: str) -> bool:
        """Count a coordinator's death under this job; True when the job may not be sent again."""
        count = self._count(key) + 1
        self._seen.put(key, (count, time.monotonic() + self.ttl_s))
        if count >= self.strikes:
            logger.warning(
                "job %s: %d coordinators stopped running it; refused for %.0f s", key[:12], count, self.ttl_s
            )
        return count >= self.strikes

    def check(self, key: str) -> None:
        """Raise BackendError (503) while the job is refused."""
        if self._count(key) < self.strikes:
            return
        left = self._until(key) - time.monotonic()
        raise BackendError(
            f"an identical request was running on {self.strikes} compaction coordinators when they stopped; it is "
            f"refused for another {left:.0f} s: compact a shorter history or use larger chunk_tokens"
        )

    def _until(self, key: str) -> float:
        return (self._seen.peek(key) or (0, 0.0))[1]

    def _count(self, key: str) -> int:
        count, until = self._seen.peek(key) or (0, 0.0)
        if count and until <= time.monotonic():
            self._seen.pop(key)
            return 0
        return count


async def call_coordinator(
    handle: DeploymentHandle,
    method: str,
    *args: Any,
    session_id: str | None = None,
    attempts: int = 4,
    suspects: Suspects | None = None,
) -> Any:
    """`handle.<method>.remote(*args)` on a live coordinator replica; a returned Failure is raised.

    With `suspects`, args[0] is a job (a pydantic model): refused while it has its strikes, and not resent
    once a coordinator's death under it gives it the last one.
    """
    target = handle.options(method_name=method)
    if session_id:
        target = target.options(session_id=session_id)
    key = Suspects.fingerprint(args[0]) if suspects is not None and args else None
    if key is not None and suspects:
        suspects.check(key)
    for attempt in range(attempts):
        response = target.remote(*args)
        try:
            outcome = await response
        except (asyncio.CancelledError, RequestCancelledError, TaskCancelledError):
            response.cancel()
            raise
        except RETRIABLE as exc:
            if isinstance(exc, RayActorError) and key is not None and suspects is not None and suspects.strike(key):
                raise BackendError(
                    f"{suspects.strikes} compaction coordinators stopped while running this request; it is not sent "
                    f"again, and an identical request is refused for {suspects.ttl_s:.0f} s: compact a shorter "
                    "history or use larger chunk_tokens"
                ) from exc
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
            raise BackendError("the compaction coordinator failed; retry shortly") from exc
        if isinstance(outcome, Failure):
            raise outcome.exception()
        return outcome
    raise BackendError("no compaction coordinator was tried")  # attempts < 1
