"""Least-recently-used victim selection without scanning the tree.

A :class:`VictimHeap` is a binary heap of ``(last_access, seq, node)`` entries with lazy
deletion: an entry is *live* only while ``node`` is still a candidate for its tier and the
entry's timestamp is the one the node last pushed.  Each victim costs O(log n) amortized;
stale entries are dropped when popped and the heap is rebuilt when more than half of it is
stale, so memory stays linear in the number of candidates.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar


class _HasStamp(Protocol):
    last_access: int


N = TypeVar("N", bound=_HasStamp)


class VictimHeap(Generic[N]):
    """Candidates of one tier ordered by ``(last_access, insertion order)``."""

    __slots__ = ("_entries", "_is_candidate", "_pushed", "_seq")

    def __init__(self, is_candidate: Callable[[N], bool]) -> None:
        self._entries: list[tuple[int, int, N]] = []
        self._seq = itertools.count()
        self._is_candidate = is_candidate
        # node -> timestamp of its live entry (identity keyed; nodes are not hashable by value)
        self._pushed: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def offer(self, node: N) -> None:
        """Push ``node`` if it is a candidate and has no entry for its current timestamp."""
        if not self._is_candidate(node):
            return
        ts = node.last_access
        key = id(node)
        if self._pushed.get(key) == ts:
            return
        self._pushed[key] = ts
        heapq.heappush(self._entries, (ts, next(self._seq), node))
        if len(self._entries) > 2 * len(self._pushed) + 64:
            self._compact()

    def forget(self, node: N) -> None:
        """Drop bookkeeping of a node that left the tree (its entries become stale)."""
        self._pushed.pop(id(node), None)

    def pop(self) -> N | None:
        """Remove and return the least recently used live candidate, or ``None``."""
        entries = self._entries
        pushed = self._pushed
        while entries:
            ts, _, node = heapq.heappop(entries)
            key = id(node)
            if pushed.get(key) != ts:
                continue  # superseded by a newer entry of the same node
            del pushed[key]
            if node.last_access == ts and self._is_candidate(node):
                return node
        return None

    def _compact(self) -> None:
        """Rebuild without stale entries (amortized O(1) per push: runs when half are stale)."""
        pushed = self._pushed
        keep = [
            e
            for e in self._entries
            if pushed.get(id(e[2])) == e[0]
            and e[2].last_access == e[0]
            and self._is_candidate(e[2])
        ]
        self._pushed = {id(e[2]): e[0] for e in keep}
        heapq.heapify(keep)
        self._entries = keep
