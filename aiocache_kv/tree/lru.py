"""Least-recently-used victim selection without scanning the tree.

A :class:`VictimHeap` is a binary heap of ``(key, seq, node)`` entries with lazy deletion,
where ``key`` folds the node's retention priority above its ``last_access`` stamp
(``priority << 64 | last_access``, :mod:`aiocache_kv.tree.retention`): lower priority first,
least recently used within a priority; with every priority the default the key is just the
stamp.  An entry is *live* only while ``node`` is still a candidate for its tier and the
entry's key is the one the node last pushed (a node re-offered with a new stamp or priority
supersedes its old entry).  Each victim costs O(log n) amortized;
stale entries are dropped when popped and the heap is rebuilt when more than half of it is
stale, so memory stays linear in the number of candidates.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from aiocache_kv.tree.retention import PRIORITY_SHIFT


class _HasStamp(Protocol):
    last_access: int
    priority: int


def _key(node: _HasStamp) -> int:
    pr = node.priority
    return node.last_access if not pr else (pr << PRIORITY_SHIFT) | node.last_access


N = TypeVar("N", bound=_HasStamp)


class VictimHeap(Generic[N]):
    """Candidates of one tier ordered by ``(priority, last_access, insertion order)``."""

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
        """Push ``node`` if it is a candidate and has no entry for its current key."""
        if not self._is_candidate(node):
            return
        pr = node.priority
        ts = node.last_access if not pr else (pr << PRIORITY_SHIFT) | node.last_access
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
        """Remove and return the live candidate of lowest priority, least recently used
        within it, or ``None``."""
        entries = self._entries
        pushed = self._pushed
        while entries:
            ts, _, node = heapq.heappop(entries)
            key = id(node)
            if pushed.get(key) != ts:
                continue  # superseded by a newer entry of the same node
            del pushed[key]
            if _key(node) == ts and self._is_candidate(node):
                return node
        return None

    def _compact(self) -> None:
        """Rebuild without stale entries (amortized O(1) per push: runs when half are stale)."""
        pushed = self._pushed
        keep = [
            e
            for e in self._entries
            if pushed.get(id(e[2])) == e[0] and _key(e[2]) == e[0] and self._is_candidate(e[2])
        ]
        self._pushed = {id(e[2]): e[0] for e in keep}
        heapq.heapify(keep)
        self._entries = keep

    def pop_own(self, tenant: str) -> N | None:
        """The next victim of ``tenant`` alone (only a :class:`TenantVictims` keeps them)."""
        return None


class TenantVictims(VictimHeap[N]):
    """A tier's victim heap plus one heap per tenant (used once quotas are configured).

    Every candidate is offered to both.  :meth:`pop` takes victims of the tenants in ``over``
    (the live set of tenants over their budget in this tier) before anyone else's, and
    :meth:`pop_own` takes one tenant's, each O(log n) amortized: a node popped from one heap
    leaves a stale entry in the other, dropped when it surfaces or at a rebuild.
    """

    __slots__ = ("_over", "_own", "_tenant_of")

    def __init__(
        self, is_candidate: Callable[[N], bool], tenant_of: Callable[[N], str], over: set[str]
    ) -> None:
        super().__init__(is_candidate)
        self._tenant_of = tenant_of
        self._over = over
        self._own: dict[str, VictimHeap[N]] = {}

    def offer(self, node: N) -> None:
        """Offer ``node`` to the tier's heap and to its tenant's."""
        if not self._is_candidate(node):
            return
        super().offer(node)
        tenant = self._tenant_of(node)
        own = self._own.get(tenant)
        if own is None:
            own = self._own[tenant] = VictimHeap(self._is_candidate)
        own.offer(node)

    def forget(self, node: N) -> None:
        """Drop bookkeeping of a node that left the tree, in both heaps."""
        super().forget(node)
        own = self._own.get(self._tenant_of(node))
        if own is not None:
            own.forget(node)

    def pop(self) -> N | None:
        """The next victim of an over-budget tenant, else the tier's next victim."""
        for tenant in tuple(self._over) if self._over else ():
            node = self.pop_own(tenant)
            if node is not None:
                return node
        return super().pop()

    def pop_own(self, tenant: str) -> N | None:
        """Remove and return ``tenant``'s next live candidate, or ``None``."""
        own = self._own.get(tenant)
        if own is None:
            return None
        node = own.pop()
        if node is None and not own:
            del self._own[tenant]  # a tenant that left costs nothing
        return node
