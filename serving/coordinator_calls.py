"""Calls from the ingress (HTTP handlers, chat path) to the coordinator deployment, in one place.

    outcome = await call_coordinator(handle, "compact", job, session_id=job.session_id)

- Sticky by session: a call that carries a session id goes through `handle.options(session_id=...)`,
  and the coordinator deployment's router (`serving.ray_adapter.SessionRouter`, a consistent hash)
  sends every call of a session to the same coordinator replica, which keeps the session's cached
  state. Calls without a session go to any replica.
- Retried on a live replica: when the coordinator replica dies or is unreachable mid-call, the
  router drops it and the call is sent again (the session's ring walk goes on to a live replica).
  Compaction has no side effects, so a repeat is safe. `attempts` bounds the tries, with a short
  backoff while Serve notices the death.
- Cancelled with the caller: when the caller is cancelled (client disconnect, deadline), the call
  is cancelled on the coordinator explicitly, which cancels the compaction there.
- Errors: a `Failure` the coordinator returned becomes its `CompactionError`; when no coordinator
  replica can take the call, `BackendError` (503 + Retry-After). Ray's exception text never reaches
  a response; it goes to the log.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

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


async def call_coordinator(
    handle: DeploymentHandle, method: str, *args: Any, session_id: str | None = None, attempts: int = 4
) -> Any:
    """`handle.<method>.remote(*args)` on a live coordinator replica; a returned Failure is raised."""
    target = handle.options(method_name=method)
    if session_id:
        target = target.options(session_id=session_id)
    for attempt in range(attempts):
        response = target.remote(*args)
        try:
            outcome = await response
        except (asyncio.CancelledError, RequestCancelledError, TaskCancelledError):
            response.cancel()
            raise
        except RETRIABLE as exc:
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
