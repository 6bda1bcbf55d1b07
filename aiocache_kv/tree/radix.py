"""The radix tree of token pages: structure, per-tier state, pins, accounting, LRU victims.

Design
------
The tree is synchronous and owned by one thread (the event loop's).  It never does I/O and
never allocates pages: callers hand it page tensors and it hands back the pages it stops
using.  Every method that mutates it checks the owner thread first, so a mutation from a worker
thread raises :class:`~aiocache_kv.errors.OwnershipError` instead of corrupting state.

Each namespace has its own root, so namespaces never share nodes.  A node holds whole pages;
``match`` and ``insert`` split nodes at page boundaries.  A split keeps the *suffix* in the
original node object (its ``start`` moves on) and creates a new parent for the prefix, so
anything that refers to the original node (a handle's pin, a pending transfer) keeps pointing
at the same tokens' tail; the split registers the new prefix node with the pending transfer
(``on_split``; also for a storage-resident node, whose stored pages the tier indexes by node).

Per node and tier the state is a :class:`TierState`.  Invariants (see ``check_invariants``):

* every non-root node is present (FILLING or RESIDENT) in the device or the host tier;
* device presence is prefix-closed: a device-present node has a device-present parent, so a
  match is a device run followed by a run that needs ``load_back``.  Host presence is not
  (a failed write-through leaves a host-less parent above host-resident children), so a
  device victim without a host copy is deleted together with its host-only subtree;
* ``host FILLING`` implies ``device RESIDENT`` (write-through/back reads the device copy) and
  ``device FILLING`` implies ``host RESIDENT`` (load-back reads the host copy);
* a node with a FILLING device or host tier has ``op`` set, and only then; a node whose
  storage tier is FILLING (backup in flight, reading the host copy) has ``backup`` set, is
  host-RESIDENT, and its host copy is protected until the backup lands;
* pins: a handle pins every node from its node to the root; pinned nodes are never evicted;
* page accounting per tier splits into *evictable* (unpinned, nothing in flight) and
  *protected*, and equals a recomputation from the tree.

Victims are chosen per tier from a :class:`~aiocache_kv.tree.lru.VictimHeap`: device
candidates are unpinned device-resident nodes with no device-present child and no transfer in
flight; host candidates are unpinned host-only leaves.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import numpy as np
import torch

from aiocache_kv import fastcheck
from aiocache_kv.errors import InvalidInputError
from aiocache_kv.gcfree import keep
from aiocache_kv.tree import pathwalk
from aiocache_kv.tree.evict import Evictor
from aiocache_kv.tree.hashing import chain_hashes, namespace_seed
from aiocache_kv.tree.keycmp import common_len
from aiocache_kv.tree.node import ABSENT, FILLING, RESIDENT, Node, Tier, TierState, check_node
from aiocache_kv.tree.results import Eviction, InsertOutcome, InsertPlan
from aiocache_kv.tree.tiers import check_host_pins
from aiocache_kv.validate import check_token_ints

_get_ident = threading.get_ident  # one global lookup on every ownership check


def _checked_key(tokens: list[int], start: int, pos: int, n: int) -> list[int] | None:
    """Check ``tokens[start:]`` (:func:`check_token_ints`) and, where the walk leaves
    tokens to insert (``pos < n``), make the new leaf's key ``tokens[pos:n]`` in the same C
    call (untracked: :mod:`aiocache_kv.gcfree`).

    Raises:
        InvalidTypeError / InvalidInputError: as :func:`check_token_ints`.
    """
    if pos >= n:
        check_token_ints(tokens, start)
        return None
    key = fastcheck.checked_key(tokens, start, pos, n)
    if type(key) is int:
        check_token_ints(tokens, start)  # raises, naming the item
        raise AssertionError(f"checked_key found a bad token at {key} that a check did not")
    return key  # type: ignore[return-value]


class RadixTree(Evictor):
    """Page-granular radix tree over a device and a host tier.  Not thread-safe by design."""

    def __init__(self, page_size: int, *, on_split: Callable[[Node, Node], None] | None = None):
        if type(page_size) is not int or page_size < 1:
            raise InvalidInputError(f"page_size must be an int >= 1, got {page_size!r}")
        super().__init__(page_size)
        self._roots: dict[Hashable, Node] = {}
        self._seeds: dict[Hashable, bytes] = {}
        self._on_split = on_split
        self.num_nodes = 0
        #: the root found last (a one-entry cache of ``_roots`` that takes no hash: a
        #: namespace's ``__hash__`` is a Python call, and every request looks its root up);
        #: good while its ``ns`` is the very object asked for and it is ``alive``
        self._last_root: Node | None = None
        #: the common match in one call (``pathwalk.pin_match``; a test may switch it off)
        self._pin_match = pathwalk.pin_match

    # ---------------------------------------------------------------- roots

    def root(self, ns: Hashable, tag: str | None = None) -> Node:
        """The root of namespace ``ns`` (created on first use; ``tag`` seeds its hashes)."""
        root = self._roots.get(ns)
        if root is None:
            self._check_owner()
            root = Node([], None, ns)
            root.device = RESIDENT  # roots are present everywhere and never evicted
            root.host = RESIDENT
            self._roots[ns] = root
            self._seeds[ns] = namespace_seed(tag if tag is not None else repr(ns))
        return root

    def roots(self) -> Iterator[Node]:
        """All namespace roots."""
        return iter(self._roots.values())

    def seed(self, ns: Hashable) -> bytes:
        """The hash-chain seed of namespace ``ns`` (its root must exist)."""
        return self._seeds[ns]

    def _reclaim(self, root: Node) -> None:
        """Forget an empty namespace: no nodes, no dropped subtree below and no handle on its
        root (``pins`` counts the handles that matched nothing in it), so an empty namespace
        costs nothing once its last handle is gone (one-off tenant salts)."""
        empty = not root.children and not self._reclaim_blocked(root)
        if empty and root.pins == 0 and self._roots.get(root.ns) is root:
            del self._roots[root.ns]
            del self._seeds[root.ns]
            root.alive = False
            if self._last_root is root:
                self._last_root = None  # (a one-off namespace's root is not kept)

    # ---------------------------------------------------------------- keys

    def _child_key(self, tokens: list[int], pos: int) -> Any:
        p = self.page_size
        return tokens[pos] if p == 1 else tuple(tokens[pos : pos + p])

    # ---------------------------------------------------------------- match / insert

    def peek(self, ns: Hashable, tokens: list[int], n: int) -> int:
        """Tokens of ``tokens[:n]`` (``n`` page-aligned) the tree holds for ``ns``, in whole
        pages; changes nothing (no split, no recency stamp, no pin)."""
        self._check_owner()
        node = self._roots.get(ns)
        pos = 0
        p = self.page_size
        while node is not None and pos < n:
            child = node.children.get(tokens[pos] if p == 1 else tuple(tokens[pos : pos + p]))
            if child is None:
                break
            same = common_len(child.key, tokens, pos, n - pos)
            pos += same - same % p
            node = child if same == len(child.key) else None
        return pos

    def match(
        self,
        ns: Hashable,
        tokens: list[int],
        n: int,
        *,
        pin: bool = False,
        unchecked: bool = False,
        tag: str | None = None,
    ) -> tuple[Node, int]:
        """Longest cached prefix of ``tokens[:n]`` (``n`` page-aligned) in namespace ``ns``.

        Splits the last node so that the match ends on a node boundary, stamps the path as
        recently used (and pins it if ``pin``) and returns ``(last_node, matched_tokens)``.
        The root means no match (a namespace without one gets it, seeded from ``tag``).
        ``unchecked``: the items of ``tokens`` are still to be checked; the walk checks what
        it matches (:func:`int_common_len`) and the rest is checked before anything changes.

        Raises:
            InvalidTypeError / InvalidInputError: with ``unchecked``, an item of ``tokens``
                is not an int in ``[0, 2**63)`` (nothing changed).
        """
        if _get_ident() != self._owner:  # _check_owner, inline: every request matches
            self._check_owner()
        node = self._last_root
        if node is None or node.ns is not ns or not node.alive:
            node = self._roots.get(ns)
            if node is None:
                if unchecked:
                    check_token_ints(tokens)
                    unchecked = False
                node = self.root(ns, tag)
            self._last_root = node
        p = self.page_size
        clock = self._clock + 1
        got = self._pin_match(node, p, tokens, n, clock) if pin else None
        if got is not None:  # the common match, one C call: walk, token check, pin, stamp
            node, pos, dev, host = got
            self._clock = clock
            self.dev_evictable -= dev
            self.dev_protected += dev
            if host:
                self.host_evictable -= host
                self.host_protected += host
            return node, pos
        walk = pathwalk.descend(node, p, tokens, n, False)
        if walk is None:  # an int subclass the C walk does not compare: walk exact ints
            tokens = fastcheck.exact_ints(tokens)  # (no code of the caller's runs)
            walk = pathwalk.descend(node, p, tokens, n, False)
            if walk is None:  # (anything else it refuses: the checking walk)
                walk = pathwalk.py_descend(node, p, tokens, n, False)
        node, pos, split, same, _ = walk
        # what the walk matched are ints equal to cached keys; the rest: check_token_ints,
        # whose passing case (one C pass) is inline
        if unchecked and fastcheck.first_bad_token(tokens, pos + same) >= 0:
            check_token_ints(tokens, pos + same)  # raises, naming the item
        common = same - same % p  # the child's first page matched its dict key: >= p
        if split is not None and common:
            node = self._split(split, common)
            pos += common
        self._clock = clock
        if pin:
            self.pin(node, clock)  # stamps in the same walk
        else:
            self._stamp(node, clock)
        return node, pos

    def plan_insert(
        self, ns: Hashable, tokens: list[int], n: int, *, skip: int = 0, unchecked: bool = False
    ) -> InsertPlan:
        """Walk ``tokens[:n]`` (page-aligned) as :meth:`insert` will, changing nothing.

        The plan says which nodes the insert passes and which device pages the tree holds for
        the leading part (``plan.device_pages()``, from page ``skip`` on: a caller that passes
        no pages for the first ``skip`` has nothing to compare them with), so a caller can
        check the pages it is about to hand over.  Apply it with ``insert(..., plan=plan)``
        before anything else changes the tree.  ``unchecked``: the items of ``tokens`` are
        still to be checked (as :meth:`match` checks them).

        Raises:
            InvalidTypeError / InvalidInputError: with ``unchecked``, an item of ``tokens``
                is not an int in ``[0, 2**63)``.
        """
        p = self.page_size
        node = self._last_root
        if node is None or node.ns is not ns or not node.alive:
            node = self._roots.get(ns)
            if node is not None:
                self._last_root = node
        plan = InsertPlan(node)
        if node is None:
            if unchecked:
                plan.key = _checked_key(tokens, 0, 0, n)
            return plan
        walk = pathwalk.descend(node, p, tokens, n, True)
        if walk is None:  # an int subclass the C walk does not compare: walk exact ints
            tokens = fastcheck.exact_ints(tokens)  # (the new key is made of them too)
            walk = pathwalk.descend(node, p, tokens, n, True)
            if walk is None:  # (anything else it refuses: the checking walk)
                walk = pathwalk.py_descend(node, p, tokens, n, True)
        _, pos, split, same, steps = walk
        assert steps is not None, "a plan's walk lists its steps"
        plan.steps = steps
        existing = plan.existing
        have = 0  # pages of the leading device run so far
        on_device = True
        for child in steps:
            if child.device is ABSENT:
                on_device = False
                break
            k = len(child.key) // p
            if have + k > skip:
                dp = child.device_pages
                assert dp is not None, f"device pages missing on {child!r}"
                existing.append(dp if have >= skip else dp[skip - have :])
            have += k
        common = same - same % p  # the child's first page matched its dict key: >= p
        if split is not None and common:
            plan.split = split
            plan.common = common
            k = common // p
            if on_device and split.device is not ABSENT:
                sp = split.device_pages
                assert sp is not None, f"device pages missing on {split!r}"
                if have + k > skip:
                    existing.append(sp[max(skip - have, 0) : k])
                have += k
            pos += common
            same -= common
        plan.existing_pages = have
        if unchecked:  # what the walk matched are ints equal to cached keys
            # (_checked_key's passing case, inline: every insert makes a new leaf's key)
            key = fastcheck.checked_key(tokens, pos + same, pos, n) if pos < n else None
            plan.key = key if type(key) is list else _checked_key(tokens, pos + same, pos, n)
        plan.pos = pos
        return plan

    def insert(
        self,
        ns: Hashable,
        tokens: list[int],
        n: int,
        pages: np.ndarray | torch.Tensor,
        *,
        pin: bool = True,
        plan: InsertPlan | None = None,
        first_page: int = 0,
    ) -> InsertOutcome:
        """Insert ``tokens[:n]`` (page-aligned) whose device pages are ``pages``.

        Ranges the tree already holds on device keep the tree's pages (the caller compares
        them with ``pages`` to find duplicates); host-only ranges adopt the given pages.  The
        walk stops after the nodes a load-back in flight fills: ``inserted_tokens`` says how far
        it got, and the pages after that are not taken.  ``plan`` is this insert's
        :meth:`plan_insert`, made since the tree last changed (else the walk is done here).
        ``pages`` may leave out the leading ``first_page`` pages, if the tree has them on
        device (``plan.device_pages()``): only pages the tree takes need be passed.  The
        nodes keep int64 arrays (a tensor is read as its array, shared).
        """
        if _get_ident() != self._owner:  # _check_owner, inline: every request inserts
            self._check_owner()
        if not isinstance(pages, np.ndarray):
            pages = pages.numpy()
        if plan is None:
            plan = self.plan_insert(ns, tokens, n)
        p = self.page_size
        node = self.root(ns) if plan.root is None else plan.root
        out = InsertOutcome(node, 0)
        self._clock += 1
        clock = self._clock
        pos = 0
        base = first_page * p
        assert first_page <= plan.existing_pages, (
            f"first_page {first_page} past the tree's device run of {plan.existing_pages}"
        )
        passed = plan.steps
        if plan.split is not None:
            assert plan.split.parent is (passed[-1] if passed else node), "stale insert plan"
            passed = [*passed, self._split(plan.split, plan.common)]
        for child in passed:
            klen = len(child.key)
            if child.device is ABSENT:  # host-only: adopt the caller's pages
                self._acct(child, -1)
                child.device_pages = pages[(pos - base) // p : (pos + klen - base) // p]
                self._set_device(child, RESIDENT, accounted=True)
                # the model computed these pages whole, components the host copy lacks too
                child.device_complete = bool(child.invalid)
                out.adopted.append(child)
            node = child
            pos += klen
        out.prefix_tokens = pos
        if pos < n and (node.device is not FILLING or node.parent is None):
            # fresh device-only leaf: the device transition ABSENT->RESIDENT, inlined
            key = plan.key
            assert key is None or len(key) == n - pos, "stale insert plan key"
            new = Node(tokens[pos:n] if key is None else key, node, ns)
            new.last_access = clock
            a, b = (pos - base) // p, (n - base) // p
            # the common case, a caller that passed just the new pages, takes no slice
            new.device_pages = pages if a == 0 and b == pages.shape[0] else pages[a:b]
            new.device = RESIDENT
            node.children[tokens[pos] if p == 1 else tuple(tokens[pos : pos + p])] = new
            node.n_dev_children += 1
            self.num_nodes += 1
            self.dev_evictable += (n - pos) // p
            if self.tenants is not None:
                self._acct_tenant(self.tenants, new, 1)
            if not pin:
                self._dev_heap.offer(new)
            out.created.append(new)
            node = new
            pos = n
        out.node = node
        out.inserted_tokens = pos
        if pin:
            self.pin(node, clock)  # stamps in the same walk
        else:
            self._stamp(node, clock)
        return out

    def grow(
        self,
        ns: Hashable,
        tokens: list[int],
        n: int,
        pages: np.ndarray,
        skip: int,
        anchor: Node | None,
    ) -> Node | None:
        """The common insert, one C call (:func:`pathwalk.grow`): ``tokens[:n]``
        (page-aligned) whose first ``skip`` pages are whole nodes on device, on the path to
        ``anchor`` (when ``skip`` > 0), and whose other pages, ``pages`` (int64 ids: all of
        them new, none the tree holds), become one new leaf, pinned and stamped as
        :meth:`insert` pins it.  Returns the leaf, or ``None`` with nothing changed where
        :meth:`plan_insert` and :meth:`insert` must run instead: any other shape (a split,
        a host-only node, one still loading, tokens the tree holds past ``skip`` pages), a
        namespace root the tree has not looked up last, tenants being counted, or a token
        that is not an exact int in ``[0, 2**30)``.
        """
        if _get_ident() != self._owner:  # _check_owner, inline: every request inserts
            self._check_owner()
        root = self._last_root
        if root is None or root.ns is not ns or not root.alive or self.tenants is not None:
            return None
        clock = self._clock + 1
        got = pathwalk.grow(root, self.page_size, tokens, n, skip, anchor, pages, clock, ns)
        if got is None:
            return None
        leaf, pos, dev, host = got
        self._clock = clock
        self.num_nodes += 1
        # the leaf's pages are evictable, then its pin protects them with the path's
        self.dev_evictable += (n - pos) // self.page_size - dev
        self.dev_protected += dev
        if host:
            self.host_evictable -= host
            self.host_protected += host
        return leaf

    def device_prefix(self, ns: Hashable, tokens: list[int], n: int) -> np.ndarray:
        """Device pages the tree holds for the leading part of ``tokens[:n]``, read-only
        (those of :meth:`plan_insert`)."""
        return self.plan_insert(ns, tokens, n).device_pages()

    def split_at(self, node: Node, at: int) -> Node:
        """Split ``node`` after ``at`` tokens (page-aligned); return the new head."""
        self._check_owner()
        return self._split(node, at)

    def _split(self, child: Node, at: int) -> Node:
        """Split ``child`` after ``at`` tokens; return the new prefix node (child's parent)."""
        assert 0 < at < len(child.key), f"split at {at} outside (0, {len(child.key)})"
        assert at % self.page_size == 0, f"split at {at} not page aligned ({self.page_size})"
        parent = child.parent
        assert parent is not None, "cannot split a root"
        pg = at // self.page_size
        head = Node(child.key[:at], parent, child.ns)
        head.device = child.device
        head.host = child.host
        head.storage = child.storage
        head.cpu_hidden = child.cpu_hidden
        head.invalid = child.invalid
        head.device_complete = child.device_complete
        head.pins = child.pins
        head.host_pins = child.host_pins
        head.last_access = child.last_access
        head.hit_count = child.hit_count
        self._inherit_retention(head, child)
        if child.device_pages is not None:
            head.device_pages = child.device_pages[:pg]
            child.device_pages = child.device_pages[pg:]
        if child.host_pages is not None:
            head.host_pages = child.host_pages[:pg]
            child.host_pages = child.host_pages[pg:]
        if child.hashes is not None:
            head.hashes = keep(child.hashes[:pg])
            child.hashes = keep(child.hashes[pg:])
        child.key, child.start = keep(child.key[at:]), child.start + at
        parent.children[self._child_key(head.key, 0)] = head
        head.children[self._child_key(child.key, 0)] = child
        head.n_dev_children = 1 if child.device is not ABSENT else 0
        child.parent = head
        self.num_nodes += 1
        head.op = child.op
        head.backup = child.backup
        if self._on_split is not None and (
            child.op is not None or child.backup is not None or child.storage is RESIDENT
        ):  # work in flight, or the storage tier's index of stored pages
            self._on_split(head, child)
        # page totals and classes are unchanged: head has child's state, pages were divided
        return head

    def attach_host_only(
        self, ns: Hashable, tokens: list[int], n: int, start: int, host_pages: torch.Tensor
    ) -> list[Node]:
        """Attach host-resident pages for ``tokens[start:n]`` below an existing prefix.

        Used when pages arrive from storage.  Ranges the tree already holds are skipped;
        returns the new nodes (their pages are slices of ``host_pages``).
        """
        self._check_owner()
        node, matched = self.match(ns, tokens, n)
        assert matched >= start, f"attach at {start} but tree only has {matched} tokens"
        if matched >= n:
            return []
        p = self.page_size
        new = Node(tokens[matched:n], node, ns)
        new.host_pages = host_pages[(matched - start) // p : (n - start) // p]
        node.children[self._child_key(tokens, matched)] = new
        self.num_nodes += 1
        new.last_access = node.last_access
        new.storage = RESIDENT  # it came from there
        self._set_host(new, RESIDENT)
        return [new]

    # ---------------------------------------------------------------- hashes

    def block_hashes(self, node: Node) -> list[bytes]:
        """Chained page hashes (32 bytes each) of ``node`` (computed on first use, then kept)."""
        if node.hashes is None:
            parent = node.parent
            assert parent is not None, "roots have no block hashes"
            prev = self._seeds[node.ns] if parent.parent is None else self.block_hashes(parent)[-1]
            node.hashes = keep(chain_hashes(prev, node.key, self.page_size))
        return node.hashes

    def parent_hash(self, node: Node) -> bytes | None:
        """Hash of the page before ``node`` (``None`` when its parent is a root)."""
        parent = node.parent
        assert parent is not None, "roots have no parent hash"
        return None if parent.parent is None else self.block_hashes(parent)[-1]

    # ---------------------------------------------------------------- introspection

    def walk(self) -> Iterator[Node]:
        """Every non-root node, parents before children."""
        stack = [c for r in self._roots.values() for c in r.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def path(self, node: Node) -> list[Node]:
        """Nodes from the root's child down to ``node`` (empty for a root)."""
        out: list[Node] = []
        while node.parent is not None:
            out.append(node)
            node = node.parent
        out.reverse()
        return out

    def check_invariants(
        self, handle_pins: dict[int, int] | None = None, host_pins: dict[int, int] | None = None
    ) -> None:
        """Recompute every counter and check every structural invariant; raise on breach.

        ``handle_pins`` maps ``id(node)`` to the number of live handles ending at that node;
        when given, every node's pin count must equal the handles in its subtree.
        ``host_pins`` does the same for the hard host pins (``node.host_pins``).
        """
        p = self.page_size
        counts = {"de": 0, "dp": 0, "he": 0, "hp": 0}
        nodes = 0
        pins_below: dict[int, int] = {}
        order = list(self.walk())
        under = self.check_detached()  # detached subtrees: by id of the parent of their top
        live = len(order)
        for node in order + list(self.walk_detached()):
            nodes += 1
            parent = node.parent
            assert parent is not None and node.alive == (nodes <= live), f"bad node {node!r}"
            assert self.detached.get(id(node)) is node or (
                parent.children.get(self._child_key(node.key, 0)) is node
            ), f"bad link {node!r}"
            check_node(node, p)
            if node.device is not ABSENT:
                assert parent.device is not ABSENT, f"device not prefix-closed {node!r}"
            filling = node.host is FILLING or node.device is FILLING
            backing_up = node.storage is FILLING
            ndc = sum(1 for c in node.children.values() if c.device is not ABSENT)
            ndc += sum(1 for c in under.get(id(node), ()) if c.device is not ABSENT)
            assert node.n_dev_children == ndc, f"n_dev_children {node.n_dev_children}!={ndc}"
            busy = node.pins > 0 or filling
            n = len(node.key) // p
            if node.device is not ABSENT:
                counts["dp" if busy else "de"] += n
            if node.host is not ABSENT:
                counts["hp" if busy or backing_up or node.host_pins else "he"] += n
            elif node.host_pins:
                raise AssertionError(f"host pin on a node not on host {node!r}")
        assert nodes == self.num_nodes, f"num_nodes {self.num_nodes} != {nodes}"
        got = {
            "de": self.dev_evictable,
            "dp": self.dev_protected,
            "he": self.host_evictable,
            "hp": self.host_protected,
        }
        assert got == counts, f"page accounting {got} != recomputed {counts}"
        last = self._last_root
        assert last is None or (last.alive and self._roots.get(last.ns) is last), (
            f"the cached root {last!r} is not its namespace's"
        )
        for root in self._roots.values():
            assert root.device is RESIDENT and root.alive, f"root state changed {root!r}"
            assert root.children or root.pins or id(root) in under, f"empty ns kept {root!r}"
            if handle_pins is not None:
                want = handle_pins.get(id(root), 0)
                assert root.pins == want, f"root pins {root.pins} != handles {want} {root!r}"
            ndc = sum(1 for c in root.children.values() if c.device is not ABSENT)
            ndc += sum(1 for c in under.get(id(root), ()) if c.device is not ABSENT)
            assert root.n_dev_children == ndc, f"root n_dev_children {root.n_dev_children}!={ndc}"
        if handle_pins is not None:
            for node in reversed(order + list(self.walk_detached())):
                below = handle_pins.get(id(node), 0) + sum(
                    pins_below.get(id(c), 0)
                    for c in [*node.children.values(), *under.get(id(node), ())]
                )
                pins_below[id(node)] = below
                assert node.pins == below, f"pins {node.pins} != live handles {below} {node!r}"
        if host_pins is not None:
            check_host_pins(order, host_pins)
        self._check_retention(order)


__all__ = ["Eviction", "InsertOutcome", "RadixTree", "Tier", "TierState"]
