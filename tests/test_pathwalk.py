"""The walks up a node's path (pin and stamp, unpin, run lengths): the C path against the
Python reference, on random paths in every tier state."""

from __future__ import annotations

import copy
import functools
import random
from collections.abc import Callable
from typing import Any

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
