"""RadixTree unit tests: structure, splits, namespaces, exact LRU order, accounting, owner."""

from __future__ import annotations

import hashlib
import random
import threading
from types import ModuleType

import numpy as np
import pytest
import torch

from aiocache_kv.errors import InvalidInputError, OwnershipError
from aiocache_kv.tree import RadixTree, TierState, hashing
from aiocache_kv.tree.hashing import MAX_TOKEN_ID, chain_hashes, namespace_seed, py_chain_hashes

NS = "ns"


def pages(start: int, n: int) -> torch.Tensor:
    return torch.arange(start, start + n)


def keys(tree: RadixTree) -> list[list[int]]:
    return sorted(n.key for n in tree.walk())


def test_insert_match_and_split_page_size_2() -> None:
    t = RadixTree(2)
    out = t.insert(NS, [1, 2, 3, 4], 4, pages(0, 2), pin=False)
    assert out.prefix_tokens == 0 and len(out.created) == 1
    out = t.insert(NS, [1, 2, 5, 6, 7], 4, pages(2, 2), pin=False)  # tail 7 is not cached
    assert out.prefix_tokens == 2
    assert keys(t) == [[1, 2], [3, 4], [5, 6]]
    node, n = t.match(NS, [1, 2, 3, 4, 9, 9], 6)
    assert n == 4 and node.key == [3, 4]
    node, n = t.match(NS, [1, 3], 2)  # first page differs
    assert n == 0 and node.parent is None
    t.check_invariants()


def test_match_splits_inside_a_node_on_page_boundary() -> None:
    t = RadixTree(2)
    t.insert(NS, [1, 2, 3, 4, 5, 6], 6, pages(0, 3), pin=False)
    node, n = t.match(NS, [1, 2, 3, 4, 0, 0], 6)
    assert n == 4 and node.key == [3, 4] if False else node.key == [1, 2, 3, 4]
    assert keys(t) == [[1, 2, 3, 4], [5, 6]]
    # a mismatch inside a page rounds down to the page start
    node, n = t.match(NS, [1, 2, 3, 9], 4)
    assert n == 2 and node.key == [1, 2]
    assert isinstance(node.device_pages, np.ndarray)  # the tree keeps arrays, not tensors
    assert node.device_pages.tolist() == pages(0, 1).tolist()
    t.check_invariants()


def test_split_divides_pages_and_hashes() -> None:
    t = RadixTree(1)
    t.insert(NS, [7, 8, 9], 3, pages(10, 3), pin=False)
    whole = t.block_hashes(next(iter(t.walk())))
    t.insert(NS, [7, 8, 1], 3, pages(20, 3), pin=False)
    head = t.root(NS).children[7]
    tail = head.children[9]
    assert head.device_pages is not None and tail.device_pages is not None
    assert head.device_pages.tolist() == [10, 11] and tail.device_pages.tolist() == [12]
    assert t.block_hashes(head) + t.block_hashes(tail) == whole
    assert t.parent_hash(tail) == whole[1]
    t.check_invariants()


def test_namespaces_never_share_nodes() -> None:
    t = RadixTree(1)
    t.insert("a", [1, 2, 3], 3, pages(0, 3), pin=False)
    _node, n = t.match("b", [1, 2, 3], 3)
    assert n == 0
    t.insert("b", [1, 2, 3], 3, pages(3, 3), pin=False)
    a = t.root("a").children[1]
    b = t.root("b").children[1]
    assert a is not b
    assert t.block_hashes(a) != t.block_hashes(b)


def test_hashes_are_stable_and_chained() -> None:
    seed = namespace_seed("model-x")
    assert seed == namespace_seed("model-x")  # no per-process salt (never Python hash())
    h = chain_hashes(seed, [1, 2, 3, 4], 2)
    assert len(h) == 2
    assert chain_hashes(h[0], [3, 4], 2) == [h[1]]
    assert chain_hashes(seed, [1, 2, 3, 5], 2)[0] == h[0]
    assert chain_hashes(seed, [1, 2, 3, 5], 2)[1] != h[1]


def _reference_chain(prev: bytes, tokens: list[int], page_size: int) -> list[bytes]:
    """The published definition, written out with hashlib: BLAKE2b-256(prev || int64 LE)."""
    out = []
    for i in range(0, len(tokens), page_size):
        data = prev + b"".join(
            t.to_bytes(8, "little", signed=True) for t in tokens[i : i + page_size]
        )
        prev = hashlib.blake2b(data, digest_size=32).digest()
        out.append(prev)
    return out


def test_hash_values_are_pinned() -> None:
    """The published values (events, storage keys, trailers): a change here invalidates
    stored pages."""
    seed = namespace_seed("model-x")
    assert seed == hashlib.blake2b(b"model-x", digest_size=32).digest()
    assert seed.hex() == "56b9d1e13ee7c1068f8af215efcb9ba244153f1eef11e5994a3ef7a4894e5394"
    for impl in (chain_hashes, py_chain_hashes):
        got = impl(seed, [1, 2, 3, 4], 2)
        assert [h.hex() for h in got] == [
            "6565e6a02b77757027c41d0f3f4fb7658e983a694ecedaca4c56bbc0b580c174",
            "dbd6b5c8ccbda6c52ebb69a88ecc97aa7b600205ea3c8998be13043152c77364",
        ]
        assert got == _reference_chain(seed, [1, 2, 3, 4], 2)
        last = impl(seed, list(range(7)), 1)[-1]
        assert last.hex() == "0f53c072b8148409d18bf9861d2e9b41d299187246dfc96bf5278fe14d7218f3"
        short = impl(seed, [MAX_TOKEN_ID, 0, 5], 16)  # a short page
        assert [h.hex() for h in short] == [
            "f5af1519110d07cec1418660f844f5a0c99966ad03e009b10edc6cb454ed267b"
        ]
        assert short == _reference_chain(seed, [MAX_TOKEN_ID, 0, 5], 16)


def test_page_hashes_are_full_width_bytes() -> None:
    """A page's identity is 32 bytes: no 64-bit value a birthday search could collide."""
    seed = namespace_seed("m")
    hashes = chain_hashes(seed, list(range(64)), 16)
    assert all(type(h) is bytes and len(h) == 32 for h in hashes)
    assert len(set(hashes)) == 4


def _ext() -> ModuleType:
    """The C extension; skipped where it was not built (a failure in CI: conftest.py)."""
    if hashing._EXT is None:
        pytest.skip("aiocache_kv.tree._chainhash not built (pip install -e . builds it)")
    return hashing._EXT


def test_c_extension_is_the_one_in_use() -> None:
    ext = _ext()
    assert hashing.HASH_IMPL == "c" and hashing._impl is ext.chain_hashes


def test_c_blake2b_matches_hashlib_at_block_edges() -> None:
    ext = _ext()
    rng = random.Random(0)
    for n in [0, 1, 7, 8, 9, 16, 120, 127, 128, 129, 136, 255, 256, 257, 1000, 4096]:
        data = rng.randbytes(n)
        assert ext.blake2b_256(data) == hashlib.blake2b(data, digest_size=32).digest(), n


def test_c_and_python_chains_agree() -> None:
    ext = _ext()
    rng = random.Random(1)
    for page_size in [1, 2, 3, 12, 15, 16, 17, 64]:
        for n in [0, 1, page_size, 3 * page_size, 5 * page_size + 1]:
            tokens = [rng.choice([0, 1, MAX_TOKEN_ID, rng.randrange(1 << 63)]) for _ in range(n)]
            prev = rng.choice([bytes(32), b"\xff" * 32, rng.randbytes(32)])
            want = py_chain_hashes(prev, tokens, page_size)
            assert want == _reference_chain(prev, tokens, page_size)
            assert ext.chain_hashes(prev, tokens, page_size) == want
            assert ext.chain_hashes(prev, tuple(tokens), page_size) == want
            kw = ext.chain_hashes(prev=prev, tokens=tokens, page_size=page_size)
            assert kw == want


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ((-1, [1], 1), InvalidInputError),
        ((0, [1], 1), InvalidInputError),
        ((bytes(31), [1], 1), InvalidInputError),
        ((bytes(33), [1], 1), InvalidInputError),
        ((bytearray(32), [1], 1), InvalidInputError),
        ((bytes(32), [1 << 63], 1), OverflowError),
        ((bytes(32), [1.5], 1), TypeError),
        ((bytes(32), [1], 0), ValueError),
    ],
)
def test_chain_hashes_rejects_what_it_cannot_encode(
    args: tuple[object, list[int], int], error: type[Exception]
) -> None:
    impls = [py_chain_hashes] if hashing._EXT is None else [py_chain_hashes, chain_hashes]
    for impl in impls:
        with pytest.raises(error):
            impl(*args)  # type: ignore[arg-type]


def test_device_eviction_order_is_lru_exact() -> None:
    t = RadixTree(1)
    t.insert(NS, [1, 2], 2, pages(0, 2), pin=False)  # a
    t.insert(NS, [3, 4], 2, pages(2, 2), pin=False)  # b
    t.insert(NS, [5, 6], 2, pages(4, 2), pin=False)  # c
    t.match(NS, [1, 2], 2)  # a is now the most recent
    order = []
    for _ in range(3):
        ev = t.evict_device(1)
        order.append(ev.nodes[0].key)
    assert order == [[3, 4], [5, 6], [1, 2]]
    assert t.num_nodes == 0
    t.check_invariants()


def test_parent_becomes_victim_after_children() -> None:
    t = RadixTree(1)
    t.insert(NS, [1, 2, 3], 3, pages(0, 3), pin=False)
    t.insert(NS, [1, 2, 4], 3, pages(3, 3), pin=False)
    t.match(NS, [1, 2, 3], 3)
    ev = t.evict_device(3)
    assert [n.key for n in ev.nodes] == [[4], [3], [1, 2]]
    t.check_invariants()


def test_pinned_nodes_are_protected() -> None:
    t = RadixTree(1)
    out = t.insert(NS, [1, 2, 3], 3, pages(0, 3), pin=True)
    assert (t.dev_evictable, t.dev_protected) == (0, 3)
    assert t.evict_device(10).num_pages == 0
    t.unpin(out.node)
    assert (t.dev_evictable, t.dev_protected) == (3, 0)
    assert t.evict_device(10).num_pages == 3
    t.check_invariants()


def test_demote_keeps_host_copy_and_host_eviction_removes_leaves() -> None:
    t = RadixTree(1)
    out = t.insert(NS, [1, 2], 2, pages(0, 2), pin=False)
    node = out.node
    t.begin_host_fill(node, pages(100, 2), op="op")
    assert t.evict_device(10).num_pages == 0  # write in flight: not a victim
    t.end_host_fill(node, ok=True)
    ev = t.evict_device(10)
    assert ev.num_pages == 2 and node.alive and node.device is TierState.ABSENT
    _, n = t.match(NS, [1, 2], 2)
    assert n == 2  # still matchable from host
    ev = t.evict_host(1)
    assert ev.num_pages == 2 and not node.alive
    t.check_invariants()


def test_device_victim_without_host_copy_drops_host_only_subtree() -> None:
    t = RadixTree(1)
    t.insert(NS, [1, 2, 3], 3, pages(0, 3), pin=False)
    t.insert(NS, [1, 2, 4], 3, pages(3, 3), pin=False)
    leaf = t.root(NS).children[1].children[4]
    t.begin_host_fill(leaf, pages(50, 1), op="op")
    t.end_host_fill(leaf, ok=True)
    t.evict_device(2)  # both leaves; [4] only demoted
    assert leaf.alive and leaf.device is TierState.ABSENT
    ev = t.evict_device(2)  # [1, 2] has no host copy: goes with its host-only child
    assert [n.key for n in ev.nodes] == [[1, 2]] and [n.key for n in ev.host_nodes] == [[4]]
    assert t.num_nodes == 0
    t.check_invariants()


def test_mutation_from_another_thread_raises() -> None:
    t = RadixTree(1)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            t.insert(NS, [1], 1, pages(0, 1), pin=False)
        except BaseException as exc:
            errors.append(exc)

    th = threading.Thread(target=worker)
    th.start()
    th.join()
    assert len(errors) == 1 and isinstance(errors[0], OwnershipError)
    assert t.num_nodes == 0


def test_heap_stays_bounded_under_repeated_access() -> None:
    t = RadixTree(1)
    for i in range(20):
        t.insert(NS, [i, i + 100], 2, pages(2 * i, 2), pin=False)
    for _ in range(500):
        for i in range(20):
            node, _ = t.match(NS, [i, i + 100], 2)
            t.pin(node)
            t.unpin(node)
    assert len(t._dev_heap) <= 4 * t.num_nodes + 64 + 20


def test_invariant_check_catches_corruption() -> None:
    t = RadixTree(1)
    out = t.insert(NS, [1, 2], 2, pages(0, 2), pin=False)
    out.node.pins = 3
    with pytest.raises(AssertionError):
        t.check_invariants()


def test_check_node_names_each_illegal_state() -> None:
    from aiocache_kv.tree.node import FILLING, RESIDENT, Node, check_node

    root = Node([], None, "ns")

    def node(**kw: object) -> Node:
        n = Node([1, 2, 3, 4], root, "ns")
        n.device = RESIDENT
        n.device_pages = np.array([0, 1])
        for k, v in kw.items():
            setattr(n, k, v)
        return n

    check_node(node(), 2)
    bad = {
        "unaligned key": {"key": [1, 2, 3]},
        "device pages mismatch": {"device_pages": torch.tensor([0])},
        "stale host pages": {"host_pages": torch.tensor([0, 1])},
        "host filling without device copy": {
            "device": FILLING,
            "host": FILLING,
            "host_pages": torch.tensor([2, 3]),
        },
        "op/state mismatch": {"op": object()},
        "backup/state mismatch": {"storage": FILLING},
    }
    for message, kw in bad.items():
        with pytest.raises(AssertionError, match=message):
            check_node(node(**kw), 2)


def test_root_lookup_cache_follows_reclaims_and_equal_namespaces() -> None:
    """The tree remembers the root it found last, by identity: an equal namespace made
    afresh finds the same root, a root reclaimed (its namespace emptied) is never served
    again, and the next match makes a new one."""
    from aiocache_kv.namespace import Namespace

    tree = RadixTree(1)
    a, b = Namespace("m", "t"), Namespace("m", "t")  # equal, two objects
    other = Namespace("m", "u")
    tree.insert(a, [1, 2, 3], 3, np.arange(3, dtype=np.int64), pin=False)
    assert tree.match(b, [1, 2, 3, 4], 3)[1] == 3  # b is not the cached object: same root
    node, got = tree.match(other, [1, 2, 3], 3, pin=True)
    assert got == 0 and node is not tree.root(a)  # another namespace: its own root
    tree.unpin(node)  # (reclaimed: empty)
    assert tree.match(a, [1, 2], 2)[1] == 2
    tree.check_invariants()
    first = tree.root(a)
    assert tree.evict_device(3).num_pages == 3  # no host copy: deleted, the root emptied
    assert not first.alive  # reclaimed with the namespace's last node
    node, got = tree.match(a, [1, 2, 3], 3, pin=True)
    assert got == 0 and node is not first and node.alive  # a new root, not the dead one
    tree.unpin(node)  # the last pin of an empty namespace: reclaimed too
    assert not node.alive
    tree.check_invariants()
    again, _ = tree.match(b, [1], 1, pin=True)
    assert again is not node and again.alive
    tree.unpin(again)
    tree.check_invariants()
