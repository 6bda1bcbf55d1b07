"""Which node held each page the storage tier stored: page hash -> node, weakly.

The storage tier remembers, for every page that reached storage (a backup landed, or a
prefetch brought it from there), the node that held it, so that an eviction reported by the
backend marks that node storage-absent.  A node dropped from the tree must not be kept alive
by this, so the entries are weak.

One weak reference serves every page of one :meth:`StoredPages.remember` (a node of 2,048
pages costs one reference and one dict update, where a ``WeakValueDictionary`` made 2,048
keyed references, ~3 us each, on the loop).  When a node dies its reference's callback only
queues the reference (it may run on any thread, inside the garbage collector); the loop drops
the dead entries at its next call, so the table is only ever changed on the loop.  A
:meth:`StoredPages.remember` drops at most :data:`SWEEP_STEP` of them (a backup landing just
after an eviction of many nodes does not pay for all of them), and with events off a
prefetch's :meth:`StoredPages.take_missing` drops none (it has no claim to retract): a dead
entry stays a claim, counted orphaned by every reader, until a later call drops it.

A dead node's pages may still be claimed as stored by the ``BlockStored(STORAGE)`` events it
caused, and no node is left to retract the claim when the backend drops them silently (a
Mooncake master evicts without telling anyone).  With ``orphan_limit`` > 0 those hashes are
kept as *orphaned claims* (the newest ``orphan_limit``); a prefetch that finds one of them
missing takes it back with :meth:`take_missing` and retracts it.

Each claim keeps what announced it (the node's tokens, the hash before its first page, its
namespace and where it starts in its sequence; references to what the node already holds),
so that :meth:`StoredPages.claims` can announce every page still claimed again: a snapshot
for a consumer that joined late carries the claims of nodes that left the tree too.
"""

from __future__ import annotations

import collections
import itertools
import operator
import weakref
from typing import Any

from aiocache_kv.tree import Node

__all__ = ["SWEEP_STEP", "StoredPages", "StoredRun"]

#: dead nodes' entries one :meth:`StoredPages.remember` drops at most (~5 us each)
SWEEP_STEP = 16


class StoredRun:
    """The pages one :meth:`StoredPages.remember` was given, with what announced them."""

    __slots__ = ("hashes", "ns", "parent", "ref", "start", "tokens")

    def __init__(
        self,
        ref: weakref.ref[Node],
        hashes: list[bytes],
        tokens: list[int],
        parent: bytes | None,
        ns: Any,
        start: int,
    ) -> None:
        self.ref = ref
        self.hashes = hashes  #: the page hashes, in order
        self.tokens = tokens  #: the node's tokens (``page_size`` per page)
        self.parent = parent  #: the hash of the page before the first (``None``: none)
        self.ns = ns  #: the node's namespace
        self.start = start  #: pages before the first one in its sequence


class StoredPages:
    """Page hash -> the node that held the page when it was stored (loop thread only)."""

    def __init__(self, orphan_limit: int = 0) -> None:
        """``orphan_limit``: how many orphaned claims to keep (0: none, events are off)."""
        self._by_hash: dict[bytes, weakref.ref[Node]] = {}
        self._orphan_limit = orphan_limit
        #: hashes of pages stored by nodes that died since, oldest first -> their run
        self._orphans: collections.OrderedDict[bytes, StoredRun] = collections.OrderedDict()
        #: id of each live reference -> the run it was given for
        self._given: dict[int, StoredRun] = {}
        self._dead: collections.deque[weakref.ref[Node]] = collections.deque()  # any thread

    def __len__(self) -> int:
        self._sweep()
        return len(self._by_hash)

    def remember(
        self, node: Node, hashes: list[bytes], parent: bytes | None = None, start: int = 0
    ) -> None:
        """The pages ``hashes`` of ``node`` are in storage now (a later call for a hash wins);
        ``parent``: the hash of the page before them, ``start``: how many pages precede them
        in their sequence (what :meth:`claims` announces them with)."""
        self._sweep(SWEEP_STEP)
        ref = weakref.ref(node, self._dead.append)  # deque.append: safe from any thread
        self._given[id(ref)] = StoredRun(ref, hashes, node.key, parent, node.ns, start)
        self._by_hash.update(dict.fromkeys(hashes, ref))
        if self._orphans:  # claimed by this node now: not orphaned any more (in C, a page)
            collections.deque(map(self._orphans.pop, hashes, itertools.repeat(None)), maxlen=0)

    @property
    def orphans(self) -> int:
        """Orphaned claims kept."""
        self._sweep()
        return len(self._orphans)

    def claims_page(self, page_hash: bytes) -> bool:
        """Whether ``page_hash`` is claimed (by a live node, or as a kept orphan)."""
        self._sweep()
        return page_hash in self._by_hash or page_hash in self._orphans

    def claims_any(self, hashes: list[bytes]) -> bool:
        """Whether :meth:`take_missing` could retract any of ``hashes`` (one is claimed by
        a node that left the tree, or as a kept orphan): never while no orphan is kept."""
        if not self._orphan_limit:
            return False
        self._sweep()
        by_hash, orphans = self._by_hash, self._orphans
        for h in hashes:
            if h in orphans:
                return True
            ref = by_hash.get(h)
            if ref is not None:
                node = ref()
                if node is None or not node.alive:
                    return True
        return False

    def pop(self, page_hash: bytes) -> Node | None:
        """Forget ``page_hash`` (its orphaned claim too); the node that held it, if alive."""
        self._sweep()
        self._orphans.pop(page_hash, None)
        ref = self._by_hash.pop(page_hash, None)
        return None if ref is None else ref()

    def take_missing(self, hashes: list[bytes], present: list[bool]) -> list[bytes]:
        """The orphaned claims among ``hashes`` whose ``present`` flag is false, in order;
        they are forgotten (so retracted once).  A page whose node left the tree but was not
        collected yet (nodes sit in reference cycles) counts as orphaned too."""
        if not self._orphan_limit:
            return []  # (no sweep: nothing to retract, so nothing here needs it now)
        self._sweep()
        orphans = self._orphans
        by_hash = self._by_hash
        out = []
        for h, there in zip(hashes, present, strict=True):
            if there:
                continue
            ref = by_hash.get(h)
            node = None if ref is None else ref()
            if ref is not None and (node is None or not node.alive):
                del by_hash[h]  # (a node of the same pages that left the tree claims it)
                orphans.pop(h, None)
                out.append(h)
            elif h in orphans:  # (once: a hash may repeat)
                del orphans[h]
                out.append(h)
        return out

    def claims(self) -> list[tuple[StoredRun, list[int]]]:
        """Every page still claimed stored, each once: per run, the indices of its pages
        still claimed (by a node in the tree, one that left it, or an orphaned claim)."""
        self._sweep()
        by_hash = self._by_hash
        out: list[tuple[StoredRun, list[int]]] = []
        for run in self._given.values():
            ref = run.ref
            held = [i for i, h in enumerate(run.hashes) if by_hash.get(h) is ref]
            if held:
                out.append((run, held))
        orphaned: dict[int, tuple[StoredRun, set[bytes]]] = {}
        for h, run in self._orphans.items():
            if h not in by_hash:  # else a later node's claim carries it
                orphaned.setdefault(id(run), (run, set()))[1].add(h)
        for run, hashes in orphaned.values():
            out.append((run, [i for i, h in enumerate(run.hashes) if h in hashes]))
        return out

    def _sweep(self, limit: int = -1) -> None:
        """Drop the entries of dead nodes (at most ``limit`` of them; -1: all)."""
        dead = self._dead
        while dead and limit:
            limit -= 1
            ref = dead.popleft()
            run = self._given.pop(id(ref))
            by_hash = self._by_hash
            hashes = run.hashes
            # its claims are the hashes still mapped to it (a later remember of a hash wins);
            # map/compress/deque loop in C: a node of 2,048 pages costs no Python step a page
            held = list(map(by_hash.get, hashes))
            if all(map(operator.is_, held, itertools.repeat(ref))):
                orphaned = hashes  # (the usual case: all of them)
            else:
                orphaned = list(
                    itertools.compress(hashes, map(operator.is_, held, itertools.repeat(ref)))
                )
            # (a hash may repeat: its second pop finds nothing)
            collections.deque(map(by_hash.pop, orphaned, itertools.repeat(None)), maxlen=0)
            if self._orphan_limit:
                self._orphan(orphaned, run)

    def _orphan(self, hashes: list[bytes], run: StoredRun) -> None:
        orphans = self._orphans
        orphans.update(dict.fromkeys(hashes, run))
        for _ in range(len(orphans) - self._orphan_limit):
            orphans.popitem(last=False)  # the oldest claim is forgotten
