"""Chunk summaries kept across compactions: a chunk whose prompt is unchanged is not summarised again.

An agent's history grows at its end, so the next compaction of a session sees the same tokens
up to where the last one stopped. With the prefix-exact layout, the prompt of a chunk is the
history up to the chunk's end plus a tail that depends only on the options, so if the history
is unchanged up to that end, the prompt is the same and so is its summary.

Two lookups, both keyed by a scope (the options that shape a summary):
- `borders`: from the start of the compactable span, the chain of chunks summarised before
  whose history prefix is unchanged. Planning keeps those borders, so the old chunks reappear
  exactly and only the new material is partitioned afresh.
- `get`: the summary of one chunk, only if its prompt is token-for-token the one cached (a
  different layout, window or tail is a miss).

Bounded (least recently used entries go first); losing an entry costs one chunk summary.
Single-threaded: one per model, used from one event loop.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from compaction.options import CompactionOptions
from compaction.partition import Chunk
from compaction.result import ChunkStats

# Options that do not change a chunk's summary once its prompt is fixed.
_UNSCOPED = frozenset({"keep_recent_tokens", "carry_summary_tokens", "reuse_chunks"})


def digest(token_ids: Sequence[int]) -> str:
    """A short, collision-resistant name for a token sequence."""
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


_Key = tuple[str, str, int, str]  # (scope, digest of history[:start], end, digest of history[:end])


class ChunkCache:
    """A bounded map from (options, history prefix, chunk) to the chunk's kept summary."""

    def __init__(self, max_entries: int = 4096) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[_Key, CachedChunk] = OrderedDict()
        self._from: dict[tuple[str, str], set[_Key]] = {}  # (scope, digest of history[:start]) -> keys

    def __len__(self) -> int:
        return len(self._entries)

    def borders(self, ids: Sequence[int], start: int, end: int, scope: str) -> list[int]:
        """Ends of the chain of cached chunks that tiles [start, some border <= end) of this history."""
        chain: list[int] = []
        at = start
        while at < end:
            head = digest(ids[:at])
            ends = sorted({k[2] for k in self._from.get((scope, head), ()) if at < k[2] <= end}, reverse=True)
            found = next((e for e in ends if (scope, head, e, digest(ids[:e])) in self._entries), None)
            if found is None:
                break
            chain.append(found)
            at = found
        return chain

    def get(self, scope: str, ids: Sequence[int], chunk: Chunk, prompt: Sequence[int]) -> CachedChunk | None:
        key = (scope, digest(ids[: chunk.start]), chunk.end, digest(ids[: chunk.end]))
        entry = self._entries.get(key)
        if entry is None or entry.prompt != digest(prompt):
            return None
        self._entries.move_to_end(key)
        return entry

    def put(
        self, scope: str, ids: Sequence[int], chunk: Chunk, prompt: Sequence[int], text: str, stats: ChunkStats
    ) -> None:
        start = digest(ids[: chunk.start])
        key = (scope, start, chunk.end, digest(ids[: chunk.end]))
        self._entries[key] = CachedChunk(text, stats, digest(prompt))
        self._entries.move_to_end(key)
        self._from.setdefault((scope, start), set()).add(key)
        while len(self._entries) > self.max_entries:
            old, _ = self._entries.popitem(last=False)
            keys = self._from.get((old[0], old[1]))
            if keys is not None:
                keys.discard(old)
                if not keys:
                    del self._from[(old[0], old[1])]
