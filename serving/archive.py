"""The archive: what compactions summarised, kept verbatim per tenant, recalled by handle or found by words.

Files through pyarrow's filesystems: a local folder by default (one machine: the coordinators write and the
ingress reads the same disk), `s3://…` or `gs://…` for a cluster. One JSON file per chunk, at
`<root>/<tenant digest>/<handle>.json`: a tenant's handles live under its own folder, so another tenant's
handle is simply not found there. Past `max_bytes` the oldest files go, and files older than
`retention_days` go, when the archive is next written (at most once a minute per process: between two such
passes the archive may pass its budget by a minute's writes).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import pyarrow.fs as pafs
from pydantic import BaseModel, ConfigDict, Field

from compaction.archive import HANDLE, ArchivedChunk, without_markers
from compaction.history import Message
from compaction.result import CompactionResult

logger = logging.getLogger(__name__)
SNIPPET_CHARS = 240
TRIM_EVERY_S = 60.0  # the retention and byte-budget pass lists the whole archive: at most once a minute per process


class ArchiveConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    uri: str = Field(
        "", description="Where chunks are kept: a folder, s3://bucket/prefix or gs://bucket/prefix. Empty: "
        "$COMPACTION_CACHE/archive (else ~/.cache/parallel-compaction/archive) on the service's node."
    )  # fmt: skip
    retention_days: float = Field(30.0, gt=0, le=3650, description="Chunks older than this are deleted.")
    max_bytes: int = Field(1 << 30, ge=1 << 20, le=1 << 50, description="Past this, the oldest chunks go first.")


class Kept(BaseModel):
    """One archived chunk as stored."""

    handle: str
    session: str | None
    chunk: int
    tokens: int
    text: str
    stored_at: float


class Hit(BaseModel):
    handle: str
    session: str | None
    score: int = Field(description="How many of the query's words the chunk holds.")
    snippet: str = Field(description="The chunk's text around the first word found.")


class Archive:
    def __init__(self, config: ArchiveConfig) -> None:
        from serving.weights import cache_dir

        self.config = config
        self.fs, self.root = pafs.FileSystem.from_uri(config.uri or str(cache_dir() / "archive"))
        self._trimmed_at = float("-inf")
        if isinstance(self.fs, pafs.LocalFileSystem):
            Path(self.root).mkdir(parents=True, exist_ok=True)

    def _folder(self, tenant: str) -> str:
        return f"{self.root}/{hashlib.sha256(tenant.encode()).hexdigest()[:32]}"

    def put(self, tenant: str, session: str | None, chunks: Sequence[ArchivedChunk]) -> None:
        """Store `chunks` under `tenant` (a handle already there is kept as it is); raises OSError when it cannot."""
        folder = self._folder(tenant)
        self.fs.create_dir(folder, recursive=True)
        now = time.time()
        for chunk in chunks:
            kept = Kept(session=session, stored_at=now, **chunk.model_dump())
            with self.fs.open_output_stream(f"{folder}/{chunk.handle}.json") as out:
                out.write(kept.model_dump_json().encode())
        if now - self._trimmed_at >= TRIM_EVERY_S:
            self._trimmed_at = now
            self._trim(now)

    def recall(self, tenant: str, handle: str) -> Kept | None:
        """The chunk `handle` names among `tenant`'s, or None."""
        if not HANDLE.match(handle):
            return None
        try:
            with self.fs.open_input_stream(f"{self._folder(tenant)}/{handle}.json") as source:
                return Kept.model_validate_json(source.read())
        except (OSError, ValueError):  # missing, unreadable, or not a chunk this service wrote
            return None

    def search(self, tenant: str, query: str, session: str | None = None, limit: int = 5) -> list[Hit]:
        """`tenant`'s chunks holding most of the query's words (case-insensitive), of one session if named."""
        words = {w for w in query.lower().split() if w}
        hits: list[Hit] = []
        for info in self._files(self._folder(tenant)):
            kept = self.recall(tenant, Path(info.path).stem)
            if kept is None or (session is not None and kept.session != session):
                continue
            lowered = kept.text.lower()
            score = sum(w in lowered for w in words)
            if score:
                at = min(lowered.find(w) for w in words if w in lowered)
                snippet = kept.text[max(0, at - SNIPPET_CHARS // 4) :][:SNIPPET_CHARS]
                hits.append(Hit(handle=kept.handle, session=kept.session, score=score, snippet=snippet))
        return sorted(hits, key=lambda h: -h.score)[:limit]

    def _files(self, folder: str) -> list[pafs.FileInfo]:
        selector = pafs.FileSelector(folder, allow_not_found=True, recursive=False)
        return [i for i in self.fs.get_file_info(selector) if i.type == pafs.FileType.File]

    def _trim(self, now: float) -> None:
        """Chunks past the retention period go, then the oldest until the archive fits max_bytes."""
        files = sorted(self._files_everywhere(), key=lambda i: i.mtime_ns or 0)
        expired = now - self.config.retention_days * 86_400
        total = sum(i.size or 0 for i in files)
        for info in files:
            if (info.mtime_ns or 0) / 1e9 >= expired and total <= self.config.max_bytes:
                break
            with contextlib.suppress(FileNotFoundError):  # another process's pass took it first
                self.fs.delete_file(info.path)
            total -= info.size or 0

    def _files_everywhere(self) -> list[pafs.FileInfo]:
        selector = pafs.FileSelector(self.root, allow_not_found=True, recursive=True)
        return [i for i in self.fs.get_file_info(selector) if i.type == pafs.FileType.File]


def stored(archive: Archive | None, tenant: str, session: str | None, chunks: Sequence[ArchivedChunk]) -> str | None:
    """Store a compaction's chunks; None when stored, else why not (the compaction answers without handles)."""
    if archive is None:
        return "this service keeps no archive (AppArgs.archive)"
    try:
        archive.put(tenant, session, chunks)
    except OSError as exc:
        logger.warning("the archive could not store %d chunks: %r", len(chunks), exc)
        return "the archive could not store the chunks (full or unreachable); the summary carries no handles"
    return None


def without_handles(result: CompactionResult, note: str) -> CompactionResult:
    """`result` as if it had not been archived: no handle in its summary, `note` saying why."""
    at, end = result.kept_head, result.head_messages  # the summary message, then the turns cleared
    stats = result.stats.model_copy(update={"archived_handles": [], "archive_note": note})
    unmarked = [Message.model_validate_json(without_markers(m.model_dump_json())) for m in result.messages[at:end]]
    messages = [*result.messages[:at], *unmarked, *result.messages[end:]]
    return result.model_copy(update={"messages": messages, "summary": without_markers(result.summary), "stats": stats})
