"""A prefetch evicts host pages only for pages storage has (found by an adversarial round).

The reservation for a prefetch's reads used to be taken, evicting host-only pages, before the
existence check: a prompt storage had never seen (every cold arrival's) flushed up to half
the host pool, another tenant's pages within its budget too, and then freed the reservation
unused.  With one rank a prefetch now reserves free pages up front and evicts for more only
once storage said which pages it has; on the read-ahead path (Mooncake) the pages reserved
after the check are read then.
"""

from __future__ import annotations

import aiocache_kv as akv
from aiocache_kv.storage.prefetch import PrefetchStatus
from aiocache_kv.testing import MemoryStorage
from aiocache_kv.testing.fake_mooncake import FakeMooncakeClient, FakeMooncakeStorage
from tests.conftest import small_config
from tests.test_split_ack import write_kv

OTHER = list(range(100, 116))  # 8 pages of 2 tokens
PROMPT = list(range(500, 516))


def config(store: akv.StorageBackend, **kw: object) -> akv.CacheConfig:
    opts: dict[str, object] = dict(
        storage=store,
        device_pages=16,
        host_pages=8,
        storage_workers=2,
        storage_retry_seconds=0.0,
        prefetch_policy="wait_complete",
        prefetch_threshold_tokens=0,
        prefetch_batch_pages=2,
        tenant_quotas={"b": akv.TenantQuota(host_pages=8)},
    )
    opts.update(kw)
    return small_config(**opts)


def insert(
    cache: akv.HiCache, toks: list[int], seed: int, tenant: str | None = None
) -> akv.InsertResult:
    slots = cache.alloc(len(toks))
    write_kv(cache, slots, seed)
    return cache.insert(toks, slots, tenant=tenant)


async def to_host(cache: akv.HiCache, toks: list[int], tenant: str | None = None) -> None:
    """``toks`` backed up to storage, then on host only."""
    cache.release(insert(cache, toks, seed=5, tenant=tenant))
    await cache.flush()
    cache.evict(1 << 30)


async def test_a_miss_evicts_no_host_page() -> None:
    async with akv.HiCache(config(MemoryStorage())) as cache:
        await to_host(cache, OTHER, tenant="b")
        assert cache.statistics().host.free_pages == 0
        res = await cache.prefetch(PROMPT, tenant="a")
        assert res.status is PrefetchStatus.MISS
        st = cache.statistics()
        assert st.evicted_pages_host == 0 and st.prefetch_pages_discarded == 0, st
        assert cache.cached_len(OTHER, tenant="b") == len(OTHER)
        cache.check_invariants()


async def test_a_hit_on_a_full_host_pool_evicts_for_what_storage_has() -> None:
    async with akv.HiCache(config(MemoryStorage())) as cache:
        await to_host(cache, PROMPT[:8])  # 4 pages, their KV in storage
        cache.evict(1 << 30, "host")
        await to_host(cache, OTHER)  # the host pool full of others
        assert cache.statistics().host.free_pages == 0
        res = await cache.prefetch(PROMPT[:8])
        assert (res.status, res.hit_tokens) == (PrefetchStatus.COMPLETE, 8), res
        assert cache.statistics().evicted_pages_host == 4 + 8  # PROMPT's, then OTHER's node
        assert cache.cached_len(PROMPT[:8]) == 8
        cache.check_invariants()


async def test_read_ahead_reads_the_pages_reserved_after_the_check() -> None:
    """Mooncake reads beside the check, into the free pages reserved up front (2 here); the
    other pages of the run, reserved once the check said storage has them, are read then."""
    client = FakeMooncakeClient()
    store = FakeMooncakeStorage(client)
    async with akv.HiCache(config(store, host_pages=10)) as cache:
        cache.release(insert(cache, PROMPT, seed=3))  # 8 pages backed up
        await cache.flush()
        cache.evict(1 << 30)
        cache.evict(1 << 30, "host")
        await to_host(cache, OTHER)  # 8 pages of 10: 2 free
        assert cache.statistics().host.free_pages == 2
        client.log.clear()
        res = await cache.prefetch(PROMPT)
        assert res.hit_tokens == 10 and res.status is PrefetchStatus.PARTIAL, res  # half the pool
        read = [k for name, keys in client.log if name == "batch_get_into" for k in keys]
        assert len(read) == len(set(read)) == 5, read  # each page of the run read once
        # short of the run, the reads are not the check: it ran beside them, for all 8
        assert [len(keys) for name, keys in client.log if name == "batch_is_exist"] == [8]
        m = cache.match_prefix(PROMPT)
        assert m.host_len == 10
        cache.release(m)
        await cache.flush()
        assert cache.statistics().host.quarantined_pages == 0
        cache.check_invariants()


async def test_host_copies_of_device_pages_do_not_make_the_reservation_all_or_nothing() -> None:
    """The host pool is full: 7 pages are host copies of idle device pages (counted evictable,
    but host eviction never takes them), 1 is host-only.  The prefetch asked for 2 pages in
    one piece, failed, and reserved nothing; it now evicts what it can and takes that."""
    async with akv.HiCache(config(MemoryStorage(), tenant_quotas={})) as cache:
        await to_host(cache, PROMPT[:4])  # 2 pages, their KV in storage
        cache.evict(1 << 30, "host")
        await to_host(cache, OTHER[:2])  # 1 page, host-only
        a = insert(cache, OTHER[2:], seed=6)  # 7 pages on device, written through to host
        cache.release(a)
        await cache.flush()
        st = cache.statistics()
        assert st.host.free_pages == 0 and st.host.evictable_pages == 8, st.host
        res = await cache.prefetch(PROMPT[:4])
        assert (res.status, res.hit_tokens) == (PrefetchStatus.PARTIAL, 2), res
        assert cache.cached_len(PROMPT[:4]) == 2 and cache.cached_len(OTHER[:2]) == 0
        assert cache.cached_len(OTHER[2:]) == len(OTHER) - 2  # the device pages' copies stay
        cache.check_invariants()
