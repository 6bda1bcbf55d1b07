"""The common insert and the common match in one C call each (``pathwalk.grow``,
``RadixTree.grow``; ``pathwalk.pin_match`` in ``RadixTree.match``): the C paths against the
Python references on random trees, and a cache that takes them against one that never does
(every insert through ``plan_insert`` + ``insert``, every match through the walk and
``pin``), request by request."""

from __future__ import annotations

import gc
import random
from typing import Any

import numpy as np
import pytest
import torch

import aiocache_kv as akv
from aiocache_kv.testing import ManualCopyEngine
from aiocache_kv.tree import pathwalk
from aiocache_kv.tree.node import ABSENT, FILLING, RESIDENT, Node
from aiocache_kv.tree.radix import RadixTree
from tests.conftest import small_config
from tests.test_insert_prefix import tree_state
from tests.test_pathwalk import Tok, _ext


def shape(node: Node) -> tuple[Any, ...]:
    """Everything grow may touch, below and at ``node``, children in key order."""
    pages = None if node.device_pages is None else tuple(node.device_pages.tolist())
    kids = sorted(node.children.items(), key=lambda kv: repr(kv[0]))
    return (
        tuple(node.key),
        node.device.name,
        node.host.name,
        node.pins,
        node.last_access,
        node.n_dev_children,
        pages,
        node.ns,
        tuple((k, shape(c)) for k, c in kids),
    )


def stamps(cache: akv.HiCache) -> list[tuple[tuple[int, ...], int]]:
    """Each node's tokens from its root and its recency stamp (``last_access``)."""
    tree = cache._core.tree
    return sorted(
        (tuple(t for n in tree.path(node) for t in n.key), node.last_access) for node in tree.walk()
    )


def grow_tree(seed: int, p: int) -> tuple[RadixTree, list[list[int]], list[Node]]:
    """A real tree of random sequences (shared prefixes, splits, big ints made afresh), some
    nodes pinned, some loading back (device FILLING), some host-only (device ABSENT): the
    same tree for the same seed."""
    rng = random.Random(seed)
    tree = RadixTree(p)
    alphabet = [1, 2, 3, 2**40 + 1]
    seqs: list[list[int]] = []
    page = 0
    for _ in range(rng.randint(1, 10)):
        base = list(rng.choice(seqs)) if seqs and rng.random() < 0.7 else []
        seq = base[: rng.randrange(len(base) + 1)]
        seq += [rng.choice(alphabet) for _ in range(rng.randint(1, 4) * p)]
        seq = [int(str(t)) for t in seq]  # fresh objects: identity never decides alone
        n = len(seq) // p * p
        plan = tree.plan_insert("ns", seq, n)
        new = np.arange(page, page + (n - plan.pos) // p, dtype=np.int64)
        page += new.size
        tree.insert("ns", seq, n, new, pin=False, plan=plan, first_page=plan.pos // p)
        seqs.append(seq[:n])
    nodes = [n for n in tree.walk() if n.parent is not None]
    for node in nodes:
        r = rng.random()
        if r < 0.1:
            node.device = FILLING
        elif r < 0.2:
            node.device, node.host = ABSENT, RESIDENT
        elif r < 0.3:
            node.pins += 1
    return tree, seqs, nodes


def grow_query(rng: random.Random, seqs: list[list[int]], p: int) -> list[Any]:
    """A stored sequence's prefix (often cut at a page boundary) and new tokens; sometimes
    a token grow does not take (a big int, a bool, an int subclass, a negative int)."""
    base = list(rng.choice(seqs))
    q = base[: rng.randrange(len(base) + 1) // p * p]
    q += [rng.choice([1, 2, 3, 7, 9]) for _ in range(rng.randint(0, 3) * p + rng.randrange(p))]
    q = [int(str(t)) for t in q]
    if q and rng.random() < 0.3:
        q[rng.randrange(len(q))] = rng.choice([True, Tok(2), 2**40 + 1, -1, 2**30])
    return q


@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_grow_c_path_agrees_with_the_reference(page_size: int) -> None:
    """The same random tree twice, the same query: the C grow and the reference return the
    same (leaf key, pos, dev, host) or both ``None``, and leave the same tree (nodes, states,
    pins, stamps, pages, children); a ``None`` leaves the tree as it was."""
    ext = _ext()
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    grown = refused = 0
    for trial in range(400):
        a, seqs, nodes_a = grow_tree(seed + trial, page_size)
        b, _, nodes_b = grow_tree(seed + trial, page_size)
        before = shape(a.root("ns"))
        for _ in range(3):
            q = grow_query(rng, seqs, page_size)
            n = len(q) // page_size * page_size
            walk = pathwalk.py_descend(b.root("ns"), page_size, q, n, False)
            skip = walk[1] // page_size if rng.random() < 0.8 else rng.randrange(n // page_size + 1)
            r, pick = rng.random(), rng.randrange(len(nodes_a))
            if r < 0.55:  # the prefix's own node, the end of the walk, in each tree
                ends = pathwalk.py_descend(a.root("ns"), page_size, q, n, False)[0], walk[0]
                anchors: tuple[Node | None, Node | None] = ends
            elif r < 0.65:
                anchors = (None, None)
            else:  # any node: its path may or may not lead there
                anchors = (nodes_a[pick], nodes_b[pick])
            pages = np.arange(1000, 1000 + (n - skip * page_size) // page_size, dtype=np.int64)
            clock = rng.randrange(1, 10**6)
            args = (page_size, q, n, skip, pages, clock)
            got = ext.grow(a.root("ns"), *args[:4], anchors[0], *args[4:], "ns")
            want = pathwalk.py_grow(b.root("ns"), *args[:4], anchors[1], *args[4:], "ns")
            where = f"seed {seed} trial {trial}: q={q} skip={skip}"
            assert (got is None) == (want is None), where
            if got is None:
                refused += 1
                assert shape(a.root("ns")) == before, where
                continue
            grown += 1
            assert got[0].key == want[0].key and got[1:] == want[1:], where
            assert got[0].device_pages is pages and got[0].last_access == clock, where
            assert not gc.is_tracked(got[0].key), where  # ints only: out of the GC's view
            assert shape(a.root("ns")) == shape(b.root("ns")), where
            before = shape(a.root("ns"))
    assert grown > 100 and refused > 200, (seed, grown, refused)


@pytest.mark.parametrize("page_size", [1, 4])
def test_tree_grow_keeps_the_counts_on_unpinned_paths(page_size: int) -> None:
    """``RadixTree.grow`` below nodes no handle pins (a bare tree): the leaf and the path
    its pin protects move between the evictable and protected counts as ``insert`` moves
    them, and every invariant holds after each grow and after unpinning it again."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    p = page_size
    for trial in range(60):
        tree, seqs, _ = grow_tree(seed + trial, p)
        for node in list(tree.walk()):  # only what grow takes: whole device nodes, unpinned
            node.device, node.host, node.pins = RESIDENT, ABSENT, 0
        page = 10_000
        for _ in range(5):
            q = grow_query(rng, seqs, p)
            q = [t if type(t) is int and 0 <= t < 2**30 else 4 for t in q]
            n = len(q) // p * p
            end, pos = tree.match("ns", q, n)
            if pos >= n:
                continue
            pages = np.arange(page, page + (n - pos) // p, dtype=np.int64)
            leaf = tree.grow("ns", q, n, pages, pos // p, end if pos else None)
            where = f"seed {seed} trial {trial}: {q}"
            assert leaf is not None and leaf.pins == 1, where
            page += pages.size
            seqs.append(q[:n])
            tree.check_invariants()
            tree.unpin(leaf)
            tree.check_invariants()


@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_pin_match_c_path_agrees_with_the_reference(page_size: int) -> None:
    """The same random tree twice, the same query: the C match and the reference return the
    same (node, pos, dev, host) or both ``None``, and leave the same tree (pins, stamps); a
    ``None`` (a miss, a split, a token not plain) leaves the tree as it was."""
    ext = _ext()
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    hit = refused = 0
    for trial in range(300):
        a, seqs, _ = grow_tree(seed + trial, page_size)
        b, _, _ = grow_tree(seed + trial, page_size)
        for _ in range(3):
            before = shape(a.root("ns"))
            q = grow_query(rng, seqs, page_size)
            n = len(q) // page_size * page_size
            clock = rng.randrange(1, 10**6)
            got = ext.pin_match(a.root("ns"), page_size, q, n, clock)
            want = pathwalk.py_pin_match(b.root("ns"), page_size, q, n, clock)
            where = f"seed {seed} trial {trial}: q={q}"
            assert (got is None) == (want is None), where
            if got is None:
                refused += 1
                assert shape(a.root("ns")) == before, where
                continue
            hit += 1
            assert got[0].key == want[0].key and got[1:] == want[1:], where
            assert got[0].pins >= 1 and got[0].last_access == clock, where
            assert shape(a.root("ns")) == shape(b.root("ns")), where
    assert hit > 80 and refused > 150, (seed, hit, refused)


def test_pin_match_refuses_what_is_not_a_match() -> None:
    """Malformed arguments raise before anything changes."""
    ext = _ext()
    tree = RadixTree(2)
    tree.insert("ns", [1, 2, 3, 4], 4, np.arange(2, dtype=np.int64), pin=False)
    root = tree.root("ns")
    child = next(iter(root.children.values()))
    before = shape(root)
    for bad, exc in (
        ((child, 2, [1, 2, 3, 4], 4, 1), ValueError),
        ((root, 2, [1, 2, 3], 3, 1), ValueError),
        ((root, 2, [1, 2], 4, 1), ValueError),
        ((root, 2, (1, 2), 2, 1), TypeError),
        ((root, 2, [1, 2], 2, 1.0), TypeError),
        ((object(), 2, [1, 2], 2, 1), TypeError),
        ((root, 2, [1, 2], 2), TypeError),
    ):
        with pytest.raises(exc):
            ext.pin_match(*bad)
        assert shape(root) == before
    got = ext.pin_match(root, 2, [1, 2, 3, 4, 9], 4, 7)
    assert got is not None and got[0] is child and got[1:] == (4, 2, 0) and child.pins == 1


def test_grow_makes_leaves_as_the_node_class_does() -> None:
    """A leaf grow makes in C (from the prototype's slots, no ``__init__``) holds in every
    slot what ``Node(key, parent, ns)`` and the insert's own settings give it, with a fresh
    children dict and its key out of the GC's view; ``prototype`` refuses a node whose slot
    holds something nodes must not share."""
    ext = _ext()
    tree = RadixTree(2)
    tree.insert("ns", [1, 2, 3, 4], 4, np.arange(2, dtype=np.int64), pin=False)
    root = tree.root("ns")
    pages = np.arange(7, 9, dtype=np.int64)
    top = next(iter(root.children.values()))
    got = ext.grow(root, 2, [1, 2, 3, 4, 5, 6, 7, 8], 8, 2, top, pages, 11, "ns")
    assert got is not None
    leaf, parent = got[0], got[0].parent
    want = Node([5, 6, 7, 8], parent, "ns")
    want.last_access, want.device_pages, want.device, want.pins = 11, pages, RESIDENT, 1
    for name in Node.__slots__:
        if name not in ("__weakref__", "children", "device_pages"):
            assert getattr(leaf, name) == getattr(want, name), name
            assert type(getattr(leaf, name)) is type(getattr(want, name)), name
    assert leaf.device_pages is pages
    assert leaf.children == {} and leaf.children is not parent.children
    assert not gc.is_tracked(leaf.key) and gc.is_tracked(leaf)
    odd = Node([], None, None)
    odd.hashes = []  # a list: every node would share it
    with pytest.raises(TypeError, match="hashes"):
        ext.prototype(odd)
    other = ext.grow(root, 2, [1, 2, 3, 4, 9, 9], 6, 2, top, pages[:1], 12, "ns")
    assert other is not None and other[0].hashes is None  # the prototype still stands


def test_grow_refuses_what_is_not_an_insert() -> None:
    """Malformed arguments raise before anything changes: not a root, unaligned or too many
    tokens, a token tuple, a float clock, an anchor that is not a node."""
    ext = _ext()
    tree = RadixTree(2)
    tree.insert("ns", [1, 2, 3, 4], 4, np.arange(2, dtype=np.int64), pin=False)
    root = tree.root("ns")
    child = next(iter(root.children.values()))
    pages = np.arange(1, dtype=np.int64)
    before = shape(root)
    good = (root, 2, [5, 6], 2, 0, None, pages, 1, "ns")
    assert ext.grow(*good) is not None  # the same arguments, well formed, do grow
    tree2 = RadixTree(2)
    tree2.insert("ns", [1, 2, 3, 4], 4, np.arange(2, dtype=np.int64), pin=False)
    root2 = tree2.root("ns")
    before = shape(root2)
    for bad, exc in (
        ((child, 2, [1, 2, 3, 4, 5, 6], 6, 2, None, pages, 1, "ns"), ValueError),
        ((root2, 2, [5, 6, 7], 3, 0, None, pages, 1, "ns"), ValueError),
        ((root2, 2, [5, 6], 4, 0, None, pages, 1, "ns"), ValueError),
        ((root2, 2, (5, 6), 2, 0, None, pages, 1, "ns"), TypeError),
        ((root2, 2, [5, 6], 2, 0, None, pages, 1.0, "ns"), TypeError),
        ((root2, 2, [5, 6], 2, 0, "node", pages, 1, "ns"), TypeError),
        ((root2, 0, [5, 6], 2, 0, None, pages, 1, "ns"), ValueError),
        ((object(), 2, [5, 6], 2, 0, None, pages, 1, "ns"), TypeError),
        ((root2, 2, [5, 6], 2, 0, None, pages, 1), TypeError),
    ):
        with pytest.raises(exc):
            ext.grow(*bad)
        assert shape(root2) == before


@pytest.mark.parametrize(("host_pages", "impl"), [(0, "c"), (24, "c"), (24, "python")])
async def test_a_cache_that_grows_matches_one_that_never_does(
    host_pages: int, impl: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two caches, the same requests (prefix inserts after a match, inserts chained on the
    previous result, plain inserts, evictions to host and back): one takes grow wherever it
    can, the other never (every insert through plan_insert + insert).  Results, trees,
    allocator counts and KV events agree after every request, and invariants hold.  Grow in
    C, or the reference (as where the extension is not built)."""
    if impl == "python":
        monkeypatch.setattr(pathwalk, "grow", pathwalk.py_grow)
        monkeypatch.setattr(pathwalk, "pin_match", pathwalk.py_pin_match)
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    prompts = [[rng.randrange(5) for _ in range(rng.randrange(1, 20))] for _ in range(12)]
    cfg = small_config(device_pages=40, host_pages=host_pages)
    ea, eb = ManualCopyEngine(), ManualCopyEngine()
    async with (
        akv.HiCache(cfg, copy_engine=ea) as a,
        akv.HiCache(cfg, copy_engine=eb) as b,
    ):
        tree = a._core.tree
        real = tree.grow
        took = [0]

        def counting(*args: Any) -> Node | None:
            got = real(*args)
            took[0] += got is not None
            return got

        tree.grow = counting  # type: ignore[method-assign]
        b._core.tree.grow = lambda *args: None  # type: ignore[method-assign]
        fast = [0]
        real_match = tree._pin_match

        def counting_match(*args: Any) -> Any:
            got = real_match(*args)
            fast[0] += got is not None
            return got

        tree._pin_match = counting_match
        b._core.tree._pin_match = lambda *args: None
        for i in range(150):
            base = rng.choice(prompts)
            toks = base[: rng.randrange(len(base) + 1)]
            toks += [rng.randrange(5) for _ in range(rng.randrange(0, 9))]
            if not toks:
                continue
            prompts.append(toks)
            where = f"seed {seed} request {i}: {toks}"
            results = []
            for cache in (a, b):
                m = cache.match_prefix(toks)
                new = len(toks) - m.device_len
                own = cache.alloc(new)
                dev, aligned = m.device_len, len(toks) // 2 * 2
                half = dev + new // 4 * 2
                kind = i % 4 if half else 0
                kind = 2 if kind == 3 and half == dev else kind  # no chunk of ours to retain
                if kind == 0:
                    r = cache.insert(toks, own[:new], prefix=m)
                elif kind == 1:
                    r = cache.insert(toks, torch.cat([m.device_indices, own[:new]]))
                elif kind == 3:  # another request stores the chunk first: ours is retained
                    m2 = cache.match_prefix(toks[:half])
                    own2 = cache.alloc(half - m2.device_len)
                    cache.release(cache.insert(toks[:half], own2, prefix=m2))
                    cache.release(m2)
                    r0 = cache.insert(toks[:half], own[: half - dev], prefix=m)
                    assert r0.retained_pages.numel(), where
                    r = cache.insert(toks, own[half - dev : new], prefix=r0)
                    cache.release(r0)
                else:  # a chunk first, then the rest on its result
                    r0 = cache.insert(toks[:half], own[: half - dev], prefix=m)
                    r = cache.insert(toks, own[half - dev : new], prefix=r0)
                    cache.release(r0)
                results.append((r.prefix_len, r.inserted_len, r.uncached_len))
                if own.numel() > aligned - dev:  # the unaligned tail's page stays ours
                    cache.free(own[aligned - dev :])
                cache.release(r)
                cache.release(m)
            assert results[0] == results[1], where
            if i % 5 == 4:
                for cache, eng in ((a, ea), (b, eb)):
                    eng.complete_all()
                    await cache.flush()
            assert tree_state(a) == tree_state(b), where
            assert stamps(a) == stamps(b), where  # the same clock, the same recency
            assert [repr(e) for e in a.take_events()] == [repr(e) for e in b.take_events()]
            a.check_invariants()
            b.check_invariants()
    assert took[0] > 30, f"seed {seed}: grow took {took[0]} inserts only"
    assert fast[0] > 30, f"seed {seed}: pin_match took {fast[0]} matches only"
