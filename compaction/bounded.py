"""The one bounded map: caches and per-session tables keep their most recently used entries within a count and
a byte budget, and say what they drop (so an evicted background run can be cancelled). Safe to share between
threads (a turn's prompt is counted off the event loop)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class BoundedLRU(Generic[K, V]):
    """At most `max_entries` entries and `max_bytes` bytes as `size(key, value)` counts them; the least recently
    used go first (one entry always stays, however large). `on_evict(key, value)` hears of each one dropped."""

    def __init__(
        self,
        max_entries: int,
        max_bytes: int | None = None,
        size: Callable[[K, V], int] | None = None,
        on_evict: Callable[[K, V], None] | None = None,
    ) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._size = size or (lambda key, value: 0)
        self._on_evict = on_evict
        self._entries: OrderedDict[K, V] = OrderedDict()
        self._sizes: dict[K, int] = {}
        self.bytes = 0  # the entries' sizes, as last measured
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[K]:
        return iter(self._entries)

    def values(self) -> Iterator[V]:
        return iter(self._entries.values())

    def items(self) -> Iterator[tuple[K, V]]:
        return iter(self._entries.items())

    def get(self, key: K) -> V | None:
        """The entry (now the most recently used), or None."""
        with self._lock:
            if key not in self._entries:
                return None
            self._entries.move_to_end(key)
            return self._entries[key]

    def peek(self, key: K) -> V | None:
        """The entry, its place in the order unchanged."""
        return self._entries.get(key)

    def put(self, key: K, value: V) -> None:
        """Keep `value` as the most recently used entry, then drop the least recently used past the bounds."""
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            self.remeasure(key)

    def remeasure(self, key: K) -> None:
        """Count an entry's size again (its value changed in place), then drop entries past the bounds."""
        with self._lock:
            if key in self._entries:
                size = self._size(key, self._entries[key])
                self.bytes += size - self._sizes.get(key, 0)
                self._sizes[key] = size
            self._shrink()

    def pop(self, key: K) -> V | None:
        """Remove an entry without calling on_evict; None if absent."""
        with self._lock:
            self.bytes -= self._sizes.pop(key, 0)
            return self._entries.pop(key, None)

    def pop_oldest(self) -> tuple[K, V]:
        """Drop the least recently used entry (on_evict is called)."""
        with self._lock:
            key, value = self._entries.popitem(last=False)
            self.bytes -= self._sizes.pop(key, 0)
        if self._on_evict is not None:
            self._on_evict(key, value)
        return key, value

    def _shrink(self) -> None:
        over_bytes = lambda: self.max_bytes is not None and self.bytes > self.max_bytes  # noqa: E731
        while len(self._entries) > 1 and (len(self._entries) > self.max_entries or over_bytes()):
            self.pop_oldest()
        if len(self._entries) > self.max_entries:  # a bound of 0 keeps nothing
            self.pop_oldest()
