"""One replica's KV memory: running requests' blocks plus a prefix cache of history chains, evicted LRU.

vLLM caches full blocks keyed by their whole prefix. Our prompts are histories that only grow (an agent's rendered
history, a compaction prompt that starts with a prefix of it), so the cache is modelled per *chain*: a history
(`namespace`, e.g. one session between two compactions) and how many of its leading tokens are cached, in whole
blocks. A prompt reuses min(cached, its history prefix, its length - 1) rounded down to a block, as vLLM does.
Blocks of a running request are pinned; when memory runs short the least recently used unpinned chain loses its tail.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable


def blocks(tokens: int, block: int) -> int:
    """Tokens rounded up to whole blocks."""
    return -(-tokens // block) * block


class PrefixCache:
    """Token-granular accounting in whole blocks: `capacity` tokens of KV for running requests and cached chains."""

    def __init__(self, capacity: int, block: int) -> None:
        self.capacity = capacity
        self.block = block
        self.chains: OrderedDict[Hashable, int] = OrderedDict()  # namespace -> cached tokens, least recent first
        self.pins: dict[Hashable, int] = {}  # namespace -> running requests reading it
        self.cached = 0  # tokens held by chains
        self.allocated = 0  # tokens held by running requests beyond what they read from chains
        self.evicted = 0  # tokens evicted so far

    def lookup(self, namespace: Hashable | None, history_prefix: int, prompt: int) -> int:
        """Prompt tokens a request can read from the cache (whole blocks, never its last token)."""
        if namespace is None or namespace not in self.chains:
            return 0
        usable = min(self.chains[namespace], history_prefix, prompt - 1)
        return max(0, usable) // self.block * self.block

    def reserve(self, namespace: Hashable | None, tokens: int) -> int:
        """Hold `tokens` new tokens (in whole blocks, returned) for a request reading `namespace`.

        Evicts least recently used chains if needed; 0 when there is no room even then.
        """
        need = blocks(tokens, self.block)
        if namespace is not None:
            self.pins[namespace] = self.pins.get(namespace, 0) + 1
        if not self._make_room(need):
            self._unpin(namespace)
            return 0
        self.allocated += need
        if namespace is not None and namespace in self.chains:
            self.chains.move_to_end(namespace)
        return need

    def extend(self, namespace: Hashable | None, extent: int, owned: int) -> int:
        """A request's history part up to `extent` tokens is computed: cache its full blocks.

        The new chain blocks come out of the `owned` tokens the request reserved; returns how many moved.
        """
        if namespace is None:
            return 0
        full = extent // self.block * self.block
        have = self.chains.get(namespace, 0)
        moved = 0
        if full > have:
            moved = min(full - have, owned)
            self.allocated -= moved  # those blocks change owner: from the request to the chain
            self.cached += moved
            self.chains[namespace] = have + moved
        if namespace in self.chains:
            self.chains.move_to_end(namespace)
        return moved

    def release(self, namespace: Hashable | None, tokens: int) -> None:
        """A request finished: free the `tokens` it still holds beyond the chain."""
        self.allocated -= tokens
        self._unpin(namespace)

    def drop(self, namespace: Hashable) -> None:
        """A history that will never be sent again (its session compacted): its blocks are free to evict first."""
        if namespace in self.chains and not self.pins.get(namespace):
            self.chains.move_to_end(namespace, last=False)

    def _unpin(self, namespace: Hashable | None) -> None:
        if namespace is None:
            return
        left = self.pins.get(namespace, 0) - 1
        if left > 0:
            self.pins[namespace] = left
        else:
            self.pins.pop(namespace, None)

    def _make_room(self, need: int) -> bool:
        free = self.capacity - self.cached - self.allocated
        if free >= need:
            return True
        cuts: list[tuple[Hashable, int]] = []
        for namespace, size in self.chains.items():  # least recently used first
            if self.pins.get(namespace):
                continue
            kept = max(0, size - blocks(need - free, self.block))
            cuts.append((namespace, kept))
            free += size - kept
            if free >= need:
                break
        for namespace, kept in cuts:
            freed = self.chains[namespace] - kept
            self.cached -= freed
            self.evicted += freed
            if kept:
                self.chains[namespace] = kept
            else:
                del self.chains[namespace]
        return free >= need
