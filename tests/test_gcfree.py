"""The tree's int lists (node keys, page hashes) are out of the cyclic collector's view, so a
collection never walks the cached tokens."""

from __future__ import annotations

import gc

import pytest
import torch

from aiocache_kv import gcfree
from aiocache_kv.tree.radix import RadixTree


def _c() -> None:
    if gcfree.GCFREE_IMPL != "c":  # a failure in CI: conftest.py
        pytest.skip("aiocache_kv._gcfree not built (pip install -e . builds it)")


def test_keep_untracks_only_lists_of_ints() -> None:
    _c()
    ints = list(range(1000))
    assert gc.is_tracked(ints)
    assert gcfree.keep(ints) is ints and not gc.is_tracked(ints)
    assert ints == list(range(1000))  # untouched, and freed by reference counting as usual
    mixed: list[object] = [1, [2]]
    gcfree.keep(mixed)  # type: ignore[arg-type]
    assert gc.is_tracked(mixed)  # may hold a cycle: stays tracked

    class Big(int): ...

    subclassed: list[int] = [1, Big(2)]
    gcfree.keep(subclassed)
    assert gc.is_tracked(subclassed)


def test_node_keys_and_hashes_stay_untracked_through_splits() -> None:
    _c()
    tree = RadixTree(2)
    tree.root("ns", "tag")
    toks = list(range(100, 164))
    tree.insert("ns", toks, 64, torch.arange(32), pin=False)
    other = toks[:20] + list(range(900, 944))  # splits the first node at 20 tokens
    tree.insert("ns", other, 64, torch.arange(32, 64), pin=False)
    nodes = list(tree.walk())
    assert len(nodes) == 3
    for node in nodes:
        tree.block_hashes(node)
        assert not gc.is_tracked(node.key), node
        assert node.hashes is not None and not gc.is_tracked(node.hashes), node
    tree.match("ns", toks[:10] + [7] * 54, 64)  # splits again at 10 tokens
    for node in tree.walk():
        assert not gc.is_tracked(node.key), node
        assert node.hashes is None or not gc.is_tracked(node.hashes), node
    tree.check_invariants()


@pytest.mark.parametrize("p", [1, 4])
async def test_an_inserts_new_key_is_made_untracked_in_the_check(p: int) -> None:
    """Through ``HiCache.insert`` the new leaf's key comes from the walk's token check
    (``fastcheck.checked_key``): untracked, also when a token was a ``bool`` (an int
    subclass, made an exact int before the walk: ``fastcheck.exact_ints``)."""
    _c()
    from aiocache_kv import HiCache
    from tests.conftest import small_config

    async with HiCache(small_config(page_size=p)) as cache:
        toks = list(range(300, 300 + 8 * p))
        r = cache.insert(toks, cache.alloc(len(toks)))
        assert r.node.key == toks and not gc.is_tracked(r.node.key)
        cache.release(r)
        more: list[int] = [*toks, *range(900, 900 + 4 * p)]
        more[8 * p + 1] = True  # a bool in the part after the cached prefix
        m = cache.match_prefix(toks)
        r2 = cache.insert(more, cache.alloc(4 * p), prefix=m)
        assert r2.node.key == more[8 * p :] and not gc.is_tracked(r2.node.key)
        assert {type(t) for t in r2.node.key} == {int} and more[8 * p + 1] is True
        cache.release(r2)
        cache.release(m)
        cache.check_invariants()
