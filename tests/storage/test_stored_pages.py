"""``StoredPages``: page hash -> node, weakly, one reference per remembered node.

Dead nodes must leave (else the table grows with every page ever stored), a hash that a
later node took over must stay with that node, and the garbage collector (which may run on
any thread) must never change the table itself: the loop sweeps on its next call.
"""

from __future__ import annotations

import gc
import random
import threading

from aiocache_kv.storage.stored_pages import StoredPages
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


def test_seeded_churn_matches_a_plain_model() -> None:
    """Random remembers (nodes remembered again, hashes taken over), pops and deaths
    against a dict of strong references with dead nodes filtered out.  The nodes are not in
    cycles here, so each dies the moment the test drops it."""
    seed = 1234
    rng = random.Random(seed)
    table = StoredPages()
    live: dict[int, Node] = {}  # tag -> node the test keeps alive
    model: dict[int, int] = {}  # hash -> tag of the node that holds it
    for step in range(2000):
        op = rng.random()
        if op < 0.45 or not live:
            tag = rng.randrange(40)
            if tag not in live:
                live[tag] = Node([tag], None, "ns")
            hashes = [rng.randrange(300) for _ in range(rng.randrange(1, 6))]
            table.remember(live[tag], hashes)
            model.update(dict.fromkeys(hashes, tag))
        elif op < 0.7:
            h = rng.randrange(300)
            tag = model.pop(h, None)
            assert table.pop(h) is (None if tag is None else live[tag]), f"seed {seed} step {step}"
        else:
            tag = rng.choice(sorted(live))
            del live[tag]
            model = {h: t for h, t in model.items() if t != tag}
        assert len(table) == len(model), f"seed {seed} step {step}"
    live.clear()
    assert len(table) == 0 and not table._given, f"seed {seed}"
