"""``StoredPages``: page hash -> node, weakly, one reference per remembered node.

Dead nodes must leave (else the table grows with every page ever stored), a hash that a
later node took over must stay with that node, and the garbage collector (which may run on
any thread) must never change the table itself: the loop sweeps on its next call.
"""

from __future__ import annotations

import gc
import random
import threading

import pytest

from aiocache_kv.storage.stored_pages import SWEEP_STEP, StoredPages
from aiocache_kv.tree import Node


def cyclic_node(tag: int) -> Node:
    """A node in a reference cycle with its parent, as tree nodes are: only the cyclic
    collector frees it."""
    root = Node([], None, "ns")
    node = Node([tag], root, "ns")
    root.children[tag] = node
    return node


def test_remember_pop_and_death() -> None:
    table = StoredPages()
    a = cyclic_node(1)
    table.remember(a, [10, 11, 12])
    assert len(table) == 3
    assert table.pop(11) is a and table.pop(11) is None
    del a
    gc.collect()
    assert table.pop(10) is None  # dead: nothing to mark
    assert len(table) == 0


def test_a_hash_taken_over_stays_with_the_later_node() -> None:
    table = StoredPages()
    a, b = cyclic_node(1), cyclic_node(2)
    table.remember(a, [1, 2])
    table.remember(b, [2, 3])
    del a
    gc.collect()
    assert len(table) == 2  # 1 went with a; 2 is b's now
    assert table.pop(2) is b and table.pop(3) is b


def test_the_collector_on_another_thread_only_queues() -> None:
    table = StoredPages()
    nodes = [cyclic_node(i) for i in range(50)]
    for i, n in enumerate(nodes):
        table.remember(n, [i * 10 + k for k in range(4)])
    del nodes, n
    worker = threading.Thread(target=gc.collect)
    worker.start()
    worker.join()
    assert len(table._by_hash) == 200  # untouched until the loop's next call
    assert len(table) == 0 and not table._given


@pytest.mark.parametrize("limit", [0, 1000])
def test_seeded_churn_matches_a_plain_model(limit: int) -> None:
    """Random remembers (nodes remembered again, hashes taken over), pops, deaths and
    missing-page reports against a dict of strong references with dead nodes filtered out
    and a set of orphaned claims (the limit is never reached: which claims it drops first
    among those one death orphaned is not specified; the unit tests below pin it).  The
    nodes are not in cycles here, so each dies the moment the test drops it."""
    seed = 1234 + limit
    rng = random.Random(seed)
    table = StoredPages(orphan_limit=limit)
    live: dict[int, Node] = {}  # tag -> node the test keeps alive
    model: dict[int, int] = {}  # hash -> tag of the node that holds it
    orphans: set[int] = set()
    for step in range(2000):
        op = rng.random()
        if op < 0.4 or not live:
            tag = rng.randrange(40)
            if tag not in live:
                live[tag] = Node([tag], None, "ns")
            hashes = [rng.randrange(300) for _ in range(rng.randrange(1, 6))]
            table.remember(live[tag], hashes)
            model.update(dict.fromkeys(hashes, tag))
            orphans.difference_update(hashes)  # claimed by a live node again
        elif op < 0.6:
            h = rng.randrange(300)
            tag = model.pop(h, None)
            orphans.discard(h)
            assert table.pop(h) is (None if tag is None else live[tag]), f"seed {seed} step {step}"
        elif op < 0.75:
            asked = [rng.randrange(300) for _ in range(rng.randrange(1, 8))]
            there = [rng.random() < 0.5 for _ in asked]
            want = []
            for h, t in zip(asked, there, strict=True):
                if not t and h in orphans:
                    orphans.remove(h)
                    want.append(h)
            assert table.take_missing(asked, there) == want, f"seed {seed} step {step}"
        else:
            tag = rng.choice(sorted(live))
            del live[tag]
            dead = [h for h, t in model.items() if t == tag]
            model = {h: t for h, t in model.items() if t != tag}
            if limit:
                orphans.update(dead)
        assert len(table) == len(model), f"seed {seed} step {step}"
        assert table.orphans == len(orphans), f"seed {seed} step {step}"
    live.clear()
    assert len(table) == 0 and not table._given, f"seed {seed}"


def test_a_dead_nodes_pages_stay_claimed_until_found_missing() -> None:
    table = StoredPages(orphan_limit=4)
    a, b = cyclic_node(1), cyclic_node(2)
    table.remember(a, [1, 2, 3])
    table.remember(b, [3, 4])  # 3 is b's now: still tracked by a live node when a dies
    del a
    gc.collect()
    assert table.orphans == 2  # 1 and 2
    assert table.take_missing([1, 2, 3, 4], [True, False, False, False]) == [2]
    assert table.take_missing([2], [False]) == []  # retracted once
    assert table.pop(1) is None and table.orphans == 0  # a backend's own report wins
    del b
    gc.collect()
    assert table.orphans == 2
    assert table.take_missing([4, 3], [False, False]) == [4, 3]  # in the order asked


def test_orphaned_claims_keep_the_newest_within_the_limit() -> None:
    table = StoredPages(orphan_limit=3)
    for i in range(3):
        node = cyclic_node(i)
        table.remember(node, [i * 10, i * 10 + 1])
        del node
        gc.collect()
    assert table.orphans == 3
    assert table.take_missing([0, 1, 10, 11, 20, 21], [False] * 6) == [11, 20, 21]


def test_without_a_limit_nothing_is_kept() -> None:
    table = StoredPages()
    node = cyclic_node(1)
    table.remember(node, [1, 2])
    del node
    gc.collect()
    assert table.orphans == 0 and table.take_missing([1, 2], [False, False]) == []


def test_a_node_that_left_the_tree_counts_before_it_is_collected() -> None:
    table = StoredPages(orphan_limit=4)
    a = cyclic_node(1)
    table.remember(a, [1, 2])
    assert table.take_missing([1, 2], [False, False]) == []  # in the tree: not orphaned
    a.alive = False  # removed from the tree, not yet collected (a cycle)
    assert table.take_missing([1, 2], [False, True]) == [1]
    del a
    gc.collect()
    assert table.orphans == 1  # 2 only: 1 was retracted already
    assert table.take_missing([1, 2], [False, False]) == [2]


def test_a_claim_taken_back_as_missing_leaves_no_entry_of_a_node_out_of_the_tree() -> None:
    """Found by an adversarial round: a page claimed by a node that died (an orphan) and then
    by a second node of the same tokens that left the tree but was not collected yet was
    taken back once from the orphans only; the second node's entry kept claiming it, so
    every later snapshot announced it in STORAGE again."""
    table = StoredPages(orphan_limit=8)
    first = Node([1], None, "ns")
    table.remember(first, [7, 8])
    del first  # collected: 7 and 8 are orphaned claims
    assert table.orphans == 2
    second = Node([1], None, "ns")
    table.remember(second, [7, 8])  # the same pages claimed again
    assert table.orphans == 0
    second.alive = False  # left the tree, still referenced (a handle the caller keeps)
    assert table.take_missing([7, 8], [False, True]) == [7]
    assert not table.claims_page(7) and table.claims_page(8)
    assert [run.hashes[i] for run, idx in table.claims() for i in idx] == [8]


def test_a_remember_drops_at_most_a_step_of_dead_nodes_and_readers_see_them_gone() -> None:
    """After an eviction of many nodes the next backup's ``remember`` drops only
    ``SWEEP_STEP`` of their entries (the rest wait for later calls), a prefetch's
    ``take_missing`` with events off drops none (nothing to retract), and every reader
    still sees the dead nodes gone: ``len``, ``pop`` and ``claims`` drop the rest first."""
    table = StoredPages()
    nodes = [Node([t], None, "ns") for t in range(3 * SWEEP_STEP)]
    for t, node in enumerate(nodes):
        table.remember(node, [2 * t, 2 * t + 1])
    del node
    nodes.clear()  # every one dies at once (no cycles here)
    assert table.take_missing([0, 2], [False, False]) == []
    assert len(table._dead) == 3 * SWEEP_STEP  # untouched by the prefetch
    keep = Node([999], None, "ns")
    table.remember(keep, [1000])
    assert len(table._dead) == 2 * SWEEP_STEP  # one step dropped, the rest queued
    assert len(table._by_hash) == 1 + 2 * 2 * SWEEP_STEP
    assert table.pop(5) is None  # a dead node's page: nothing to mark
    assert not table._dead and len(table) == 1 and table.pop(1000) is keep
    assert table.claims() == []
