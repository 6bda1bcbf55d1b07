"""Which node held each page the storage tier stored: page hash -> node, weakly.

The storage tier remembers, for every page that reached storage (a backup landed, or a
prefetch brought it from there), the node that held it, so that an eviction reported by the
backend marks that node storage-absent.  A node dropped from the tree must not be kept alive
by this, so the entries are weak.

One weak reference serves every page of one :meth:`StoredPages.remember` (a node of 2,048
pages costs one reference and one dict update, where a ``WeakValueDictionary`` made 2,048
keyed references, ~3 us each, on the loop).  When a node dies its reference's callback only
queues the reference (it may run on any thread, inside the garbage collector); the loop drops
the dead entries at its next call, so the table is only ever changed on the loop.
"""

from __future__ import annotations

import collections
import weakref

from aiocache_kv.tree import Node

__all__ = ["StoredPages"]


class StoredPages:
    """Page hash -> the node that held the page when it was stored (loop thread only)."""

    def __init__(self) -> None:
        self._by_hash: dict[int, weakref.ref[Node]] = {}
        #: id of each live reference -> (the reference, the hashes it was given for)
        self._given: dict[int, tuple[weakref.ref[Node], list[int]]] = {}
        self._dead: collections.deque[weakref.ref[Node]] = collections.deque()  # any thread

    def __len__(self) -> int:
        self._sweep()
        return len(self._by_hash)

    def remember(self, node: Node, hashes: list[int]) -> None:
        """The pages ``hashes`` of ``node`` are in storage now (a later call for a hash wins)."""
        self._sweep()
        ref = weakref.ref(node, self._dead.append)  # deque.append: safe from any thread
        self._given[id(ref)] = (ref, hashes)
        self._by_hash.update(dict.fromkeys(hashes, ref))

    def pop(self, page_hash: int) -> Node | None:
        """Forget ``page_hash``; the node that held it, if that node is still alive."""
        self._sweep()
        ref = self._by_hash.pop(page_hash, None)
        return None if ref is None else ref()

    def _sweep(self) -> None:
        dead = self._dead
        while dead:
            ref = dead.popleft()
            _, hashes = self._given.pop(id(ref))
            by_hash = self._by_hash
            for h in hashes:
                if by_hash.get(h) is ref:
                    del by_hash[h]
