"""A turn's reply on its way to its session's coordinator, where a rolling session's follow-up run summarises it
(serving.background). The hand-on is a head start on the next turn's compaction, never an error of the turn's,
and the session's next turn waits for it a little (REPLY_WAIT_S) so that it finds the reply there."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

logger = logging.getLogger(__name__)
REPLY_WAIT_S = 2.0  # the most a turn waits for its session's previous reply to reach the coordinator


class HandOn:
    """Replies sent in the background by `send(session, *args)`, the last one of each session kept in sight."""

    def __init__(self, send: Callable[..., Awaitable[Any]]) -> None:
        self._send = send
        self._pending: dict[str, asyncio.Task[Any]] = {}

    def __call__(self, session: str, *args: Any) -> None:
        task = asyncio.ensure_future(self._send(session, *args))
        self._pending[session] = task
        task.add_done_callback(_logged)

        def ended(_: asyncio.Task[Any]) -> None:
            if self._pending.get(session) is task:
                del self._pending[session]

        task.add_done_callback(ended)

    async def handed(self, session: str | None) -> None:
        """Once the session's last reply is with its coordinator (a few milliseconds), or after REPLY_WAIT_S."""
        pending = self._pending.get(session) if session else None
        if pending is not None:
            await asyncio.wait({pending}, timeout=REPLY_WAIT_S)


def _logged(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.debug("a reply was not handed to its coordinator: %r", task.exception())
