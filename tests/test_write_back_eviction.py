"""Write-back eviction frees what was asked for, no more (found by an adversarial round).

A victim without a host copy is staged: a copy to host starts and its device pages are freed
when it lands.  Staged pages did not count toward the eviction's target, so one page's room
staged (and then demoted) every idle device-only page: past retention priorities, past a
tenant's budget (a tenant one page over ended with none on device), and again on every retry
of an allocation while the first copies flew.  And a victim demoted in the same walk could
lose its host copy to a later victim's staging before its device removal was published.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

import aiocache_kv as akv
from aiocache_kv.events import BlockRemoved
from tests.conftest import small_config


def insert(cache: akv.HiCache, toks: list[int], **kw: object) -> None:
    cache.release(cache.insert(toks, cache.alloc(len(toks)), **kw))  # type: ignore[arg-type]


def on_device(cache: akv.HiCache, toks: list[int], **kw: object) -> int:
    m = cache.match_prefix(toks, **kw)  # type: ignore[arg-type]
    try:
        return m.device_len
    finally:
        cache.release(m)


async def test_evicting_one_page_demotes_one_page() -> None:
    async with akv.HiCache(small_config(write_policy="write_back", host_pages=32)) as cache:
        for i in range(6):
            insert(cache, [i, i])
        cache.evict(1)
        await asyncio.wait_for(cache.flush(), 10)
        st = cache.statistics()
        assert st.evicted_pages_device == 1, st
        assert sum(on_device(cache, [i, i]) for i in range(6)) == 5 * 2
        assert on_device(cache, [0, 0]) == 0  # the least recently used
        cache.check_invariants()


async def test_an_allocation_retried_while_copies_fly_stages_no_more() -> None:
    async with akv.HiCache(small_config(write_policy="write_back", host_pages=32)) as cache:
        for i in range(16):  # the device pool is full of idle device-only pages
            insert(cache, [i, i])
        for _ in range(3):  # each call finds the pages staged by the first coming
            with contextlib.suppress(akv.CapacityError):
                cache.free(cache.alloc(2))
        cache.free(await asyncio.wait_for(cache.alloc_wait(2), 10))
        await asyncio.wait_for(cache.flush(), 10)
        st = cache.statistics()
        assert st.evicted_pages_device == 1, st
        assert st.device.free_pages == 1, st.device
        cache.check_invariants()


async def test_staging_keeps_retention_priority() -> None:
    async with akv.HiCache(small_config(write_policy="write_back", host_pages=32)) as cache:
        insert(cache, [7, 7], priority=1000)  # the oldest, but kept the longest
        for i in range(3):
            insert(cache, [i, i])
        cache.evict(1)
        await asyncio.wait_for(cache.flush(), 10)
        assert on_device(cache, [7, 7]) == 2
        assert cache.statistics().evicted_pages_device == 1
        cache.check_invariants()


async def test_a_tenant_over_its_budget_is_brought_back_to_it() -> None:
    quota = {"a": akv.TenantQuota(device_pages=5)}
    cfg = small_config(write_policy="write_back", host_pages=32, tenant_quotas=quota)
    async with akv.HiCache(cfg) as cache:
        for i in range(6):  # the sixth page is one over
            insert(cache, [i, i], tenant="a")
        for _ in range(3):
            await asyncio.sleep(0.02)
            await asyncio.wait_for(cache.flush(), 10)
        assert cache.tenant_usage("a")["device"] == 5, cache.tenant_usage("a")
        cache.check_invariants()


async def test_a_blocks_device_removal_precedes_its_host_removal() -> None:
    cfg = small_config(write_policy="write_back", host_pages=1, device_pages=4)
    async with akv.HiCache(cfg) as cache:
        insert(cache, [1, 2])
        cache.evict(1)  # staged to the one host page, then demoted
        await asyncio.wait_for(cache.flush(), 10)
        m = cache.match_prefix([1, 2])
        await asyncio.wait_for(cache.load_back(m), 10)  # on device and host now
        cache.release(m)
        insert(cache, [3, 4])
        cache.take_events()
        # demotes [1, 2] (it has a host copy), then stages [3, 4], whose host page is the
        # one [1, 2] holds: [1, 2] leaves the host in the same walk
        cache.evict(2)
        await asyncio.wait_for(cache.flush(), 10)
        seen: dict[bytes, list[str]] = {}
        for ev in cache.take_events():
            if isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    seen.setdefault(h, []).append(ev.medium)
        both = [media for media in seen.values() if len(media) == 2]
        assert both == [["GPU", "CPU"]], seen
        cache.check_invariants()


async def test_a_host_allocation_that_cannot_succeed_evicts_nothing() -> None:
    """Host copies of device-resident pages count as host-evictable, but host eviction takes
    host-only leaves alone: a write-through trusting that count deleted the host-only page
    and was skipped anyway."""
    cfg = small_config(write_policy="write_through", host_pages=3, device_pages=8)
    async with akv.HiCache(cfg) as cache:
        insert(cache, [9, 9])
        await asyncio.wait_for(cache.flush(), 10)
        cache.evict(1)  # [9, 9] is host-only now: 1 page
        insert(cache, [1, 2, 3, 4])  # on device and host: 2 pages
        await asyncio.wait_for(cache.flush(), 10)
        insert(cache, [5, 6, 7, 8, 10, 11])  # its 3-page write-through cannot fit
        await asyncio.wait_for(cache.flush(), 10)
        st = cache.statistics()
        assert st.write_through_skipped_pages == 3 and st.evicted_pages_host == 0, st
        assert cache.cached_len([9, 9]) == 2
        insert(cache, [20, 21, 22, 23])  # a 2-page one would not fit either: nothing goes
        await asyncio.wait_for(cache.flush(), 10)
        assert cache.statistics().evicted_pages_host == 0
        insert(cache, [30, 31])  # a 1-page one fits by deleting the host-only page
        await asyncio.wait_for(cache.flush(), 10)
        assert cache.statistics().evicted_pages_host == 1
        assert cache.cached_len([9, 9]) == 0
        cache.check_invariants()


async def test_a_host_eviction_counts_the_parents_its_victims_leave() -> None:
    """A host-only chain (a split left two nodes): the dry run counts the parent, which
    becomes a victim once its child goes, so an allocation of both pages succeeds."""
    cfg = small_config(write_policy="write_through", host_pages=2, device_pages=8)
    async with akv.HiCache(cfg) as cache:
        insert(cache, [1, 2, 3, 4])
        await asyncio.wait_for(cache.flush(), 10)
        m = cache.match_prefix([1, 2, 5, 6])  # splits [1, 2] | [3, 4]
        cache.release(m)
        cache.evict(1 << 30)  # both host-only now, [3, 4] the only leaf
        assert cache.statistics().host.free_pages == 0
        insert(cache, [7, 8, 9, 10])  # 2 pages: [3, 4], then [1, 2]
        await asyncio.wait_for(cache.flush(), 10)
        st = cache.statistics()
        assert st.write_through_skipped_pages == 0 and st.evicted_pages_host == 2, st
        cache.check_invariants()


async def test_the_dry_run_counts_an_over_budget_tenants_victims_once() -> None:
    """Found by a review: with per-tenant heaps an over-budget tenant's victims come first
    and then again from the main heap (the dry run removes none): counted twice, an
    allocation that could not succeed was let through and evicted another tenant's page."""
    quota = {"a": akv.TenantQuota(host_pages=3)}
    cfg = small_config(
        write_policy="write_through", host_pages=10, device_pages=16, tenant_quotas=quota
    )
    async with akv.HiCache(cfg) as cache:
        core = cache._core
        insert(cache, [1, 2, 3, 4], tenant="a")
        await asyncio.wait_for(cache.flush(), 10)
        cache.evict(2)  # a host-only leaf of tenant a: 2 pages
        insert(cache, [7, 8], tenant="d")
        await asyncio.wait_for(cache.flush(), 10)
        cache.evict(1)  # a host-only leaf of tenant d: 1 page
        insert(cache, [9, 10, 11, 12, 13, 14, 15, 16], tenant="b")  # on device and host
        await asyncio.wait_for(cache.flush(), 10)
        insert(cache, [20, 21, 22, 23], tenant="a")  # a is over its host budget now
        assert core.host_alloc is not None and core.host_alloc.num_free == 1
        assert not core.tree.can_free(4)  # 3 host-only pages exist, a's counted once
        before = cache.statistics().evicted_pages_host
        assert core.alloc_host(5) is None
        assert cache.statistics().evicted_pages_host == before
        assert cache.cached_len([7, 8], tenant="d") == 2
        await asyncio.wait_for(cache.flush(), 10)
        cache.check_invariants()


async def test_copies_in_flight_do_not_hold_back_a_page_free_now() -> None:
    """While staging copies cover an allocation, a victim with a host copy is still demoted
    (its pages are free at once) instead of the allocation waiting for the copies: with
    tensor parallelism those land only at the serving loop's next agreement."""
    async with akv.HiCache(small_config(write_policy="write_back", host_pages=32)) as cache:
        insert(cache, [100, 100])
        cache.evict(1)  # staged, then demoted: host-only
        await asyncio.wait_for(cache.flush(), 10)
        for i in range(15):  # device-only fillers, older than what follows
            insert(cache, [i, i])
        m = cache.match_prefix([100, 100])
        await asyncio.wait_for(cache.load_back(m), 10)  # on device and host, the newest
        cache.release(m)
        assert cache.statistics().device.free_pages == 0
        with pytest.raises(akv.CapacityError):
            cache.alloc(2)  # stages the oldest filler; nothing free yet
        slots = cache.alloc(2)  # the copy covers it: [100, 100] is demoted, free now
        assert on_device(cache, [100, 100]) == 0 and on_device(cache, [1, 1]) == 2
        cache.free(slots)
        await asyncio.wait_for(cache.flush(), 10)
        assert cache.statistics().evicted_pages_device == 1 + 2  # [100, 100] twice, a filler
        cache.check_invariants()
