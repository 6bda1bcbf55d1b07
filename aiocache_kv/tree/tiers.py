"""Per-tier node state of the radix tree: pins, page accounting, transitions, LRU victims.

:class:`TierBook` is the base of :class:`~aiocache_kv.tree.radix.RadixTree` that owns what
changes a node's presence in a tier: the one transition function per tier (``_set_device`` /
``_set_host``, checked against the legal transitions below), the FILLING/RESIDENT steps of
copies and backups, pins, the evictable/protected page counts and the victim heaps.  The
structure (roots, match, insert, split, eviction walks) lives in ``radix.py``.
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from aiocache_kv.errors import OwnershipError
from aiocache_kv.quotas import QuotaBook, tenant_of
from aiocache_kv.tree.lru import TenantVictims, VictimHeap
from aiocache_kv.tree.node import ABSENT, FILLING, RESIDENT, Node, TierState
from aiocache_kv.tree.pathwalk import pin_path, unpin_path
from aiocache_kv.tree.retention import Deadlines

_get_ident = threading.get_ident  # one global lookup on every ownership check


class TierBook:
    """Pins, per-tier accounting and transitions of a tree's nodes (owned by one thread)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._owner = threading.get_ident()
        self._clock = 0
        # page accounting, per tier
        self.dev_evictable = 0
        self.dev_protected = 0
        self.host_evictable = 0
        self.host_protected = 0
        self._dev_heap: VictimHeap[Node] = VictimHeap(is_device_candidate)
        self._host_heap: VictimHeap[Node] = VictimHeap(is_host_candidate)
        #: called after an unpin left a node with no pin (its pages may be evictable now)
        self.on_unpinned: Callable[[], None] | None = None
        #: retention deadlines (lapsed before every eviction); per-tenant page ledger, kept
        #: only once a quota is configured (:meth:`enable_quotas`)
        self.deadlines = Deadlines(self._offer)
        self.tenants: QuotaBook | None = None

    def _reclaim(self, root: Node) -> None:
        """Forget an empty namespace (the tree's structure decides; see ``RadixTree``)."""
        raise NotImplementedError

    def walk(self) -> Iterator[Node]:
        """Every non-root node, parents before children (``RadixTree``'s)."""
        raise NotImplementedError

    def walk_detached(self) -> Iterator[Node]:
        """Every node of a dropped subtree not freed yet (``Detacher``'s)."""
        raise NotImplementedError

    def device_pages_in_tree(self) -> list[np.ndarray]:
        """Every device page array held by the tree (for allocator cross-checks)."""
        return [n.device_pages for n in self.walk() if n.device_pages is not None]

    def host_pages_in_tree(self) -> list[torch.Tensor]:
        """Every host page tensor held by the tree (for allocator cross-checks)."""
        return [n.host_pages for n in self.walk() if n.host_pages is not None]

    # ---------------------------------------------------------------- retention, quotas

    def enable_quotas(self, book: QuotaBook) -> None:
        """Keep the per-tenant page ledger ``book`` and per-tenant victim heaps from now on
        (one walk of the tree, to count what it holds)."""
        self._check_owner()
        assert self.tenants is None, "quotas already enabled"
        self.tenants = book
        self._dev_heap = TenantVictims(is_device_candidate, _node_tenant, book.over[0])
        self._host_heap = TenantVictims(is_host_candidate, _node_tenant, book.over[1])
        for node in self.walk():
            self._acct_tenant(book, node, 1)
            self._offer(node)
        for node in self.walk_detached():  # dropped, holding pages until freed: no victims
            self._acct_tenant(book, node, 1)

    def _acct_tenant(self, book: QuotaBook, node: Node, sign: int) -> None:
        n = sign * (len(node.key) // self.page_size)
        book.add(
            tenant_of(node.ns),
            n if node.device is not ABSENT else 0,
            n if node.host is not ABSENT else 0,
        )

    def _victims(self, heap: VictimHeap[Node], tenant: str | None) -> Callable[[], Node | None]:
        """The pop of an eviction walk (after lapsing due retention deadlines): the tier's
        next victim, or with ``tenant`` that tenant's alone."""
        self.deadlines.lapse()
        return heap.pop if tenant is None else functools.partial(heap.pop_own, tenant)

    def _inherit_retention(self, head: Node, tail: Node) -> None:
        """A split's new ``head`` keeps the priority and deadline of the node it came from."""
        head.priority = tail.priority
        head.retain_until = tail.retain_until
        if tail.retain_until != math.inf:
            self.deadlines.track(head)

    def _check_retention(self, nodes: list[Node]) -> None:
        """Priorities and deadlines (``Deadlines.check``) and the tenant ledger."""
        self.deadlines.check(nodes)
        if self.tenants is not None:
            self.tenants.check(self.tenant_pages())

    def tenant_pages(self) -> dict[str, list[int]]:
        """Pages per tenant per tier (device, host), recounted from the tree (detached nodes'
        included: they hold their pages until freed)."""
        out: dict[str, list[int]] = {}
        p = self.page_size
        for node in itertools.chain(self.walk(), self.walk_detached()):
            u = out.setdefault(tenant_of(node.ns), [0, 0])
            n = len(node.key) // p
            u[0] += n if node.device is not ABSENT else 0
            u[1] += n if node.host is not ABSENT else 0
        return out

    # ---------------------------------------------------------------- ownership

    def bind_owner(self, ident: int | None = None) -> None:
        """Make the calling thread (or ``ident``) the only one allowed to mutate the tree."""
        self._owner = threading.get_ident() if ident is None else ident

    def _check_owner(self) -> None:
        if _get_ident() != self._owner:
            raise OwnershipError(
                f"radix tree mutated from thread {threading.current_thread().name!r}; "
                "only the owning event-loop thread may change cache state"
            )

    # ---------------------------------------------------------------- access, pins

    def _stamp(self, node: Node, clock: int) -> None:
        """Mark the path to ``node`` used at ``clock``; re-offer the unpinned candidates."""
        dev_offer = self._dev_heap.offer
        host_offer = self._host_heap.offer
        while node.parent is not None:
            node.last_access = clock
            if node.pins == 0:  # only unpinned leaves of a tier can be candidates
                if node.n_dev_children == 0 and node.device is RESIDENT:
                    dev_offer(node)
                elif node.device is ABSENT and not node.children:
                    host_offer(node)
            node = node.parent

    def record_hit(self, node: Node) -> None:
        """Count a hit on every node of the path to ``node`` (for selective write-through)."""
        while node.parent is not None:
            node.hit_count += 1
            node = node.parent

    def pin(self, node: Node, clock: int | None = None) -> None:
        """Pin ``node`` and its ancestors: none of them can be evicted until ``unpin``.
        With ``clock``, also mark the path used at ``clock`` (what :meth:`_stamp` does, in
        the same walk: a pinned node is offered to no victim heap)."""
        if _get_ident() != self._owner:  # _check_owner, inline: every request pins twice
            self._check_owner()
        if node.parent is None:
            assert node.alive, f"pin of a reclaimed root {node!r}"
            node.pins += 1  # keeps an empty namespace's root while a handle refers to it
            return
        dev, host = pin_path(node, self.page_size, clock)
        if dev:
            self.dev_evictable -= dev
            self.dev_protected += dev
        if host:
            self.host_evictable -= host
            self.host_protected += host

    def unpin(self, node: Node) -> None:
        """Drop one pin from ``node`` and its ancestors."""
        if _get_ident() != self._owner:  # _check_owner, inline: every request unpins twice
            self._check_owner()
        if node.parent is None:
            assert node.pins > 0, f"unpin of unpinned root {node!r}"
            node.pins -= 1
            self._reclaim(node)
            return
        dev, host, unpinned = unpin_path(node, self.page_size)
        if dev:
            self.dev_evictable += dev
            self.dev_protected -= dev
        if host:
            self.host_evictable += host
            self.host_protected -= host
        if unpinned is not None:  # nodes left with no pin; those that may be victims:
            for n in unpinned:  # a device candidate, or a host one (may_be_victim)
                (self._dev_heap if n.device is RESIDENT else self._host_heap).offer(n)
            if self.on_unpinned is not None:  # only schedules work
                self.on_unpinned()

    def pin_host(self, node: Node) -> None:
        """Hard-pin the host copies of ``node`` and its ancestors (``hardpins.py``): none of
        them is a host victim until :meth:`unpin_host`; their device copies may still go.
        Every node of the path must be host-RESIDENT."""
        self._check_owner()
        p = self.page_size
        while node.parent is not None:
            assert node.host is RESIDENT, f"host pin of a node not on host {node!r}"
            node.host_pins += 1
            if node.host_pins == 1:
                self._protect_host(node, len(node.key) // p)
            node = node.parent

    def unpin_host(self, node: Node) -> None:
        """Drop one hard host pin from ``node`` and its ancestors (``on_unpinned`` runs once
        if a node was left without one: its pages may be evictable, or reapable, now)."""
        self._check_owner()
        p = self.page_size
        hook = self.on_unpinned
        while node.parent is not None:
            assert node.host_pins > 0, f"host unpin of a node not host-pinned {node!r}"
            node.host_pins -= 1
            if node.host_pins == 0:
                self._protect_host(node, -(len(node.key) // p))
                self._offer(node)
                if hook is not None:  # only schedules work: the walk goes on undisturbed
                    hook()
                    hook = None
            node = node.parent

    def _protect_host(self, node: Node, n: int) -> None:
        """A node's first hard host pin came (``n`` > 0) or its last went: its host pages
        move between evictable and protected, unless something else protects them anyway
        (``_acct``'s rule: a pin, a copy in flight, a backup reading them)."""
        if node.host is ABSENT or node.storage is FILLING or node.pins > 0:
            return
        if node.device is FILLING or node.host is FILLING:
            return
        self.host_evictable -= n
        self.host_protected += n

    # ---------------------------------------------------------------- tier transitions

    def _npages(self, node: Node) -> int:
        return len(node.key) // self.page_size

    def _acct(self, node: Node, sign: int) -> None:
        if self.tenants is not None:
            self._acct_tenant(self.tenants, node, sign)
        n = sign * (len(node.key) // self.page_size)
        busy = node.pins > 0 or node.device is FILLING or node.host is FILLING
        if node.device is not ABSENT:
            if busy:
                self.dev_protected += n
            else:
                self.dev_evictable += n
        if node.host is not ABSENT:
            if busy or node.storage is FILLING or node.host_pins:
                self.host_protected += n
            else:
                self.host_evictable += n

    def _offer(self, node: Node) -> None:
        self._dev_heap.offer(node)
        self._host_heap.offer(node)

    def _set_device(self, node: Node, state: TierState, *, accounted: bool = False) -> None:
        """The one transition function of the device tier (accounting and heaps follow)."""
        old = node.device
        assert _DEVICE_OK[old, state], f"device {old.name}->{state.name} on {node!r}"
        if not accounted:
            self._acct(node, -1)
        node.device = state
        parent = node.parent
        assert parent is not None
        if old is ABSENT and state is not ABSENT:
            assert parent.device is not ABSENT, f"device presence not prefix-closed at {node!r}"
            parent.n_dev_children += 1
        elif state is ABSENT and old is not ABSENT:
            assert node.n_dev_children == 0, f"device-absent node with device children {node!r}"
            parent.n_dev_children -= 1
            node.device_pages = None
            node.device_complete = False  # a later device copy comes from the host one
            self._offer(parent)
        self._acct(node, 1)
        self._offer(node)

    def _set_host(self, node: Node, state: TierState) -> None:
        """The one transition function of the host tier."""
        old = node.host
        assert _HOST_OK[old, state], f"host {old.name}->{state.name} on {node!r}"
        self._acct(node, -1)
        node.host = state
        if state is ABSENT:
            node.host_pages = None
        self._acct(node, 1)
        self._offer(node)

    def begin_host_fill(self, node: Node, host_pages: torch.Tensor, op: Any) -> None:
        """Device-resident ``node`` starts copying to ``host_pages`` (write-through/back)."""
        self._check_owner()
        assert node.device is RESIDENT and node.host is ABSENT, f"cannot back up {node!r}"
        assert node.op is None, f"{node!r} already has a transfer in flight"
        assert host_pages.numel() == self._npages(node), "host page count mismatch"
        node.host_pages = host_pages
        node.op = op
        self._set_host(node, FILLING)

    def end_host_fill(self, node: Node, ok: bool) -> torch.Tensor | None:
        """Apply a write ack; on failure return the host pages to free."""
        self._check_owner()
        assert node.host is FILLING, f"host ack on {node!r}"
        node.op = None
        if ok:
            self._set_host(node, RESIDENT)
            return None
        pages = node.host_pages
        self._set_host(node, ABSENT)
        return pages

    def begin_device_fill(self, node: Node, device_pages: np.ndarray, op: Any) -> None:
        """Host-only ``node`` starts loading into ``device_pages`` (load-back; int64 ids)."""
        self._check_owner()
        assert node.host is RESIDENT and node.device is ABSENT, f"cannot load back {node!r}"
        assert node.op is None, f"{node!r} already has a transfer in flight"
        assert device_pages.size == self._npages(node), "device page count mismatch"
        node.device_pages = device_pages
        node.op = op
        self._set_device(node, FILLING)

    def end_device_fill(self, node: Node, ok: bool) -> np.ndarray | None:
        """Apply a load ack; on failure return the device pages to free."""
        self._check_owner()
        assert node.device is FILLING, f"device ack on {node!r}"
        node.op = None
        if ok:
            self._set_device(node, RESIDENT)
            return None
        pages = node.device_pages
        self._set_device(node, ABSENT)
        return pages

    def begin_backup(self, node: Node, op: Any) -> None:
        """Host-resident ``node`` starts copying to storage; its host copy is protected."""
        self._check_owner()
        assert node.host is RESIDENT and node.storage is ABSENT, f"cannot back up {node!r}"
        assert node.backup is None, f"{node!r} already has a backup in flight"
        self._acct(node, -1)
        node.storage = FILLING
        node.backup = op
        self._acct(node, 1)

    def end_backup(self, node: Node, ok: bool) -> None:
        """Apply a storage ack: the node is in storage (``ok``) or not."""
        self._check_owner()
        assert node.storage is FILLING, f"storage ack on {node!r}"
        self._acct(node, -1)
        node.storage = RESIDENT if ok else ABSENT
        node.backup = None
        self._acct(node, 1)
        self._offer(node)
        up = node.parent  # a device victim skipped while this backup ran may go now
        while up is not None and up.parent is not None and up.device is ABSENT:
            up = up.parent
        if up is not None and up.parent is not None:
            self._dev_heap.offer(up)

    def lose_storage(self, node: Node) -> bool:
        """Storage no longer holds all of ``node``'s pages (evicted, or found missing): it is
        storage-ABSENT again, so a later hit backs it up.  Whether it was RESIDENT."""
        self._check_owner()
        if not node.alive or node.storage is not RESIDENT:
            return False
        self._acct(node, -1)
        node.storage = ABSENT
        self._acct(node, 1)
        self._offer(node)
        return True

    def demote(self, node: Node) -> np.ndarray | None:
        """Drop the device copy of an idle device leaf that has a host copy.

        Returns the freed device pages, or ``None`` when the node is pinned, busy, has
        device children or no host copy (then nothing changes).
        """
        self._check_owner()
        if not (node.alive and is_device_candidate(node) and node.host is RESIDENT):
            return None
        pages = node.device_pages
        self._set_device(node, ABSENT)
        return pages


def _node_tenant(node: Node) -> str:
    return tenant_of(node.ns)


def is_device_candidate(node: Node) -> bool:
    """Whether ``node`` may be chosen as a device victim now."""
    return (
        node.alive
        and node.device is RESIDENT
        and node.host is not FILLING
        and node.pins == 0
        and node.n_dev_children == 0
        and node.parent is not None
    )


def is_host_candidate(node: Node) -> bool:
    """Whether ``node`` may be chosen as a host victim now."""
    return not node.children and node.parent is not None and host_victim_when_leaf(node)


def host_victim_when_leaf(node: Node) -> bool:
    """Whether ``node`` is a host victim once it has no children (``Evictor.can_free``
    counts the parents its victims would leave)."""
    return (
        node.alive
        and node.host is RESIDENT
        and node.storage is not FILLING
        and node.device is ABSENT
        and node.pins == 0
        and node.host_pins == 0
    )


def check_host_pins(order: list[Node], host_pins: dict[int, int]) -> None:
    """Each node of ``order`` (parents before children) holds as many hard host pins as end
    in its subtree (``host_pins``: ``id(node)`` -> pins ending there)."""
    below: dict[int, int] = {}
    for node in reversed(order):
        n = host_pins.get(id(node), 0) + sum(below.get(id(c), 0) for c in node.children.values())
        below[id(node)] = n
        assert node.host_pins == n, f"host pins {node.host_pins} != live host pins {n} {node!r}"


_DEVICE_OK = {
    (a, b): ok
    for a in TierState
    for b in TierState
    for ok in [
        (a, b)
        in {
            (ABSENT, RESIDENT),  # insert / adopt
            (ABSENT, FILLING),  # load-back starts
            (FILLING, RESIDENT),  # load-back ack
            (FILLING, ABSENT),  # load-back failed
            (RESIDENT, ABSENT),  # eviction / demotion
        }
    ]
}
_HOST_OK = {
    (a, b): ok
    for a in TierState
    for b in TierState
    for ok in [
        (a, b)
        in {
            (ABSENT, FILLING),  # write-through / write-back starts
            (FILLING, RESIDENT),  # ack
            (FILLING, ABSENT),  # copy failed
            (ABSENT, RESIDENT),  # attached from storage
            (RESIDENT, ABSENT),  # host eviction
        }
    ]
}

__all__ = [
    "TierBook",
    "check_host_pins",
    "host_victim_when_leaf",
    "is_device_candidate",
    "is_host_candidate",
]
