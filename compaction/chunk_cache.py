"""Chunk summaries kept across compactions: a chunk whose prompt is unchanged is not summarised again.

An agent's history grows at its end, so the next compaction of a session sees the same tokens
up to where the last one stopped. With the prefix-exact layout, the prompt of a chunk is the
history up to the chunk's end plus a tail that depends only on the options, so if the history
is unchanged up to that end, the prompt is the same and so is its summary.

Two lookups, both keyed by a scope (the options that shape a summary):
- `borders`: from the start of the compactable span, the chain of chunks summarised before
  whose history prefix is unchanged. Planning keeps those borders, so the old chunks reappear
  exactly and only the new material is partitioned afresh. A chunk put as `last` (a rolling run's
  guess at the span the next compaction ends with) is a border only where that span ends: never
  one that cuts a longer span differently from a plan made without it.
- `get`: the summary of one chunk, only if its prompt is token-for-token the one cached (a
  different layout, window or tail is a miss).

Prefix digests are carried incrementally (`compaction.views.PrefixDigests`, kept for the last few
histories seen), so the lookups of a compaction hash its history once, not once per chunk border;
a prompt given as a `TokenView` is digested from its history prefix's state the same way.

Bounded in entries and in bytes (`max_bytes`: each entry's summary and stats, as `entry_bytes` counts
them; least recently used entries go first); losing an entry costs one chunk summary. One per
model; a lock makes it safe to plan in a worker thread while the event loop stores summaries.
"""

from __future__ import annotations

import hashlib
import json
import threading
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from compaction.bounded import BoundedLRU
from compaction.options import CompactionOptions
from compaction.partition import Chunk
from compaction.result import ChunkStats
from compaction.views import PrefixDigests, TokenView

# Options that do not change a chunk's summary once its prompt is fixed (they only move the span's ends).
# Options that move the span's ends or add to the head, never a chunk's summary.
_UNSCOPED = frozenset(
    {"keep_recent_tokens", "keep_current_turn", "carry_summary_tokens", "reuse_chunks", "clearing", "ledger_tokens"}
)


def digest(token_ids: Sequence[int]) -> str:
    """A short, collision-resistant name for a token sequence."""
    if isinstance(token_ids, TokenView):
        return token_ids.digest()
    return hashlib.blake2b(array("I", token_ids).tobytes(), digest_size=16).hexdigest()


def scope_of(options: CompactionOptions, namespace: str = "") -> str:
    """The options that shape a chunk summary (budget, sampling, checks, layout, variant...), as a key; a
    namespace (the tenant) keeps one caller's summaries from ever serving another."""
    shaping = {**options.model_dump(exclude=set(_UNSCOPED)), "namespace": namespace}
    return hashlib.blake2b(json.dumps(shaping, sort_keys=True).encode(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class CachedChunk:
    """A chunk summary as it was kept, and how it was made."""

    text: str  # the summary spliced into the compacted history (after every check and fallback)
    stats: ChunkStats  # the original run's figures; a reuse reports none of its work
    prompt: str  # digest of the exact prompt; a reuse needs the same prompt
    last: bool = False  # a plan's last chunk, summarised ahead of it: reused only as the last chunk of a span


_Key = tuple[str, str, int, str]  # (scope, digest of history[:start], end, digest of history[:end])
ENTRY_OVERHEAD_BYTES = 1024  # key, digests, dict slots and the stats object of one entry, beside its texts
DEFAULT_MAX_BYTES = 64 * 2**20


def entry_bytes(entry: CachedChunk) -> int:
    """What one entry holds, about: its summary, the texts in its stats, and a fixed overhead."""
    lists = (getattr(entry.stats, name, None) or () for name in ("first_ungrounded", "ungrounded"))
    texts = sum(len(t) for texts in lists for t in texts)
    return ENTRY_OVERHEAD_BYTES + len(entry.text.encode()) + texts


class ChunkCache:
    """A bounded map from (options, history prefix, chunk) to the chunk's kept summary."""

    def __init__(self, max_entries: int = 4096, histories: int = 2, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        size = lambda key, entry: entry_bytes(entry)  # noqa: E731
        self._entries: BoundedLRU[_Key, CachedChunk] = BoundedLRU(max_entries, max_bytes, size, self._forget)
        self._from: dict[tuple[str, str], set[_Key]] = {}  # (scope, digest of history[:start]) -> keys
        self._prefixes: BoundedLRU[int, PrefixDigests] = BoundedLRU(histories)  # id(history) -> its prefix digests
        self._lock = threading.Lock()

    @property
    def bytes(self) -> int:
        """entry_bytes summed over the entries."""
        return self._entries.bytes

    def __len__(self) -> int:
        return len(self._entries)

    def _prefix(self, ids: Sequence[int], end: int) -> str:
        """digest(ids[:end]), from the nearest prefix of the same history hashed before."""
        prefixes = self._prefixes.get(id(ids))
        if prefixes is None or prefixes.ids is not ids:
            prefixes = PrefixDigests(ids)
            self._prefixes.put(id(ids), prefixes)
        return prefixes.digest(end)

    def borders(self, ids: Sequence[int], start: int, end: int, scope: str) -> list[int]:
        """Ends of the chain of cached chunks that tiles [start, some border <= end) of this history."""
        chain: list[int] = []
        at = start
        with self._lock:
            while at < end:
                head = self._prefix(ids, at)
                ends = sorted({k[2] for k in self._from.get((scope, head), ()) if at < k[2] <= end}, reverse=True)
                found = next((e for e in ends if self._border(scope, head, e, ids, end)), None)
                if found is None:
                    break
                chain.append(found)
                at = found
        return chain

    def _border(self, scope: str, head: str, at: int, ids: Sequence[int], end: int) -> bool:
        entry = self._entries.peek((scope, head, at, self._prefix(ids, at)))
        return entry is not None and (not entry.last or at == end)

    def key(self, scope: str, ids: Sequence[int], chunk: Chunk, prompt: Sequence[int]) -> tuple[str, ...]:
        """The identity of one chunk prompt: what `get` would find it under, and the prompt's own digest."""
        with self._lock:
            return (scope, self._prefix(ids, chunk.start), str(chunk.end), self._prefix(ids, chunk.end), digest(prompt))

    def get(self, scope: str, ids: Sequence[int], chunk: Chunk, prompt: Sequence[int]) -> CachedChunk | None:
        with self._lock:
            key = (scope, self._prefix(ids, chunk.start), chunk.end, self._prefix(ids, chunk.end))
            entry = self._entries.peek(key)
            if entry is None or entry.prompt != digest(prompt):
                return None
            return self._entries.get(key)

    def put(
        self,
        scope: str,
        ids: Sequence[int],
        chunk: Chunk,
        prompt: Sequence[int],
        text: str,
        stats: ChunkStats,
        last: bool = False,
    ) -> None:
        with self._lock:
            start = self._prefix(ids, chunk.start)
            key = (scope, start, chunk.end, self._prefix(ids, chunk.end))
            self._from.setdefault((scope, start), set()).add(key)
            self._entries.put(key, CachedChunk(text, stats, digest(prompt), last))

    def _forget(self, key: _Key, entry: CachedChunk) -> None:
        """An evicted entry leaves the index of chunks by their start."""
        keys = self._from.get((key[0], key[1]))
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._from[(key[0], key[1])]
