"""Cancellation and failure at every await: no pin, page or half-loaded node leaks."""

from __future__ import annotations

import asyncio

import pytest

import aiocache_kv as akv
from aiocache_kv.testing import ManualCopyEngine
from aiocache_kv.tree import TierState
from tests.conftest import small_config
from tests.test_split_ack import insert

TOKENS = [1, 2, 3, 4, 5, 6]


async def host_only_match(cache: akv.HiCache, engine: ManualCopyEngine) -> akv.MatchResult:
    r = insert(cache, TOKENS)
    engine.complete_all()
    await cache.flush()
    cache.release(r)
    cache.evict(100)
    m = cache.match_prefix(TOKENS)
    assert (m.device_len, m.host_len) == (0, 6)
    return m


def assert_all_free(cache: akv.HiCache) -> None:
    cache.check_invariants()
    stats = cache.statistics()
    assert stats.device.protected_pages == 0 and stats.host.protected_pages == 0
    assert stats.device.held_pages == 0 and stats.ops_in_flight == 0
    cache.evict(10_000)
    cache.evict(10_000, tier="host")
    stats = cache.statistics()
    assert stats.device.free_pages == stats.device.total_pages
    assert stats.host.free_pages == stats.host.total_pages
    assert stats.nodes == 0


async def test_load_back_cancelled_before_completion(engine: ManualCopyEngine) -> None:
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        m = await host_only_match(cache, engine)
        task = asyncio.create_task(cache.load_back(m))
        await asyncio.sleep(0)  # the copy is submitted, the task waits for it
        assert len(engine.pending) == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        cache.check_invariants()  # the in-flight copy is tracked, not half-applied
        engine.complete_all()  # the copy lands after the cancel
        assert all(n.device is TierState.RESIDENT for n in cache._tree.path(m.node))
        assert m.device_len == 6
        cache.release(m)
        assert_all_free(cache)


async def test_load_back_completed_then_cancelled(engine: ManualCopyEngine) -> None:
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        m = await host_only_match(cache, engine)
        task = asyncio.create_task(cache.load_back(m))
        await asyncio.sleep(0)
        engine.complete_all()  # the ack is applied on the loop right now ...
        task.cancel()  # ... and the waiter is cancelled before it resumes
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (m.device_len, m.host_len) == (6, 0)
        cache.check_invariants()
        cache.release(m)
        assert_all_free(cache)


async def test_release_while_load_back_in_flight(engine: ManualCopyEngine) -> None:
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        m = await host_only_match(cache, engine)
        task = asyncio.create_task(cache.load_back(m))
        await asyncio.sleep(0)
        task.cancel()
        cache.release(m)  # request aborted: the pin goes, the copy still owns its pages
        assert cache.evict(100) == 0 and cache.evict(100, tier="host") == 0
        cache.check_invariants()
        engine.complete_all()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert_all_free(cache)


async def test_release_while_load_back_waits_for_another_load(
    engine: ManualCopyEngine,
) -> None:
    """A load-back waiting for a parent another request is loading, whose match is then
    released: its child is no longer pinned and a host eviction deletes it.  When the
    parent lands, the waiting load-back must stop (HandleError), not load the deleted child
    (which broke the parent's device-child count and leaked its pages)."""
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        m = await host_only_match(cache, engine)  # one host-only node of 3 pages
        cache.release(m)
        head = cache.match_prefix(TOKENS[:2])  # splits: [1, 2] -> [3, 4, 5, 6]
        first = asyncio.create_task(cache.load_back(head))
        await asyncio.sleep(0)
        assert len(engine.pending) == 1  # [1, 2] is filling
        m = cache.match_prefix(TOKENS)
        second = asyncio.create_task(cache.load_back(m))
        await asyncio.sleep(0)
        assert len(engine.pending) == 1  # it waits for [1, 2] before loading [3, 4, 5, 6]
        cache.release(m)
        assert cache.evict(100, tier="host") == 2  # the unpinned host-only leaf goes
        engine.complete_all()
        await first
        with pytest.raises(akv.HandleError, match="released"):
            await asyncio.wait_for(second, 5)  # old code: loaded the deleted child, never done
        assert not engine.pending  # nothing was loaded for the released match
        cache.check_invariants()
        cache.release(head)
        assert_all_free(cache)


async def test_concurrent_load_backs_share_one_copy(engine: ManualCopyEngine) -> None:
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        m1 = await host_only_match(cache, engine)
        m2 = cache.match_prefix(TOKENS)
        t1 = asyncio.create_task(cache.load_back(m1))
        t2 = asyncio.create_task(cache.load_back(m2))
        await asyncio.sleep(0)
        assert len(engine.pending) == 1
        engine.complete_all()
        await asyncio.gather(t1, t2)
        assert m1.device_indices.tolist() == m2.device_indices.tolist()
        cache.release(m1)
        cache.release(m2)
        assert_all_free(cache)


async def test_failed_load_back_raises_and_rolls_back(engine: ManualCopyEngine) -> None:
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        m = await host_only_match(cache, engine)
        free = cache.statistics().device.free_pages
        task = asyncio.create_task(cache.load_back(m))
        await asyncio.sleep(0)
        engine.fail(0)
        with pytest.raises(akv.TransferError):
            await task
        assert (m.device_len, m.host_len) == (0, 6)
        assert cache.statistics().device.free_pages == free
        assert cache.statistics().load_back_failed == 1
        cache.release(m)
        assert_all_free(cache)


async def test_load_back_without_device_room_changes_nothing(engine: ManualCopyEngine) -> None:
    async with akv.HiCache(small_config(device_pages=4), copy_engine=engine) as cache:
        m = await host_only_match(cache, engine)
        blockers = cache.alloc(4)  # every device page held by the caller
        before = cache.statistics()
        with pytest.raises(akv.CapacityError):
            await cache.load_back(m)
        assert cache.statistics() == before
        cache.free(blockers)
        task = asyncio.create_task(cache.load_back(m))
        await asyncio.sleep(0)
        engine.complete_all()
        await task
        cache.release(m)
        assert_all_free(cache)


async def test_cancelled_ack_wait_does_not_cancel_the_copy(engine: ManualCopyEngine) -> None:
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        r = insert(cache, TOKENS)
        ack = r.write_through
        assert ack is not None

        async def wait_ack() -> None:
            await ack

        task = asyncio.create_task(wait_ack())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        engine.complete_all()
        await cache.flush()
        assert ack.done() and cache.statistics().write_through_done == 1
        cache.release(r)
        assert_all_free(cache)


async def test_close_settles_copies_in_flight() -> None:
    engine = ManualCopyEngine()
    cache = akv.HiCache(small_config(), copy_engine=engine)
    async with cache:
        r = insert(cache, TOKENS)
        cache.release(r)
        assert engine.pending
    assert not engine.pending and cache.statistics().write_through_done == 1


async def test_failed_load_back_of_several_nodes_rolls_back_children_first(
    engine: ManualCopyEngine,
) -> None:
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        for r in (insert(cache, TOKENS[:4]), insert(cache, TOKENS)):  # two nodes on one path
            cache.release(r)
        engine.complete_all()
        await cache.flush()
        cache.evict(100)
        m = cache.match_prefix(TOKENS)
        assert len(cache._tree.path(m.node)) == 2 and m.host_len == 6
        task = asyncio.create_task(cache.load_back(m))
        await asyncio.sleep(0)
        engine.fail(0)  # one copy for both nodes
        with pytest.raises(akv.TransferError):
            await task
        assert (m.device_len, m.host_len) == (0, 6)
        cache.release(m)
        assert_all_free(cache)
