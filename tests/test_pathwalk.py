"""The walks up a node's path (pin and stamp, unpin, run lengths): the C path against the
Python reference, on random paths in every tier state."""

from __future__ import annotations

import copy
import functools
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from aiocache_kv.tree import pathwalk
from aiocache_kv.tree.node import ABSENT, FILLING, RESIDENT, Node

STATES = (ABSENT, FILLING, RESIDENT)
FIELDS = ("pins", "last_access", "host_pins", "device", "host", "storage")


def _ext() -> Any:
    if pathwalk.PATHWALK_IMPL != "c":
        pytest.skip("the C extension is not built")  # test_the_c_path_is_built fails then
    from aiocache_kv.tree import _pathwalk

    return _pathwalk


def test_the_c_path_is_built() -> None:
    """CI builds the extension (``pip install -e .`` with gcc): the fast path must be there,
    or every request silently takes the slower reference."""
    assert pathwalk.PATHWALK_IMPL == "c"


def random_path(rng: random.Random, page_size: int) -> list[Node]:
    """A root and a chain of nodes below it, each in random tier states, pin counts, key
    lengths (whole pages), children counts and corrupt flags."""
    root = Node([], None, "ns")
    root.device = root.host = RESIDENT
    path = [root]
    for _ in range(rng.randint(1, 6)):
        node = Node([7] * page_size * rng.randint(1, 4), path[-1], "ns")
        node.device, node.host, node.storage = (rng.choice(STATES) for _ in range(3))
        node.pins = rng.choice((0, 0, 1, 2, 5))
        node.host_pins = rng.choice((0, 0, 1))
        node.n_dev_children = rng.choice((0, 0, 1, 3))
        node.corrupt = rng.random() < 0.15
        node.last_access = rng.randrange(100)
        if rng.random() < 0.3:
            node.children[1] = Node([1] * page_size, node, "ns")
        path[-1].children[len(path)] = node
        path.append(node)
    return path


def state_of(path: list[Node]) -> list[tuple[object, ...]]:
    return [tuple(getattr(n, f) for f in FIELDS) for n in path]


def run_both(
    path: list[Node], call: Callable[[Any, Node], object], impl_c: Any, impl_py: Any
) -> tuple[object, object, list[Node], list[Node]]:
    """``call`` on the C and the Python function, each on its own deep copy of ``path``;
    errors are returned as their types."""
    out = []
    for impl in (impl_c, impl_py):
        mine = copy.deepcopy(path)
        try:
            got: object = call(impl, mine[-1])
        except AssertionError:
            got = AssertionError
        if isinstance(got, tuple) and isinstance(got[2] if len(got) > 2 else None, list):
            got = (got[0], got[1], [mine.index(n) for n in got[2]])  # positions, not objects
        out.append((got, mine))
    return out[0][0], out[1][0], out[0][1], out[1][1]


def test_pin_unpin_and_lens_agree_with_the_reference() -> None:
    ext = _ext()
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    seen_unpinned = seen_error = 0
    for trial in range(2000):
        p = rng.choice((1, 4, 16))
        path = random_path(rng, p)
        where = f"seed {seed} trial {trial}"
        clock = rng.choice((None, rng.randrange(1000, 2000)))
        pin = functools.partial(lambda f, n, p, clock: f(n, p, clock), p=p, clock=clock)
        c, py, mc, mpy = run_both(path, pin, ext.pin_path, pathwalk.py_pin_path)
        assert c == py, where
        assert state_of(mc) == state_of(mpy), where
        unpin = functools.partial(lambda f, n, p: f(n, p), p=p)
        c, py, mc, mpy = run_both(path, unpin, ext.unpin_path, pathwalk.py_unpin_path)
        assert c == py, where
        assert state_of(mc) == state_of(mpy), where
        seen_error += c is AssertionError
        seen_unpinned += isinstance(c, tuple) and c[2] is not None
        c, py, _, _ = run_both(path, lambda f, n: f(n), ext.path_lens, pathwalk.py_path_lens)
        assert c == py, where
    assert seen_unpinned and seen_error, f"seed {seed}: no unpin reached 0 or none failed"


def test_unpin_reports_the_nodes_that_may_be_victims() -> None:
    """Only nodes left without a pin, and of those only the ones a victim heap could take
    (a device leaf of the device tier, a childless device-absent node): the rest are never
    offered, which is what ``tiers.unpin`` relies on."""
    impls = [pathwalk.py_unpin_path]
    if pathwalk.PATHWALK_IMPL == "c":
        impls.append(_ext().unpin_path)
    for unpin in impls:
        root = Node([], None, "ns")
        mid = Node([1, 2], root, "ns")
        leaf = Node([3, 4], mid, "ns")
        mid.device = leaf.device = RESIDENT
        mid.n_dev_children = 1
        mid.pins, leaf.pins = 2, 1
        dev, host, victims = unpin(leaf, 2)
        assert (dev, host, victims) == (1, 0, [leaf])  # mid keeps a pin: not unpinned
        assert (mid.pins, leaf.pins) == (1, 0)
        dev, host, victims = unpin(mid, 2)
        assert (dev, victims) == (1, [])  # unpinned, but a device child keeps it no victim
        leaf.pins = 1
        with pytest.raises(AssertionError, match="unpin of unpinned"):
            unpin(leaf, 2)  # mid has no pin left


def test_the_c_walks_refuse_what_is_not_a_node() -> None:
    ext = _ext()
    with pytest.raises(TypeError):
        ext.pin_path(object(), 1, None)
    with pytest.raises(TypeError):
        ext.unpin_path("node", 1)
    with pytest.raises(TypeError):
        ext.path_lens(None)
    root = Node([], None, "ns")
    node = Node([1], root, "ns")
    with pytest.raises(ValueError):
        ext.pin_path(node, 0, None)
    with pytest.raises(TypeError):
        ext.pin_path(node, 1, 1.5)  # a clock is an int
    node.key = (1,)  # type: ignore[assignment]
    with pytest.raises(TypeError):
        ext.pin_path(node, 1, None)
    assert node.pins == 0


class Tok(int):
    """An int subclass token: comparing it could run code, so the C walk hands it back."""


def _walk_tree(rng: random.Random, page_size: int) -> tuple[Any, Node, list[list[int]]]:
    """A real tree of random sequences over a small alphabet (shared prefixes, splits), some
    tokens big ints made afresh (equal values, other objects), some nodes still loading."""
    from aiocache_kv.tree.radix import RadixTree

    tree = RadixTree(page_size)
    alphabet = [1, 2, 3, 2**40 + 1, 2**40 + 2]
    seqs = []
    for _ in range(rng.randint(1, 12)):
        base = list(rng.choice(seqs)) if seqs and rng.random() < 0.7 else []
        cut = rng.randrange(len(base) + 1)
        seq = base[:cut] + [rng.choice(alphabet) for _ in range(rng.randint(1, 5) * page_size)]
        seq = [int(str(t)) for t in seq]  # fresh objects: identity never decides alone
        n = len(seq) // page_size * page_size
        if n:
            tree.insert("ns", seq, n, np.arange(n // page_size, dtype=np.int64), pin=False)
            seqs.append(seq[:n])
    root = tree.root("ns")
    stack = [root]
    while stack:  # some nodes loading: a plan's walk stops below them
        node = stack.pop()
        stack.extend(node.children.values())
        if node.parent is not None and rng.random() < 0.15:
            node.device = FILLING
    return tree, root, seqs


def _query(rng: random.Random, seqs: list[list[int]], page_size: int) -> list[Any]:
    """A stored sequence's prefix with a random tail; sometimes an item that is not an
    exact int (a bool, an int subclass, a str, a float) somewhere in it."""
    base = list(rng.choice(seqs)) if seqs else []
    q = base[: rng.randrange(len(base) + 1)]
    q += [rng.choice([1, 2, 3, 2**40 + 1, 4]) for _ in range(rng.randint(0, 3) * page_size)]
    q = [int(str(t)) for t in q]
    if q and rng.random() < 0.4:
        q[rng.randrange(len(q))] = rng.choice([True, Tok(2), "x", 2.0, Tok(2**40 + 1)])
    return q


@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_descend_c_path_agrees_with_the_reference(page_size: int) -> None:
    """On random trees and queries (both walk kinds): the C walk returns the reference's
    nodes, lengths and steps (the same objects), and hands back (``None``) only a query that
    holds an item that is not an exact int."""
    ext = _ext()
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    compared = fallbacks = 0
    for _ in range(300):
        _, root, seqs = _walk_tree(rng, page_size)
        for _ in range(10):
            q = _query(rng, seqs, page_size)
            n = len(q) // page_size * page_size
            plan = rng.random() < 0.5
            got = ext.descend(root, page_size, q, n, plan)
            if got is None:
                fallbacks += 1
                assert any(type(t) is not int for t in q[:n]), f"seed {seed}: {q}"
                continue
            want = pathwalk.py_descend(root, page_size, q, n, plan)
            assert got[0] is want[0] and got[2] is want[2], f"seed {seed}: {q} plan={plan}"
            assert got[1:4:2] == want[1:4:2], f"seed {seed}: {q} plan={plan}"
            if plan:
                assert [id(s) for s in got[4]] == [id(s) for s in want[4]], f"seed {seed}"
            else:
                assert got[4] is None and want[4] is None
            compared += 1
    assert compared > 1000 and fallbacks > 20, (compared, fallbacks)


def test_descend_refuses_what_is_not_a_walk() -> None:
    """Malformed arguments raise (nothing walked): a token tuple, a non-node, no bind."""
    ext = _ext()
    root = Node([], None, "ns")
    with pytest.raises(TypeError):
        ext.descend(root, 1, (1, 2), 2, False)
    with pytest.raises(TypeError):
        ext.descend(object(), 1, [1, 2], 2, False)
    with pytest.raises(ValueError):
        ext.descend(root, 0, [1, 2], 2, False)
    assert ext.descend(root, 1, [1, 2], 2, True) == (root, 0, None, 0, [])


@pytest.mark.parametrize("impl", ["c", "python"])
def test_tree_walks_agree_with_a_model(impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random inserts and matches on a real tree, the walk down in C or the reference (as
    where the extension is not built): every match and every insert plan covers the longest
    page-aligned prefix any inserted sequence shares with the query, and the tree stays
    consistent (splits included)."""
    from aiocache_kv.tree.radix import RadixTree

    if impl == "python":
        monkeypatch.setattr(pathwalk, "descend", pathwalk.py_descend)
    else:
        _ext()
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    for p in (1, 2, 4):
        tree = RadixTree(p)
        stored: list[list[int]] = []
        page = 0
        for _ in range(200):
            base = rng.choice(stored) if stored and rng.random() < 0.8 else []
            q = base[: rng.randrange(len(base) + 1)]
            q += [rng.choice((5, 6, 2**40)) for _ in range(rng.randint(0, 3) * p)]
            n = len(q) // p * p

            def shared(s: list[int], q: list[int] = q, n: int = n, p: int = p) -> int:
                k = next((i for i in range(min(len(s), n)) if s[i] != q[i]), min(len(s), n))
                return k - k % p

            want = max((shared(s) for s in stored), default=0)
            if rng.random() < 0.5:
                _, got = tree.match("ns", q, n, unchecked=True)
                assert got == want, f"seed {seed} p={p}: match {got} != {want}"
            elif n:
                plan = tree.plan_insert("ns", q, n, unchecked=True)
                assert plan.pos == want, f"seed {seed} p={p}: plan {plan.pos} != {want}"
                fresh = np.arange(page, page + (n - want) // p, dtype=np.int64)
                page += fresh.size
                tree.insert("ns", q, n, fresh, pin=False, plan=plan, first_page=want // p)
                stored.append(q[:n])
            if stored:  # a match on no tree leaves an empty root behind, reclaimed later
                tree.check_invariants()
