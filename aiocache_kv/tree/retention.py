"""Retention priority: soft, lapsing per-node priorities for eviction (issue #26).

An insert may carry a priority in ``[PRIORITY_DEFAULT, PRIORITY_MAX]`` and a retention time.
Every node on the inserted path (shared ancestors included) takes the higher of its priority
and the insert's; for an equal priority the later deadline wins; a lower one leaves the node
alone.  The device and host victim heaps (:class:`~aiocache_kv.tree.lru.VictimHeap`) order
candidates by ``(priority, last_access)``: lower priority first, least recently used within a
priority.  The priority is *soft*: it only orders victims, so a high-priority idle page is
still evicted when nothing lower is left.

A priority with a retention time lapses back to the default at its deadline without a timer
per page: one :class:`Deadlines` heap of ``(retain_until, seq, node)`` entries with lazy
deletion (an entry is live while the node is alive and its ``retain_until`` is the entry's).
Before every eviction the tree pops the due entries (:meth:`Deadlines.lapse`), resets those
nodes to the default priority and re-offers them to the victim heaps.  Deadlines are
monotonic seconds (``time.monotonic``; ``Deadlines.now`` may be replaced, e.g. by a test's
clock).
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from aiocache_kv.errors import InvalidInputError, InvalidTypeError
from aiocache_kv.numeric import check_real

if TYPE_CHECKING:
    from aiocache_kv.tree.node import Node

#: the priority of a page inserted without one; also what a lapsed priority falls back to
PRIORITY_DEFAULT = 0
#: the highest priority an insert may give
PRIORITY_MAX = 1000
#: bit offset of the priority in a victim heap's key: ``priority << SHIFT | last_access``
#: (the access clock counts operations and never reaches 2**64)
PRIORITY_SHIFT = 64

INF = math.inf


def check_priority(priority: object, retention: object) -> tuple[int, float] | None:
    """``(priority, retention seconds or inf)`` of an insert, or ``None`` when it changes
    nothing (no priority given, or the default priority: a retention time then has nothing
    to lapse).

    Raises:
        InvalidTypeError: ``priority`` is not an int (``bool`` and ``float`` are refused).
        InvalidInputError: ``priority`` outside ``[0, 1000]``, or ``retention`` not a finite
            number in ``(0, MAX_SECONDS]`` (also when given without a priority).
    """
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
        raise InvalidTypeError(
            f"priority must be an int, got {type(priority).__name__} {priority!r}"
        )
    if priority is not None and not PRIORITY_DEFAULT <= priority <= PRIORITY_MAX:
        raise InvalidInputError(
            f"priority must be in [{PRIORITY_DEFAULT}, {PRIORITY_MAX}], got {priority!r}"
        )
    seconds = INF
    if retention is not None:
        seconds = check_real("retention", retention, exclusive=True)
    if priority is None or priority == PRIORITY_DEFAULT:
        return None
    return priority, seconds


def victim_key(node: Node) -> int:
    """A node's order in the victim heaps: lower priority first, then least recently used."""
    pr = node.priority
    return node.last_access if not pr else (pr << PRIORITY_SHIFT) | node.last_access


class Deadlines:
    """The one heap of retention deadlines of a tree (loop-owned).

    ``reoffer(node)`` runs for every node whose priority changed (raised, or lapsed): the tree
    offers it to the victim heaps again, superseding its entry of the old priority.
    """

    __slots__ = ("_entries", "_live", "_seq", "now", "reoffer")

    def __init__(self, reoffer: Callable[[Node], None]) -> None:
        self._entries: list[tuple[float, int, Node]] = []
        self._seq = itertools.count()
        #: id(node) -> the deadline of its live entry
        self._live: dict[int, float] = {}
        self.reoffer = reoffer
        #: the clock deadlines are read on (monotonic seconds)
        self.now: Callable[[], float] = time.monotonic

    def __len__(self) -> int:
        return len(self._live)

    def raise_path(self, node: Node, priority: int, seconds: float) -> None:
        """Give ``node`` and its ancestors ``priority`` for ``seconds`` (``inf``: for good),
        each keeping its own if higher (equal: the later deadline; a priority past its
        deadline counts as the default, lapsed or not)."""
        now = self.now()
        until = INF if seconds == INF else now + seconds
        while node.parent is not None:
            self.raise_node(node, priority, until, now)
            node = node.parent

    def raise_node(self, node: Node, priority: int, until: float, now: float) -> bool:
        """Raise one node's priority (see :meth:`raise_path`); whether it changed."""
        cur = node.priority if node.retain_until > now else PRIORITY_DEFAULT
        if priority < cur or (priority == cur and until <= node.retain_until):
            return False
        node.priority = priority
        node.retain_until = until
        if until != INF:
            self.track(node)
        else:
            self._live.pop(id(node), None)
        self.reoffer(node)
        return True

    def track(self, node: Node) -> None:
        """Register ``node``'s finite deadline (a new node with one, e.g. a split's head)."""
        until = node.retain_until
        assert until != INF, f"tracking a deadline-less {node!r}"
        self._live[id(node)] = until
        heapq.heappush(self._entries, (until, next(self._seq), node))
        if len(self._entries) > 2 * len(self._live) + 64:
            self._compact()

    def forget(self, node: Node) -> None:
        """``node`` left the tree: its entry is stale."""
        if node.retain_until != INF:
            self._live.pop(id(node), None)

    def lapse(self) -> int:
        """Reset every node whose deadline passed to the default priority; how many."""
        entries = self._entries
        if not entries:
            return 0
        now = self.now()
        done = 0
        live = self._live
        while entries and entries[0][0] <= now:
            until, _, node = heapq.heappop(entries)
            if live.get(id(node)) != until or node.retain_until != until or not node.alive:
                continue
            del live[id(node)]
            node.priority = PRIORITY_DEFAULT
            node.retain_until = INF
            done += 1
            self.reoffer(node)
        return done

    def _compact(self) -> None:
        live = self._live
        keep = [e for e in self._entries if live.get(id(e[2])) == e[0] and e[2].alive]
        self._live = {id(e[2]): e[0] for e in keep}
        heapq.heapify(keep)
        self._entries = keep

    def check(self, nodes: list[Node]) -> None:
        """Every node's priority is in range, a default one never lapses, and every finite
        deadline has a live entry.

        Raises:
            AssertionError: naming the node.
        """
        live = self._live
        for node in nodes:
            pr = node.priority
            assert PRIORITY_DEFAULT <= pr <= PRIORITY_MAX, f"priority {pr} out of range {node!r}"
            until = node.retain_until
            if pr == PRIORITY_DEFAULT:
                assert until == INF, f"default priority with a deadline {until} {node!r}"
            if until != INF:
                assert live.get(id(node)) == until, f"deadline {until} without an entry {node!r}"


__all__ = [
    "PRIORITY_DEFAULT",
    "PRIORITY_MAX",
    "Deadlines",
    "check_priority",
    "victim_key",
]
