"""The MCP endpoint (`/mcp` on the service, streamable HTTP): agents recall what compaction summarised.

Two tools over the caller's tenant's archive (`serving.archive`, the tenant named by its API key as on every
route): `recall(handle)`, the verbatim text a summary's `[archived: arc-…]` stands for, and
`search_history(query, session?)`, the handles of the chunks holding most of the query's words. A handle of
another tenant is not found, as one that never existed. The endpoint is stateless and answers in JSON: any
ingress replica can take any call. Codex (`mcp_servers` in its config) and Claude Code (`claude mcp add
--transport http`) connect to it as they are.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from starlette.types import Receive, Scope, Send

from serving.archive import Archive, ArchiveConfig, Hit
from serving.metrics import record_recall
from serving.ray_adapter import http_host
from serving.tenants import tenant_of


class _Counted(MCPServer):
    async def list_tools(self) -> Any:
        record_recall("tools/list")
        return await super().list_tools()


def archive_server(archive: Archive) -> MCPServer:
    server = _Counted("compaction-archive", instructions="Recall what context compaction summarised, verbatim.")

    def tenant(ctx: Context) -> str:
        request = ctx.request_context.request
        return tenant_of(request).id if request is not None else ""

    @server.tool()
    async def recall(handle: str, ctx: Context) -> str:
        """The verbatim text that a compaction summary's [archived: arc-…] handle stands for."""
        record_recall("recall")
        kept = await asyncio.to_thread(archive.recall, tenant(ctx), handle.strip())
        if kept is None:
            raise ToolError(f"handle: {handle!r} was not found in this archive")
        return kept.text

    @server.tool()
    async def search_history(query: str, ctx: Context, session: str | None = None, limit: int = 5) -> list[Hit]:
        """Archived chunks holding most of the query's words (of one session if given): handles and snippets."""
        record_recall("search_history")
        if not query.strip():
            raise ToolError("query: send at least one word")
        return await asyncio.to_thread(archive.search, tenant(ctx), query, session, max(1, min(limit, 50)))

    return server


class RecallEndpoint:
    """The ASGI app at /mcp: its MCP server and session manager start with its first call, in the ingress."""

    def __init__(self, config: ArchiveConfig) -> None:
        self.config = config
        self._manager: Any = None
        self._started: asyncio.Future[None] | None = None
        self._runner: asyncio.Task[None] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._started is None:
            self._started = asyncio.get_running_loop().create_future()
            self._runner = asyncio.create_task(self._run())
        await asyncio.shield(self._started)
        await self._manager.handle_request(scope, receive, send)

    async def _run(self) -> None:
        assert self._started is not None
        try:
            server = archive_server(await asyncio.to_thread(Archive, self.config))
            # On loopback, MCP's DNS-rebinding protection (Host and Origin checked); elsewhere every call has a key.
            host = await asyncio.to_thread(http_host) or "0.0.0.0"
            server.streamable_http_app(stateless_http=True, json_response=True, host=host)
            self._manager = server.session_manager
            async with self._manager.run():
                self._started.set_result(None)
                await asyncio.Event().wait()  # as long as the ingress lives
        except Exception as exc:
            with contextlib.suppress(asyncio.InvalidStateError):
                self._started.set_exception(exc)
            raise
