"""Detached subtrees: nodes dropped from the tree while someone still uses them.

``HiCache.drop`` (:mod:`aiocache_kv.purge`) removes a subtree at once: nothing can match it
again.  Its idle nodes are freed at once; a node that is still in use (pinned by a handle or a
prefetch's anchor, a device<->host copy or a backup in flight) must not be freed under its
user, so the subtree is *detached*: unlinked from its parent's children (so a walk from a root
never reaches it) but kept, with its pins, states, pages and page accounting, until its users
are done.  Then :meth:`Detacher.reap` frees it, children first.

What stays true of a detached node (``RadixTree.check_invariants`` checks it):

* ``alive`` is ``False`` (so it is never a victim, never backed up, never demoted), and every
  node below it is detached too; the top of each detached subtree is listed in
  ``Detacher.detached``;
* its parent keeps counting it in ``n_dev_children`` while it is device-present, so the
  parent's device copy cannot be evicted under it (device presence stays prefix-closed along
  the path a handle reads), and a root with a detached child is not reclaimed;
* pins still run through it to the root (a handle's ``unpin`` walks the same parents), and
  its pages stay in the tree's evictable/protected counts and in ``num_nodes`` until reaped;
* the per-tier transitions are the usual ones (a copy in flight lands on it as on any node).
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Iterator
from typing import Any

import numpy as np
import torch

from aiocache_kv.tree.node import ABSENT, RESIDENT, Node
from aiocache_kv.tree.tiers import TierBook


class Reaped:
    """What one :meth:`Detacher.reap` freed: per tier, the nodes and their pages."""

    __slots__ = ("device_nodes", "device_pages", "host_nodes", "host_pages", "nodes")

    def __init__(self) -> None:
        self.nodes: list[Node] = []  #: every node freed (children before parents)
        self.device_nodes: list[Node] = []
        self.device_pages: list[np.ndarray] = []  #: int64 page ids, as the nodes keep them
        self.host_nodes: list[Node] = []
        self.host_pages: list[torch.Tensor] = []


def _idle(node: Node) -> bool:
    return (
        node.pins == 0
        and node.host_pins == 0
        and node.op is None
        and node.backup is None
        and not node.children
    )


class Detacher(TierBook):
    """Detach subtrees from the tree and free them once idle (the tree's mixin)."""

    def __init__(self, page_size: int) -> None:
        super().__init__(page_size)
        #: id -> the top node of each detached subtree
        self.detached: dict[int, Node] = {}

    # provided by RadixTree
    def _child_key(self, tokens: list[int], pos: int) -> Any:
        raise NotImplementedError

    def block_hashes(self, node: Node) -> list[bytes]:
        raise NotImplementedError

    def _reclaim(self, root: Node) -> None:
        raise NotImplementedError

    def _reclaim_blocked(self, root: Node) -> bool:
        """Whether a detached subtree still hangs below ``root`` (it must not be reclaimed)."""
        return bool(self.detached) and any(t.parent is root for t in self.detached.values())

    def detach(self, node: Node) -> list[Node]:
        """Unlink ``node`` (a live non-root node) and its subtree from the tree; nothing can
        match them any more.  Returns the subtree's nodes, parents first.  Their block hashes
        are computed now (the namespace's seed may go before they are reaped)."""
        self._check_owner()
        parent = node.parent
        assert parent is not None and node.alive, f"cannot detach {node!r}"
        nodes: list[Node] = []
        stack = [node]
        while stack:
            cur = stack.pop()
            self.block_hashes(cur)
            nodes.append(cur)
            stack.extend(cur.children.values())
        del parent.children[self._child_key(node.key, 0)]
        for cur in nodes:
            cur.alive = False
            self._dev_heap.forget(cur)
            self._host_heap.forget(cur)
            self.deadlines.forget(cur)
        self.detached[id(node)] = node
        return nodes

    def walk_detached(self) -> Iterator[Node]:
        """Every detached node, parents before children."""
        stack = list(self.detached.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def is_detached(self, node: Node) -> bool:
        """Whether ``node`` lies in a detached subtree."""
        cur: Node | None = node
        while cur is not None and not cur.alive and cur.parent is not None:
            if id(cur) in self.detached and self.detached[id(cur)] is cur:
                return True
            cur = cur.parent
        return False

    def detached_namespaces(self) -> set[Hashable]:
        """The namespaces that have detached nodes."""
        return {t.ns for t in self.detached.values()}

    def reap(self) -> Reaped:
        """Free every detached node that is idle now (no pin, no copy or backup in flight, no
        child left, no subtree detached below it left), children before parents; return what
        was freed (the caller frees the pages and publishes the removals)."""
        self._check_owner()
        out = Reaped()
        # a subtree detached earlier may hang below a node detached later (it is not among
        # that node's children): the node waits until it is freed, as for any child
        below = collections.Counter(id(t.parent) for t in self.detached.values())
        for top in list(self.detached.values()):
            order: list[Node] = []
            stack = [top]
            while stack:
                cur = stack.pop()
                order.append(cur)
                stack.extend(cur.children.values())
            for cur in reversed(order):  # children before parents
                if _idle(cur) and not below[id(cur)]:
                    self._reap_one(cur, out)
                    if cur is top:
                        below[id(top.parent)] -= 1
        return out

    def _reap_one(self, node: Node, out: Reaped) -> None:
        if node.device is RESIDENT:
            pages = node.device_pages
            assert pages is not None
            out.device_nodes.append(node)
            out.device_pages.append(pages)
            self._set_device(node, ABSENT)
        if node.host is RESIDENT:
            hpages = node.host_pages
            assert hpages is not None
            out.host_nodes.append(node)
            out.host_pages.append(hpages)
            self._set_host(node, ABSENT)
        assert node.device is ABSENT and node.host is ABSENT, f"reaping busy {node!r}"
        self._dev_heap.forget(node)
        self._host_heap.forget(node)
        parent = node.parent
        assert parent is not None
        if self.detached.get(id(node)) is node:
            del self.detached[id(node)]
            if parent.parent is None:
                self._reclaim(parent)
            elif parent.alive:
                self._offer(parent)
        else:
            del parent.children[self._child_key(node.key, 0)]
        self.num_nodes -= 1
        out.nodes.append(node)

    num_nodes: int

    # recounts cover the detached nodes: their pages are still the tree's until reaped

    def device_pages_in_tree(self) -> list[np.ndarray]:
        """Every device page array held by the tree, detached nodes' included."""
        out = super().device_pages_in_tree()
        return out + [n.device_pages for n in self.walk_detached() if n.device_pages is not None]

    def host_pages_in_tree(self) -> list[torch.Tensor]:
        """Every host page tensor held by the tree, detached nodes' included."""
        out = super().host_pages_in_tree()
        return out + [n.host_pages for n in self.walk_detached() if n.host_pages is not None]

    def check_detached(self) -> dict[int, list[Node]]:
        """Assert the detached subtrees' shape; return the tops by ``id`` of their parent."""
        under: dict[int, list[Node]] = {}
        for key, top in self.detached.items():
            assert id(top) == key and top.parent is not None, f"bad detached top {top!r}"
            under.setdefault(id(top.parent), []).append(top)
        for node in self.walk_detached():
            assert not node.alive, f"detached node alive {node!r}"
            for child in node.children.values():
                assert child.parent is node, f"bad detached link {child!r}"
        return under


__all__ = ["Detacher", "Reaped"]
