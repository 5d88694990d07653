"""What every job shares: its own progress lines, a text table, the CPU default model's name, and the local
service started with its replicas and a way to empty their prefix caches (each measured run starts cold)."""

from __future__ import annotations

import random
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from serving.models import DEFAULT_MODEL

if TYPE_CHECKING:
    from serving.local import LocalService

MODEL = DEFAULT_MODEL


def sayer(name: str, clock: bool = False) -> Callable[[str], None]:
    """A job's progress printer: `[name] message` on stderr (`clock`: with the time of day)."""

    def say(message: str) -> None:
        stamp = f" {time.strftime('%H:%M:%S')}" if clock else ""
        print(f"[{name}{stamp}] {message}", file=sys.stderr, flush=True)

    return say


def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """A plain fixed-width text table."""
    cells = [[f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


# Above Ray's worker ports (10002-19999) and below Linux's ephemeral range (32768-60999), where Ray's own servers
# and every outgoing connection get theirs: a port found free here stays free while a Ray cluster starts before the
# service binds it.
SERVICE_PORTS = range(20000, 32768)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now, from SERVICE_PORTS (a random start, so parallel callers differ)."""
    start = random.randrange(len(SERVICE_PORTS))
    for i in range(len(SERVICE_PORTS)):
        port = SERVICE_PORTS[(start + i) % len(SERVICE_PORTS)]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port on 127.0.0.1 in {SERVICE_PORTS.start}-{SERVICE_PORTS.stop - 1}")


def replicas(count: int, model: str = MODEL) -> dict[str, Any]:
    """The service args that run exactly `count` replicas of `model`."""
    return {"replicas": {model: {"min": count, "max": count, "initial": count}}}


@dataclass(frozen=True)
class CacheReset:
    """Empties the prefix cache of every replica of a model, through the coordinator (a run starts cold)."""

    coordinator: Any  # the Coordinator deployment's handle
    model: str = MODEL

    def __call__(self) -> None:
        self.coordinator.reset_prefix_cache.remote(self.model).result()

    async def cold(self) -> None:
        """The same from inside an event loop."""
        await self.coordinator.reset_prefix_cache.remote(self.model)


async def mcp_calls(url: str, key: str | None, *calls: tuple[str, dict[str, Any]]) -> tuple[set[str], list[Any]]:
    """The tools the service's /mcp lists for `key`, and each call's result, through the official MCP client."""
    import httpx2
    from mcp.client.session import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with (
        httpx2.AsyncClient(headers=headers, timeout=60) as http,
        streamable_http_client(f"{url}/mcp", http_client=http) as streams,
        ClientSession(streams[0], streams[1]) as session,
    ):
        await session.initialize()
        tools = {tool.name for tool in (await session.list_tools()).tools}
        return tools, [await session.call_tool(name, arguments) for name, arguments in calls]


@contextmanager
def local_service(port: int, args: dict[str, Any], quiet: bool = True) -> Iterator[tuple[LocalService, CacheReset]]:
    """The service on this machine (stopped on exit) and its cache reset."""
    from ray import serve

    from serving.local import APP_NAME, LocalService

    with LocalService(port, args, quiet=quiet) as service:
        yield service, CacheReset(serve.get_deployment_handle("Coordinator", app_name=APP_NAME))
