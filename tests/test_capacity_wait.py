"""Bounded waits for device pages: ``alloc_wait(n, timeout=)`` and ``load_back(m, timeout=)``.

Without ``timeout`` both behave as before (``alloc_wait`` waits only for copies in flight,
``load_back`` raises ``CapacityError`` at once).  With it, a request that finds the pool full
waits in line (first come, first served) for pages to come back (a release, a free, an
eviction, a copy that landed), up to the deadline, then fails with a ``CapacityError`` that
says what was free and evictable.  A waiter cancelled or timed out takes nothing with it.
"""

from __future__ import annotations

import asyncio
import math
import time

import pytest
import torch

import aiocache_kv as akv
from aiocache_kv.testing import ManualCopyEngine
from tests.conftest import small_config

P = 2


def fill(cache: akv.HiCache, free_left: int = 0) -> tuple[akv.InsertResult, torch.Tensor]:
    """Pin half the free pages under an insert result, hold the rest (but ``free_left``)."""
    n = cache.statistics().device.free_pages - free_left
    pinned = n // 2
    r = cache.insert(list(range(1000, 1000 + pinned * P)), cache.alloc(pinned * P))
    held = cache.alloc((n - pinned) * P)
    return r, held


def idle(cache: akv.HiCache) -> akv.TierStatistics:
    return cache.statistics().device


async def test_alloc_wait_gets_pages_when_a_handle_is_released() -> None:
    async with akv.HiCache(small_config(device_pages=8, host_pages=0)) as cache:
        r, held = fill(cache)
        task = asyncio.ensure_future(cache.alloc_wait(4, timeout=5))
        for _ in range(3):
            await asyncio.sleep(0)
        assert not task.done()  # nothing free, nothing evictable: it waits
        cache.release(r)  # r's pages become evictable: the waiter evicts and takes them
        slots = await asyncio.wait_for(task, 1)
        assert slots.numel() == 4 and idle(cache).held_pages == (4 + held.numel()) // P
        cache.free(slots)
        cache.free(held)
        cache.check_invariants()


async def test_alloc_wait_gets_pages_when_another_task_frees() -> None:
    async with akv.HiCache(small_config(device_pages=8, host_pages=0)) as cache:
        r, held = fill(cache)

        async def other() -> None:
            await asyncio.sleep(0.01)
            cache.free(held[: 2 * P])

        got, _ = await asyncio.gather(cache.alloc_wait(3, timeout=5), other())
        assert got.numel() == 4
        assert not set((got // P).tolist()) & set((held[2 * P :] // P).tolist())
        cache.free(got)
        cache.free(held[2 * P :])
        cache.release(r)
        cache.check_invariants()


async def test_alloc_wait_gets_pages_when_a_copy_lands(engine: ManualCopyEngine) -> None:
    """A write-through in flight protects its pages; when it lands they are evictable."""
    async with akv.HiCache(small_config(device_pages=8), copy_engine=engine) as cache:
        cache.release(cache.insert(list(range(8)), cache.alloc(8)))  # 4 pages, copy pending
        held = cache.alloc(8)
        task = asyncio.ensure_future(cache.alloc_wait(2, timeout=5))
        await asyncio.sleep(0.01)
        assert not task.done()
        engine.complete_all()
        slots = await asyncio.wait_for(task, 1)
        assert slots.numel() == 2
        cache.free(slots)
        cache.free(held)
        cache.check_invariants()


async def test_alloc_wait_times_out_with_a_capacity_error() -> None:
    async with akv.HiCache(small_config(device_pages=8, host_pages=0)) as cache:
        r, _ = fill(cache, free_left=1)
        free0 = idle(cache)
        t0 = time.monotonic()
        with pytest.raises(akv.CapacityError) as info:
            await cache.alloc_wait(6, timeout=0.05)
        assert time.monotonic() - t0 >= 0.045
        msg = str(info.value)
        for words in ("need 3 pages", "1 free of 8", "0 evictable", "waited 0.05 s"):
            assert words in msg, msg
        assert idle(cache) == free0  # nothing taken, nothing evicted
        assert len(cache._waiters) == 0
        with pytest.raises(akv.CapacityError, match="more than the pool holds"):
            await cache.alloc_wait(9 * P, timeout=5)  # can never fit: at once
        with pytest.raises(akv.CapacityError):
            await cache.alloc_wait(4, timeout=0)  # one try, no wait
        assert (await cache.alloc_wait(1, timeout=0)).numel() == 2
        cache.release(r)
        cache.check_invariants()


async def test_cancelled_waiter_leaks_nothing() -> None:
    async with akv.HiCache(small_config(device_pages=8, host_pages=0)) as cache:
        r, held = fill(cache)
        before = idle(cache)
        task = asyncio.ensure_future(cache.alloc_wait(2, timeout=5))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert idle(cache) == before and len(cache._waiters) == 0
        # served in the same turn it is cancelled: the pages it got go back
        task = asyncio.ensure_future(cache.alloc_wait(2, timeout=5))
        await asyncio.sleep(0)
        cache.free(held[:P])
        await asyncio.sleep(0)  # the line is served: the waiter's future has its pages
        task.cancel()  # ... but its task has not resumed yet
        with pytest.raises(asyncio.CancelledError):
            await task
        st = idle(cache)
        assert st.held_pages == before.held_pages - 1 and st.free_pages == before.free_pages + 1
        assert len(cache._waiters) == 0
        cache.release(r)
        cache.free(held[P:])
        cache.check_invariants()
        assert idle(cache).free_pages + idle(cache).evictable_pages == 8


async def test_waiters_are_served_first_come_first_served() -> None:
    async with akv.HiCache(small_config(device_pages=8, host_pages=0)) as cache:
        held = cache.alloc(8 * P)
        order: list[str] = []

        async def want(name: str, n: int) -> torch.Tensor:
            slots = await cache.alloc_wait(n, timeout=5)
            order.append(name)
            return slots

        big = asyncio.ensure_future(want("big", 4 * P))
        await asyncio.sleep(0)
        small = asyncio.ensure_future(want("small", P))
        await asyncio.sleep(0)
        cache.free(held[: 2 * P])  # enough for small, not for big: small must not overtake
        await asyncio.sleep(0.01)
        assert order == []
        cache.free(held[2 * P : 5 * P])  # 5 free: big, then small
        got = await asyncio.wait_for(asyncio.gather(big, small), 1)
        assert order == ["big", "small"]
        for slots in (*got, held[5 * P :]):
            cache.free(slots)
        cache.check_invariants()
        assert idle(cache).free_pages == 8


async def test_load_back_waits_for_device_pages(engine: ManualCopyEngine) -> None:
    async with akv.HiCache(small_config(device_pages=8), copy_engine=engine) as cache:
        cache.release(cache.insert([1, 2, 3, 4], cache.alloc(4)))
        engine.complete_all()
        await cache.flush()
        assert cache.evict(2) == 2  # [1, 2, 3, 4] is host-only
        m = cache.match_prefix([1, 2, 3, 4])
        assert m.lens() == (0, 4)
        held = cache.alloc(8 * P)
        with pytest.raises(akv.CapacityError):
            await cache.load_back(m)  # without timeout: at once, as before
        with pytest.raises(akv.CapacityError, match=r"need 2 pages.*waited 0\.02 s"):
            await cache.load_back(m, timeout=0.02)
        assert m.lens() == (0, 4) and len(cache._waiters) == 0
        task = asyncio.ensure_future(cache.load_back(m, timeout=5))
        await asyncio.sleep(0.01)
        assert not task.done() and not engine.pending
        cache.free(held[: 2 * P])
        for _ in range(3):
            await asyncio.sleep(0)
        assert len(engine.pending) == 1  # the load started once pages came back
        engine.complete_all()
        assert await asyncio.wait_for(task, 1) is m
        assert m.lens() == (4, 0)
        cache.release(m)
        cache.free(held[2 * P :])
        cache.check_invariants()


async def test_cancelled_load_back_waiter_leaks_nothing(engine: ManualCopyEngine) -> None:
    async with akv.HiCache(small_config(device_pages=8), copy_engine=engine) as cache:
        cache.release(cache.insert([1, 2, 3, 4], cache.alloc(4)))
        engine.complete_all()
        await cache.flush()
        cache.evict(2)
        m = cache.match_prefix([1, 2, 3, 4])
        held = cache.alloc(8 * P)
        before = idle(cache)
        task = asyncio.ensure_future(cache.load_back(m, timeout=5))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert idle(cache) == before and len(cache._waiters) == 0 and not engine.pending
        # released while waiting: the next try fails with a HandleError, nothing is loaded
        task = asyncio.ensure_future(cache.load_back(m, timeout=5))
        await asyncio.sleep(0.01)
        cache.release(m)
        cache.free(held[: 2 * P])
        with pytest.raises(akv.HandleError):
            await asyncio.wait_for(task, 1)
        assert not engine.pending and len(cache._waiters) == 0
        cache.free(held[2 * P :])
        cache.check_invariants()


async def test_closing_fails_the_waiters() -> None:
    cache = akv.HiCache(small_config(device_pages=8, host_pages=0))
    await cache.start()
    cache.alloc(8 * P)
    task = asyncio.ensure_future(cache.alloc_wait(2, timeout=5))
    await asyncio.sleep(0)
    await cache.aclose()
    with pytest.raises(akv.CacheClosedError):
        await asyncio.wait_for(task, 1)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1, -0.5, True, "1", None, 1e300])
async def test_bad_timeouts_are_typed_errors(bad: object) -> None:
    async with akv.HiCache(small_config(device_pages=8, host_pages=0)) as cache:
        held = cache.alloc(6 * P)
        m = cache.match_prefix([1, 2])
        before = idle(cache)
        if bad is None:  # None is the default (no waiting), not an error
            assert (await cache.alloc_wait(2, timeout=bad)).numel() == 2
            return
        with pytest.raises(akv.InvalidInputError, match="timeout"):
            await cache.alloc_wait(2, timeout=bad)  # type: ignore[arg-type]
        with pytest.raises(akv.InvalidInputError, match="timeout"):
            await cache.load_back(m, timeout=bad)  # type: ignore[arg-type]
        with pytest.raises(akv.InvalidInputError, match="alloc_wait needs an int"):
            await cache.alloc_wait(-1, timeout=1)
        assert idle(cache) == before
        cache.release(m)
        cache.free(held)


class _TwoRanksAlone:
    """A TP group of two whose other rank always agrees (one process: enough to see that a
    clock-bounded wait is refused with tensor parallelism)."""

    rank = 0
    world_size = 2

    def all_reduce_min(self, values: list[int]) -> list[int]:
        return list(values)


async def test_timeouts_are_refused_with_tensor_parallelism() -> None:
    cfg = small_config(device_pages=8, host_pages=0)
    async with akv.HiCache(cfg, tp_group=_TwoRanksAlone()) as cache:
        m = cache.match_prefix([1, 2])
        with pytest.raises(akv.InvalidInputError, match="tensor parallelism"):
            await cache.alloc_wait(2, timeout=1)
        with pytest.raises(akv.InvalidInputError, match="tensor parallelism"):
            await cache.load_back(m, timeout=1)
        assert (await cache.alloc_wait(2)).numel() == 2  # the default form still works
        cache.release(m)


async def test_copies_in_flight_is_the_snapshot_count_without_the_snapshot() -> None:
    engine = ManualCopyEngine()
    cache = akv.HiCache(small_config(write_policy="write_through"), copy_engine=engine)
    async with cache:
        assert cache.copies_in_flight() == 0
        slots = cache.alloc(4)
        r = cache.insert([1, 2, 3, 4], slots)  # its write-through waits in the engine
        assert cache.copies_in_flight() == cache.statistics().ops_in_flight == 1
        engine.complete_all()
        await asyncio.sleep(0)
        assert cache.copies_in_flight() == cache.statistics().ops_in_flight == 0
        cache.release(r)
    with pytest.raises(akv.CacheClosedError):
        cache.copies_in_flight()


async def test_unpins_call_the_capacity_hook_only_while_someone_listens() -> None:
    """With nobody waiting, no quotas and no drop, an unpin or a free calls nothing (two
    unpins on every request).  A waiter in line installs the hook, and every way out of the
    line (served, timed out, cancelled, the cache closing) takes it away again when the line
    is empty; quotas and a drop's reaper keep it.  ``check_invariants`` checks it throughout,
    and a waiter is still served by a release while it waits."""
    cache = akv.HiCache(small_config(device_pages=8, host_pages=0))
    async with cache:
        core = cache._core

        def hooked() -> bool:
            cache.check_invariants()
            return core.tree.on_unpinned is not None

        assert not hooked()
        r, _held = fill(cache)  # held until the cache closes: later waiters wait
        served = asyncio.ensure_future(cache.alloc_wait(4, timeout=5))
        await asyncio.sleep(0)
        assert hooked()
        cache.release(r)  # the waiter is served through the hook
        cache.free(await asyncio.wait_for(served, 1))
        assert not hooked()
        timed_out = asyncio.ensure_future(cache.alloc_wait(6 * P, timeout=0.01))
        await asyncio.sleep(0)
        assert hooked()
        with pytest.raises(akv.CapacityError):
            await timed_out
        assert not hooked()
        a = asyncio.ensure_future(cache.alloc_wait(6 * P, timeout=5))
        b = asyncio.ensure_future(cache.alloc_wait(6 * P, timeout=5))
        await asyncio.sleep(0)
        a.cancel()
        with pytest.raises(asyncio.CancelledError):
            await a
        assert hooked()  # b is still in line
        b.cancel()
        with pytest.raises(asyncio.CancelledError):
            await b
        assert not hooked()
        last = asyncio.ensure_future(cache.alloc_wait(6 * P, timeout=5))
        await asyncio.sleep(0)
        assert hooked()
    with pytest.raises(akv.CacheClosedError):
        await last
    assert core.tree.on_unpinned is None
    quotas = small_config(
        device_pages=8, host_pages=0, default_tenant_quota=akv.TenantQuota(device_pages=4)
    )
    async with akv.HiCache(quotas) as q:
        assert q._core.tree.on_unpinned is not None  # quotas are enforced on unpins
        q.check_invariants()
    async with akv.HiCache(small_config(device_pages=8, host_pages=0)) as d:
        d.release(d.insert([1, 2, 3, 4], d.alloc(4)))
        await d.drop([1, 2, 3, 4])
        assert d._core.tree.on_unpinned is not None  # the reaper listens from the drop on
        d.check_invariants()
