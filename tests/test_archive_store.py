"""The archive store (serving.archive) on a local folder and the MCP server over it (serving.recall), in process:
per-tenant recall and search, retention and the byte budget, a store that cannot write."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from compaction.archive import MARKER, ArchivedChunk, handle_of
from compaction.tokenizer import HFChatTokenizer
from serving import archive as archive_module
from serving.archive import Archive, ArchiveConfig, stored
from serving.tenants import DEFAULT_TENANT


def chunk(text: str, index: int = 0) -> ArchivedChunk:
    return ArchivedChunk(handle=handle_of(text), chunk=index, tokens=len(text.split()), text=text)


ERROR = chunk("<|im_start|>tool\npytest: FAILED tests/test_io.py::test_flush - OSError: disk quota exceeded", 0)
PLAN = chunk("<|im_start|>assistant\nNext: move the writer to /var/tmp and rerun the io tests.", 1)


def test_a_tenant_recalls_and_finds_its_own_chunks_only(tmp_path: Path) -> None:
    archive = Archive(ArchiveConfig(uri=str(tmp_path)))
    archive.put("team-a", "s1", [ERROR, PLAN])
    kept = archive.recall("team-a", ERROR.handle)
    assert kept is not None and kept.text == ERROR.text and kept.session == "s1" and kept.chunk == 0
    assert archive.recall("team-b", ERROR.handle) is None  # another tenant's handle: not found, as a missing one
    assert archive.recall("team-a", "arc-" + "0" * 24) is None and archive.recall("team-a", "../../etc") is None
    hits = archive.search("team-a", "disk quota OSError")
    assert [h.handle for h in hits] == [ERROR.handle] and hits[0].score == 3 and "disk quota" in hits[0].snippet
    assert [h.handle for h in archive.search("team-a", "rerun writer")] == [PLAN.handle]
    assert archive.search("team-a", "rerun writer", session="s2") == []
    assert archive.search("team-b", "disk quota") == []
    (tmp_path / archive._folder("team-a").rsplit("/", 1)[1] / f"{PLAN.handle}.json").write_text("{not json")
    assert archive.recall("team-a", PLAN.handle) is None  # a damaged file reads as missing
    assert archive.search("team-a", "rerun writer") == []


def test_expired_chunks_and_those_past_the_byte_budget_go_oldest_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(archive_module, "TRIM_EVERY_S", 0.0)  # a pass at every write
    archive = Archive(ArchiveConfig(uri=str(tmp_path), retention_days=1, max_bytes=1 << 20))
    archive.put("t", "s1", [ERROR])
    old = next(tmp_path.rglob(f"{ERROR.handle}.json"))
    two_days_ago = time.time() - 2 * 86_400
    os.utime(old, (two_days_ago, two_days_ago))
    archive.put("t", "s1", [PLAN])
    assert archive.recall("t", ERROR.handle) is None and archive.recall("t", PLAN.handle) is not None
    big = [chunk(f"{i} " + "x" * 300_000, i) for i in range(5)]  # about 1.5 MiB: over the 1 MiB budget
    archive.put("t", "s2", big)
    assert archive.recall("t", PLAN.handle) is None and archive.recall("t", big[-1].handle) is not None
    assert sum(f.stat().st_size for f in tmp_path.rglob("*.json")) <= 1 << 20


def test_a_store_that_cannot_write_says_so_and_raises_nothing(tmp_path: Path) -> None:
    archive = Archive(ArchiveConfig(uri=str(tmp_path)))
    (tmp_path / archive._folder("t").rsplit("/", 1)[1]).write_text("a file where the tenant's folder goes")
    note = stored(archive, "t", "s1", [ERROR])
    assert note is not None and "could not store" in note
    assert stored(None, "t", "s1", [ERROR]) is not None
    assert stored(archive, "other", "s1", [ERROR]) is None


async def test_the_mcp_server_lists_its_tools_and_recalls_by_handle(tmp_path: Path) -> None:
    from mcp.client.client import Client

    from serving.recall import archive_server

    archive = Archive(ArchiveConfig(uri=str(tmp_path)))
    archive.put("", "s1", [ERROR, PLAN])  # the in-memory transport carries no HTTP request: the anonymous tenant
    async with Client(archive_server(archive)) as client:
        tools = {tool.name for tool in (await client.list_tools()).tools}
        assert tools == {"recall", "search_history"}
        recalled = await client.call_tool("recall", {"handle": PLAN.handle})
        assert recalled.content[0].text == PLAN.text
        missing = await client.call_tool("recall", {"handle": "arc-" + "1" * 24})
        assert missing.is_error and "was not found" in missing.content[0].text
        found = await client.call_tool("search_history", {"query": "writer rerun"})
        assert PLAN.handle in found.content[0].text


async def test_the_coordinator_stores_a_compactions_chunks_or_answers_without_handles(
    tmp_path: Path, tokenizer: HFChatTokenizer
) -> None:
    from tests.test_coordinator import FakeReplicas, coordinator, history, job

    service = coordinator(tokenizer, FakeReplicas())
    service.archive = Archive(ArchiveConfig(uri=str(tmp_path / "ok")))
    result = await service.compact(job(history(), archive=True))
    handles = result.stats.archived_handles
    assert len(handles) == result.stats.chunks > 1 and result.stats.archive_note is None
    assert all(f"[archived: {h}]" in result.summary for h in handles)
    assert all(service.archive.recall(DEFAULT_TENANT, h) is not None for h in handles)

    service.archive = Archive(ArchiveConfig(uri=str(tmp_path / "blocked")))
    (tmp_path / "blocked" / service.archive._folder(DEFAULT_TENANT).rsplit("/", 1)[1]).write_text("not a folder")
    unstored = await service.compact(job(history(), archive=True, session="s2"))
    assert unstored.stats.archived_handles == [] and "could not store" in (unstored.stats.archive_note or "")
    assert not MARKER.search(unstored.summary) and not MARKER.search(str(unstored.messages[unstored.kept_head].content))
