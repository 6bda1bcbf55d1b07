"""Eviction: the victims of each tier, demoted or deleted, and the unlinking of a node.

:class:`Evictor` is the part of :class:`~aiocache_kv.tree.radix.RadixTree` that frees pages
on demand.  Victims come from the tiers' victim heaps (``tiers.py``), lowest retention
priority then least recently used first.  A device victim with a host copy is demoted (it
stays matchable from host); one without is deleted with its host-only subtree, unless the
caller stages it (write-back).  Host victims are host-only leaves, deleted.
"""

from __future__ import annotations

from collections.abc import Callable

from aiocache_kv.tree.detach import Detacher
from aiocache_kv.tree.node import ABSENT, RESIDENT, Node
from aiocache_kv.tree.results import Eviction
from aiocache_kv.tree.tiers import host_victim_when_leaf

__all__ = ["SKIP_SCAN", "Evictor"]

#: staging candidates a device eviction passes over (copies in flight cover them) while it
#: looks for victims that free pages now, at most
SKIP_SCAN = 64


class Evictor(Detacher):
    """Eviction of a tree's pages (owned by one thread, like the rest of it)."""

    def evict_device(
        self,
        num_pages: int,
        stage: Callable[[Node], bool] | None = None,
        tenant: str | None = None,
        out: Eviction | None = None,
        coming: int = 0,
    ) -> Eviction:
        """Free at least ``num_pages`` device pages (of ``tenant`` alone if given), lowest
        retention priority then least recently used first, if possible; the victims go to
        ``out`` (a new :class:`Eviction` by default), which ``stage`` may read meanwhile.

        A victim with a host copy is demoted (stays matchable from host); one without is
        deleted, unless ``stage(node)`` takes it (write-back: it starts a copy to host and the
        device pages are freed when that lands; they count toward ``num_pages``, in
        ``staged_pages``: staging every idle page for one page's room demoted them all, past
        retention priorities and tenants' budgets).  ``coming``: pages that copies already
        in flight will free; no victim is staged for what they cover (victims that free
        pages now still go, up to ``SKIP_SCAN`` staging candidates passed over looking for
        them).
        """
        self._check_owner()
        out = Eviction() if out is None else out
        pop = self._victims(self._dev_heap, tenant)
        passed: dict[int, Node] = {}  # staging candidates left for the copies in flight
        while out.num_pages + out.staged_pages < num_pages:
            node = pop()
            if node is None:
                break
            if node.host is ABSENT and stage is not None:
                if out.num_pages + out.staged_pages + coming >= num_pages:
                    passed[id(node)] = node
                    if len(passed) >= SKIP_SCAN:
                        break
                    continue
                if stage(node):
                    out.staged_pages += self._npages(node)
                    continue
            if node.host is not RESIDENT and node.children and not self._subtree_idle(node):
                continue  # a host-only descendant is being backed up: offered again later
            pages = node.device_pages
            assert pages is not None
            out.num_pages += pages.size
            out.pages.append(pages)
            out.nodes.append(node)
            if node.host is RESIDENT:
                self._set_device(node, ABSENT)
            else:
                if node.children:
                    self._drop_subtree(node, out)
                self._remove(node)
        for node in passed.values():  # victims still: offered again, as they were
            self._offer(node)
        return out

    def evict_host(self, num_pages: int, tenant: str | None = None) -> Eviction:
        """Free at least ``num_pages`` host pages (of ``tenant`` alone if given) by deleting
        host-only leaves (lowest retention priority, then LRU, first)."""
        self._check_owner()
        out = Eviction()
        pop = self._victims(self._host_heap, tenant)
        while out.num_pages < num_pages:
            node = pop()
            if node is None:
                break
            out.num_pages += self._npages(node)
            assert node.host_pages is not None
            out.pages.append(node.host_pages)
            out.nodes.append(node)
            self._remove(node)
        return out

    def can_free(self, num_pages: int) -> bool:
        """Whether :meth:`evict_host` can free ``num_pages`` host pages now: a dry run of its
        walk, counting the parents its victims would leave as victims too; nothing changes.
        (``host_evictable`` also counts host copies of device-resident nodes, which it never
        takes: an eviction trusted to it deleted host-only pages and still came up short.)"""
        self._check_owner()
        pop = self._victims(self._host_heap, None)
        popped: list[Node] = []
        seen: set[int] = set()  # (an over-budget tenant's victims come first, then again)
        gone: dict[int, int] = {}  # node id -> its children the walk would delete
        total = 0
        try:
            while total < num_pages:
                node = pop()
                if node is None:
                    return False
                popped.append(node)
                if id(node) in seen:
                    continue
                seen.add(id(node))
                total += self._npages(node)
                up = node.parent
                while up is not None and up.parent is not None and host_victim_when_leaf(up):
                    done = gone[id(up)] = gone.get(id(up), 0) + 1
                    if done < len(up.children):
                        break
                    total += self._npages(up)  # a leaf once its children went: next in turn
                    up = up.parent
            return True
        finally:
            for node in popped:  # (they were live victims: the same keys again)
                self._host_heap.offer(node)

    @staticmethod
    def _subtree_idle(node: Node) -> bool:
        stack = list(node.children.values())
        while stack:
            child = stack.pop()
            if child.backup is not None or child.op is not None or child.pins or child.host_pins:
                return False
            stack.extend(child.children.values())
        return True

    def _drop_subtree(self, node: Node, out: Eviction) -> None:
        """Remove the host-only descendants of a device victim that has no host copy."""
        stack = list(node.children.values())
        doomed: list[Node] = []
        while stack:
            child = stack.pop()
            assert child.device is ABSENT and child.host is RESIDENT, f"busy below victim {child!r}"
            doomed.append(child)
            stack.extend(child.children.values())
        for child in reversed(doomed):  # children before parents
            assert child.host_pages is not None
            out.host_pages.append(child.host_pages)
            out.host_nodes.append(child)
            self._remove(child)

    def _remove(self, node: Node) -> None:
        """Unlink a childless node and drop its pages from the accounting."""
        assert not node.children, f"removing {node!r} with children"
        assert node.op is None and node.backup is None and node.pins == 0, f"busy {node!r}"
        assert node.host_pins == 0, f"removing host-pinned {node!r}"
        parent = node.parent
        assert parent is not None
        self._acct(node, -1)
        del parent.children[self._child_key(node.key, 0)]
        if node.device is not ABSENT:
            parent.n_dev_children -= 1
        node.alive = False
        self.num_nodes -= 1
        self._dev_heap.forget(node)
        self._host_heap.forget(node)
        self.deadlines.forget(node)
        if parent.parent is None:
            self._reclaim(parent)
        else:
            self._offer(parent)

    def clear(self) -> tuple[Eviction, Eviction]:
        """Evict every unpinned, idle page from device, then host; return both evictions."""
        self._check_owner()
        dev = self.evict_device(1 << 62)
        host = self.evict_host(1 << 62)
        return dev, host
