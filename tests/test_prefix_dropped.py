"""``insert(tokens, slots, prefix=h)`` after ``h``'s pages left the tree: ``PrefixDroppedError``.

A request matched (or inserted) a prefix and computes its suffix; meanwhile the prefix leaves
the tree: an operator's ``drop`` detaches it (``tree/detach.py``), or a node the request's
insert stopped at while it was loading back fails its verification at load-back (or its copy).
The caller did nothing wrong, so the refusal is not an ``InvalidInputError`` about its slots:
it is ``PrefixDroppedError`` naming the tokens and why, and nothing changes (no page taken, no
pin added or lost, the slots stay the caller's).  An insert whose skipped tokens all survived
goes through, and a caller's own mistake is still ``InvalidInputError``.
"""

from __future__ import annotations

import asyncio
from contextlib import nullcontext

import numpy as np
import pytest
import torch

import aiocache_kv as akv
from aiocache_kv.errors import InvalidInputError, PrefixDroppedError
from aiocache_kv.testing import ManualCopyEngine
from tests.conftest import small_config
from tests.test_cache import read_kv
from tests.test_drop import settle
from tests.test_split_ack import insert, write_kv

A = [1, 2, 3, 4, 5, 6]  # three pages of 2
TAIL = [7, 8, 9, 10]


def state(cache: akv.HiCache) -> tuple[object, ...]:
    """What a refused insert must leave as it was: every node, live or detached (tokens from
    its root, tier states, pages, pins, liveness), the allocators' page states and counts."""
    core = cache._core
    tree = core.tree
    nodes = []
    for node in [*tree.walk(), *tree.walk_detached()]:
        toks = tuple(t for n in tree.path(node) for t in n.key)
        pages = [
            None if pg is None else tuple(pg.tolist())
            for pg in (node.device_pages, node.host_pages)
        ]
        nodes.append((str(node.ns), toks, node.device.name, node.host.name, *pages))
        nodes[-1] += (node.pins, node.alive, node.corrupt)
    s = cache.statistics()
    dev = core.dev_alloc
    assert dev is not None
    pages = (dev._state.tobytes(), dev._refs.tobytes(), dev.num_free)  # per page: state, refs
    return (tuple(sorted(nodes, key=repr)), s.device, s.host, s.nodes, pages)


async def cached(cache: akv.HiCache, engine: ManualCopyEngine, tokens: list[int]) -> None:
    r = insert(cache, tokens, seed=1)
    engine.complete_all()
    await cache.flush()
    cache.release(r)


async def all_free(cache: akv.HiCache, engine: ManualCopyEngine) -> None:
    """Every handle released by the caller: once the copies land and the reaper ran, both
    pools are free again (no leaked pin, page or quarantine)."""
    engine.complete_all()
    await cache.flush()
    await settle(cache)
    cache.check_invariants()
    cache.evict(1 << 20, "device")
    cache.evict(1 << 20, "host")
    st = cache.statistics()
    assert st.device.free_pages == st.device.total_pages, st.device
    assert st.host.free_pages == st.host.total_pages, st.host
    assert st.device.quarantined_pages == st.host.quarantined_pages == 0


@pytest.mark.parametrize("cut", [2, 4, 6])  # the drop's prompt: from page 0, 1 or 2 on
async def test_insert_onto_a_dropped_match_is_prefix_dropped_and_changes_nothing(
    engine: ManualCopyEngine, cut: int
) -> None:
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        await cached(cache, engine, A)
        m = cache.match_prefix(A + TAIL)
        assert m.device_len == 6
        slots = cache.alloc(len(TAIL))
        written = write_kv(cache, slots, seed=4)
        res = await cache.drop(A[:cut])
        assert res.deferred_nodes >= 1  # the request still holds them
        before = state(cache)
        with pytest.raises(PrefixDroppedError) as info:
            cache.insert(A + TAIL, slots, prefix=m)
        err = info.value
        assert not isinstance(err, InvalidInputError)  # the caller did nothing wrong
        assert isinstance(err, akv.KVCacheError) and isinstance(err, RuntimeError)
        assert (err.reason, err.tokens, err.at) == ("dropped", 6, cut - 2)
        assert f"tokens {cut - 2}..6" in str(err) and "dropped" in str(err), err
        assert state(cache) == before  # no page taken, no pin added or lost
        cache.check_invariants()
        # the slots are still the caller's, with its KV; its match still reads the old pages
        for a, b in zip(read_kv(cache, slots), written, strict=True):
            assert torch.equal(a, b)
        assert m.device_len == 6
        # the remedy: release, match again, recompute what is gone
        cache.release(m)
        m2 = cache.match_prefix(A + TAIL)
        assert m2.device_len == cut - 2
        rows = cache.alloc(len(A) + len(TAIL) - m2.device_len)
        r = cache.insert(A + TAIL, rows, prefix=m2)
        assert r.inserted_len == 10
        cache.free(slots)
        cache.release(m2)
        cache.release(r)
        await all_free(cache, engine)


async def test_the_matched_rows_passed_back_after_a_drop_are_prefix_dropped(
    engine: ManualCopyEngine,
) -> None:
    """The other documented form: no ``prefix=``, the match's rows passed back in front of
    the new ones.  After a drop they are a detached node's rows: the refusal names them as
    dropped, not as rows the caller never held."""
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        await cached(cache, engine, A)
        m = cache.match_prefix(A + TAIL)
        rows = m.device_indices
        slots = cache.alloc(len(TAIL))
        write_kv(cache, slots, seed=5)
        await cache.drop(A[:4])  # the match's last two pages (tokens 2..6) go
        before = state(cache)
        with pytest.raises(PrefixDroppedError) as info:
            cache.insert(A + TAIL, torch.cat([rows, slots]))
        err = info.value
        assert (err.reason, err.at, err.tokens) == ("dropped", 2, 6), err
        assert state(cache) == before
        cache.check_invariants()
        cache.free(slots)
        cache.release(m)
        await all_free(cache, engine)


async def test_insert_onto_a_dropped_insert_result_is_prefix_dropped(
    engine: ManualCopyEngine,
) -> None:
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        r = insert(cache, A, seed=2)  # the request's previous insert
        slots = cache.alloc(len(TAIL))
        await cache.drop(tenant=None)  # everything of the tenant, this request's pages too
        before = state(cache)
        with pytest.raises(PrefixDroppedError) as info:
            cache.insert(A + TAIL, slots, prefix=r)
        assert (info.value.reason, info.value.tokens, info.value.at) == ("dropped", 6, 0)
        assert "insert result" in str(info.value)
        assert state(cache) == before
        cache.check_invariants()
        cache.free(slots)
        cache.release(r)
        await all_free(cache, engine)


async def test_a_drop_below_the_skipped_tokens_does_not_refuse(engine: ManualCopyEngine) -> None:
    """The handle's own node left, but every page the insert leans on is still in the tree:
    the insert goes through (no restart needed), under the live prefix."""
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        await cached(cache, engine, A)
        m = cache.match_prefix(A)
        await cache.drop(A)  # page 2 ([5, 6]) goes: m's node is detached
        assert not m.node.alive
        slots = cache.alloc(2 + len(TAIL))  # it leans on the first 4 tokens only (still live)
        r = cache.insert(A + TAIL, slots, prefix=m)
        assert r.inserted_len == 10 and r.node.alive and r.retained_pages.numel() == 0
        assert cache.cached_len(A + TAIL) == 10
        cache.release(r)
        cache.release(m)
        await all_free(cache, engine)


async def test_the_callers_own_mistake_stays_invalid_input(engine: ManualCopyEngine) -> None:
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        await cached(cache, engine, A[:4])
        m = cache.match_prefix(A + TAIL)  # 4 tokens on device
        slots = cache.alloc(len(TAIL))  # for tokens 6.. but the match holds only 4
        before = state(cache)
        with pytest.raises(InvalidInputError) as info:
            cache.insert(A + TAIL, slots, prefix=m)
        assert not isinstance(info.value, PrefixDroppedError)
        assert state(cache) == before
        # another prompt than the match's: tokens that do not extend it
        with pytest.raises(InvalidInputError) as info:
            cache.insert([1, 2, 9, 9, 5, 6, *TAIL], cache.alloc(6), prefix=m)
        assert not isinstance(info.value, PrefixDroppedError)
        cache.release(m)
        cache.free(slots)
        cache.check_invariants()


def spoil(cache: akv.HiCache, tokens: list[int]) -> None:
    """Make the host copies of ``tokens``' pages look like a Mooncake prefetch's that failed
    its checksum: unverified, with a trailer sum the bytes do not have (``storage/deferred``):
    the load-back's copy finds it."""
    core = cache._core
    host = core.host_pool
    assert host is not None
    m = cache.match_prefix(tokens)
    _, nodes = m.parts()
    ids = torch.cat([n.host_pages for n in nodes if n.host_pages is not None]).numpy()
    cache.release(m)
    host.unverified[ids] = True
    host.sums[ids] = np.array([12345, 678, host.page_bytes], dtype=np.uint64)


@pytest.mark.parametrize("how", ["corrupt", "load failed"])
async def test_insert_after_a_node_whose_load_back_fails_is_prefix_dropped(
    engine: ManualCopyEngine, how: str
) -> None:
    """Request Y computed ``A`` itself while request X loads ``A`` back from host: Y's insert
    stops at the loading node (``inserted_len`` 6, Y's rows retained).  X's load fails its
    verification (or its copy): Y's next insert with ``prefix=`` that result leans on pages
    that left the device; it is ``PrefixDroppedError``, not a complaint about Y's slots."""
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        await cached(cache, engine, A)
        cache.evict(100, "device")
        mx = cache.match_prefix(A)
        assert (mx.device_len, mx.host_len) == (0, 6)
        if how == "corrupt":
            spoil(cache, A)
        load = asyncio.ensure_future(cache.load_back(mx))
        await asyncio.sleep(0)
        assert len(engine.pending) == 1
        rows_y = cache.alloc(6)
        write_kv(cache, rows_y, seed=6)
        ry = cache.insert(A, rows_y)  # stops at the node loading back
        assert ry.inserted_len == 6 and ry.retained_pages.numel() == 3
        if how == "corrupt":
            engine.complete(0)
        else:
            engine.fail(0)
        with pytest.raises(akv.TransferError) if how != "corrupt" else nullcontext():
            await load
        await asyncio.sleep(0)
        assert mx.device_len == 0
        slots = cache.alloc(len(TAIL))
        before = state(cache)
        with pytest.raises(PrefixDroppedError) as info:
            cache.insert(A + TAIL, slots, prefix=ry)
        assert (info.value.reason, info.value.tokens, info.value.at) == (how, 6, 0)
        assert state(cache) == before
        cache.check_invariants()
        # the remedy: release, match again (the bad pages are a miss), recompute
        cache.release(ry)
        cache.release(mx)
        await cache.flush()
        m = cache.match_prefix(A + TAIL)
        assert m.matched_len == (0 if how == "corrupt" else 6)
        cache.release(m)
        cache.free(slots)
        await all_free(cache, engine)
