"""Token sequences as views over the one rendered history, and their digests carried incrementally.

Planning a compaction of N chunks over a history of H tokens lays out 2N prompts whose bodies are
mostly slices of the history (prefix_exact: body k = history[0:end_k]). As copies they hold about
N·H token ids; as views they hold a few ranges each, so planning grows with N + H. A view is
materialised (a tuple) only when its prompt is sent.

- `TokenView`: ranges of one source tuple and short literal runs (markers, tails), optionally after
  another view (`head`), so a layout whose body k extends body k-1 (prefix_exact_marked) shares it.
- `PrefixDigests`: the digest of history[:p] for any p, each from the nearest position hashed before
  (a blake2b state copied per position), so the digests of every chunk border cost one pass over the
  history instead of one pass per border. A view's digest starts from there, or from its head's.

Digests equal `digest(tuple(view))` of `compaction.chunk_cache`: the same bytes, fed in parts.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
from array import array
from collections.abc import Iterator, Sequence
from typing import Any, overload

DIGEST_SIZE = 16
Piece = range | tuple[int, ...]  # a range of the source's positions, or literal token ids


def _bytes(ids: Sequence[int]) -> bytes:
    return array("I", ids).tobytes()


class PrefixDigests:
    """Digests of the prefixes of one token sequence, computed incrementally and kept per position."""

    def __init__(self, ids: Sequence[int]) -> None:
        self.ids = ids
        self._positions = [0]
        self._states = [hashlib.blake2b(digest_size=DIGEST_SIZE)]

    def state(self, end: int) -> Any:
        """A fresh blake2b state holding ids[:end] (the caller may update it)."""
        if not 0 <= end <= len(self.ids):
            raise IndexError(f"prefix end {end} outside 0..{len(self.ids)}")
        i = bisect.bisect_right(self._positions, end) - 1
        at, state = self._positions[i], self._states[i]
        if at != end:
            state = state.copy()
            state.update(_bytes(self.ids[at:end]))
            self._positions.insert(i + 1, end)
            self._states.insert(i + 1, state)
        return state.copy()

    def digest(self, end: int) -> str:
        """The digest of ids[:end]."""
        return str(self.state(end).hexdigest())


class TokenView(Sequence[int]):
    """Token ids as `head` (another view, or nothing) followed by pieces of `source` and literal runs."""

    __slots__ = ("_len", "_state", "head", "pieces", "prefixes", "source")

    def __init__(
        self,
        source: tuple[int, ...],
        pieces: Sequence[Piece],
        head: TokenView | None = None,
        prefixes: PrefixDigests | None = None,
    ) -> None:
        self.source = source
        self.pieces = tuple(p for p in pieces if len(p))
        self.head = head
        self.prefixes = prefixes  # digests of the source's prefixes (shared by every view of one plan)
        self._len = (len(head) if head is not None else 0) + sum(len(p) for p in self.pieces)
        self._state: Any = None

    def __len__(self) -> int:
        return self._len

    def then(self, *pieces: Piece) -> TokenView:
        """This view followed by more pieces (it is not copied)."""
        return TokenView(self.source, pieces, self if len(self) else None, self.prefixes)

    def _chain(self) -> list[Piece]:
        nodes: list[TokenView] = []
        node: TokenView | None = self
        while node is not None:
            nodes.append(node)
            node = node.head
        return [p for n in reversed(nodes) for p in n.pieces]

    def _runs(self) -> Iterator[Sequence[int]]:
        for p in self._chain():
            yield self.source[p.start : p.stop] if isinstance(p, range) else p

    def ids(self) -> tuple[int, ...]:
        """The token ids, materialised."""
        return tuple(itertools.chain.from_iterable(self._runs()))

    def __iter__(self) -> Iterator[int]:
        for run in self._runs():
            yield from run

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[int, ...]: ...
    def __getitem__(self, index: int | slice) -> int | tuple[int, ...]:
        if isinstance(index, int):
            i = index + len(self) if index < 0 else index
            if not 0 <= i < len(self):
                raise IndexError("TokenView index out of range")
            return self._slice(i, i + 1)[0]
        start, stop, step = index.indices(len(self))
        return self._slice(start, stop) if step == 1 else self.ids()[index]

    def _slice(self, start: int, stop: int) -> tuple[int, ...]:
        """ids()[start:stop] without materialising the rest."""
        out: list[int] = []
        at = 0
        for p in self._chain():
            size = len(p)
            lo, hi = max(start - at, 0), min(stop - at, size)
            if lo < hi:
                out += self.source[p.start + lo : p.start + hi] if isinstance(p, range) else p[lo:hi]
            at += size
            if at >= stop:
                break
        return tuple(out)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenView):
            if other.source is self.source and other._chain() == self._chain():
                return True
            return len(other) == len(self) and other.ids() == self.ids()
        if isinstance(other, Sequence) and not isinstance(other, str):
            return len(other) == len(self) and tuple(other) == self.ids()
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.ids())

    def __add__(self, other: Sequence[int]) -> tuple[int, ...]:
        return self.ids() + tuple(other)

    def __radd__(self, other: Sequence[int]) -> tuple[int, ...]:
        return tuple(other) + self.ids()

    def __repr__(self) -> str:
        return f"TokenView(len={len(self)}, pieces={self._chain()!r})"

    def state(self) -> Any:
        """A fresh blake2b state holding these ids: from the head's state, or the source prefix it starts with."""
        if self._state is None:
            pieces = list(self.pieces)
            first = pieces[0] if pieces else None
            if self.head is not None:
                state = self.head.state()
            elif isinstance(first, range) and first.start == 0 and self.prefixes is not None:
                state = self.prefixes.state(first.stop)
                pieces.pop(0)
            else:
                state = hashlib.blake2b(digest_size=DIGEST_SIZE)
            for p in pieces:
                state.update(_bytes(self.source[p.start : p.stop] if isinstance(p, range) else p))
            self._state = state
        return self._state.copy()

    def digest(self) -> str:
        return str(self.state().hexdigest())
