"""HiCache behaviour through the public API (CPU, real worker-thread copies unless noted)."""

from __future__ import annotations

import asyncio
import re
import threading

import pytest
import torch

import aiocache_kv as akv
from aiocache_kv.testing import ManualCopyEngine
from tests.conftest import small_config
from tests.test_split_ack import insert, write_kv


def read_kv(cache: akv.HiCache, slots: torch.Tensor) -> list[torch.Tensor]:
    out = []
    for layer in range(cache.config.num_layers):
        k, v = cache.device_kv(layer)
        out += [k[slots].clone(), v[slots].clone()]
    return out


async def test_kv_survives_demotion_and_load_back_bit_identical() -> None:
    async with akv.HiCache(small_config(page_size=4, device_pages=8)) as cache:
        tokens = list(range(100, 116))
        slots = cache.alloc(16)
        written = write_kv(cache, slots, seed=7)
        r = cache.insert(tokens, slots)
        assert r.write_through is not None
        await r.write_through
        cache.release(r)
        assert cache.evict(4) == 4  # all of it leaves the device
        cache.device_pool.buffer.zero_()  # type: ignore[union-attr]  # no stale device copy
        m = cache.match_prefix([*tokens, 1, 2])
        assert (m.device_len, m.host_len) == (0, 16)
        await cache.load_back(m)
        assert (m.device_len, m.host_len) == (16, 0)
        got = read_kv(cache, m.device_indices)
        for a, b in zip(got, written, strict=True):
            assert torch.equal(a, b)
        cache.release(m)
        cache.check_invariants()
        stats = cache.statistics()
        assert (
            stats.bytes_device_to_host == stats.bytes_host_to_device == 4 * cache.config.page_bytes
        )


async def test_match_reports_device_then_host_runs(engine: ManualCopyEngine) -> None:
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        r = insert(cache, [1, 2, 3, 4, 5, 6])
        engine.complete_all()
        await cache.flush()
        cache.release(r)
        m = cache.match_prefix([1, 2, 3, 4])  # splits; [5, 6] stays a leaf
        cache.release(m)
        cache.evict(1)  # the LRU device leaf: [5, 6]
        m = cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
        assert (m.matched_len, m.device_len, m.host_len) == (6, 4, 2)
        assert m.device_indices.tolist() == r_slots(cache, [1, 2, 3, 4])
        cache.release(m)


def r_slots(cache: akv.HiCache, tokens: list[int]) -> list[int]:
    m = cache.match_prefix(tokens)
    out = m.device_indices.tolist()
    cache.release(m)
    return out


async def test_duplicate_prefix_pages_are_freed_at_release(engine: ManualCopyEngine) -> None:
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        free0 = cache.statistics().device.free_pages
        r1 = insert(cache, [1, 2, 3, 4])
        # a second request recomputed the same prefix into its own pages, plus one new page:
        # its copies stay its own (retained) until it releases the result
        r2 = insert(cache, [1, 2, 3, 4, 5, 6])
        assert r2.prefix_len == 4
        st = cache.statistics().device
        assert st.free_pages == free0 - 5 and st.retained_pages == 2
        cache.release(r2)
        st = cache.statistics().device
        assert st.free_pages == free0 - 3 and st.retained_pages == 0
        # reusing the tree's own slots for the prefix is fine, too
        m = cache.match_prefix([1, 2, 3, 4, 5, 6])
        extra = cache.alloc(2)
        r3 = cache.insert([1, 2, 3, 4, 5, 6, 7, 8], torch.cat([m.device_indices, extra]))
        assert r3.prefix_len == 6 and cache.statistics().device.free_pages == free0 - 4
        for h in (r1, r3, m):
            cache.release(h)
        engine.complete_all()
        await cache.flush()
        cache.check_invariants()


async def test_unaligned_tail_stays_with_caller(engine: ManualCopyEngine) -> None:
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        slots = cache.alloc(5)  # 3 pages
        assert slots.numel() == 6
        r = cache.insert([1, 2, 3, 4, 5], slots[:5])
        assert r.inserted_len == 4
        assert cache.statistics().device.held_pages == 1
        cache.free(slots[4:6])
        assert cache.statistics().device.held_pages == 0
        cache.release(r)
        cache.check_invariants()


@pytest.mark.parametrize(
    ("tokens", "error"),
    [
        ([1, 2.0, 3, 4], akv.InvalidTypeError),
        (["a", "b"], akv.InvalidTypeError),
        ([1, -2], akv.InvalidInputError),
        ([], akv.InvalidInputError),
        (torch.tensor([1.0, 2.0]), akv.InvalidInputError),
        (torch.tensor([[1, 2]]), akv.InvalidInputError),
        ("1234", akv.InvalidTypeError),
        ([1, 2**70], akv.InvalidInputError),
    ],
)
async def test_bad_tokens_raise_and_change_nothing(
    engine: ManualCopyEngine, tokens: object, error: type[Exception]
) -> None:
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        r = insert(cache, [1, 2, 3, 4])
        before = cache.statistics()
        with pytest.raises(error):
            cache.match_prefix(tokens)  # type: ignore[arg-type]
        slots = cache.alloc(2)
        mid = cache.statistics()
        with pytest.raises(error):
            cache.insert(tokens, slots)  # type: ignore[arg-type]
        assert cache.statistics() == mid
        cache.free(slots)
        assert cache.statistics() == before
        cache.release(r)
        cache.check_invariants()


async def test_bad_slots_raise_and_change_nothing(engine: ManualCopyEngine) -> None:
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        r = insert(cache, [1, 2, 3, 4])
        held = cache.alloc(4)
        events = cache.take_events()
        before = cache.statistics()  # after the drain: it counts the events pending
        bad: list[object] = [
            held.float(),  # wrong dtype
            held.view(2, 2),  # wrong shape
            [0, 1, 2, 3],  # not a tensor
            torch.tensor([0, 1, 2, 3]) + 10_000,  # out of range
            torch.tensor([1, 2, 5, 6]),  # not page aligned
            held[:2],  # too few slots
            torch.cat([held[:2], held[:2]]),  # a page twice
            torch.tensor([30, 31, 28, 29]),  # never allocated
        ]
        for slots in bad:
            with pytest.raises(akv.KVCacheError) as info:
                cache.insert([9, 9, 8, 8], slots)  # type: ignore[arg-type]
            assert isinstance(info.value, (ValueError, TypeError))
            assert cache.statistics() == before
        # the tree's own pages cannot be given as new pages
        m = cache.match_prefix([1, 2, 3, 4])
        with pytest.raises(akv.InvalidInputError):
            cache.insert([7, 7, 7, 7], m.device_indices)
        assert cache.take_events() == [] and events
        cache.release(m)
        cache.release(r)
        cache.free(held)
        engine.complete_all()
        await cache.flush()
        cache.check_invariants()


async def test_handles_and_lifecycle_errors(engine: ManualCopyEngine) -> None:
    cache = akv.HiCache(small_config(), copy_engine=engine)
    with pytest.raises(akv.CacheClosedError):
        cache.match_prefix([1, 2])
    async with cache:
        other = akv.HiCache(small_config(), copy_engine=ManualCopyEngine())
        async with other:
            m = other.match_prefix([1, 2])
            with pytest.raises(akv.HandleError):
                cache.release(m)
            other.release(m)
            with pytest.raises(akv.HandleError):
                other.release(m)
        assert cache.alloc(0).numel() == 0  # a full hit needs no rows
        with pytest.raises(akv.InvalidInputError):
            cache.alloc(-1)
        with pytest.raises(akv.CapacityError, match=r"need 17 pages, 16 free"):
            cache.alloc(34)
        with pytest.raises(akv.InvalidInputError):
            cache.device_kv(2)
        with pytest.raises(akv.InvalidInputError):
            cache.evict(1, tier="storage")
        slots = cache.alloc(2)
        cache.free(slots)
        with pytest.raises(akv.InvalidInputError, match="double free"):
            cache.free(slots)
    with pytest.raises(akv.CacheClosedError):
        cache.insert([1, 2], slots)
    with pytest.raises(akv.CacheClosedError):
        await cache.flush()


async def test_calls_from_another_thread_raise(engine: ManualCopyEngine) -> None:
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        errors: list[BaseException] = []

        def worker() -> None:
            for call in (lambda: cache.match_prefix([1, 2]), lambda: cache.alloc(2)):
                try:
                    call()
                except BaseException as exc:
                    errors.append(exc)

        th = threading.Thread(target=worker)
        th.start()
        await asyncio.to_thread(th.join)
        assert [type(e) for e in errors] == [akv.OwnershipError, akv.OwnershipError]
        assert cache.statistics().device.held_pages == 0


async def test_host_admission_fails_at_start_with_sizes() -> None:
    cfg = small_config(host_pages=(1 << 40) // 512, host_memory_reserve_bytes=1 << 30)
    with pytest.raises(akv.HostMemoryError, match=r"host pools need \d+ bytes .* reserved"):
        async with akv.HiCache(cfg):
            pass


async def test_config_errors_name_the_value() -> None:
    with pytest.raises(akv.ConfigError, match="page_size"):
        small_config(page_size=0)
    with pytest.raises(akv.ConfigError, match="write_policy"):
        small_config(write_policy="sometimes")
    with pytest.raises(akv.ConfigError, match="dtype"):
        small_config(dtype=torch.int8)
    with pytest.raises(akv.ConfigError, match="device"):
        small_config(device="tpu")


async def test_tenants_never_share_pages(engine: ManualCopyEngine) -> None:
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        slots = cache.alloc(4)
        r = cache.insert([1, 2, 3, 4], slots, tenant="alice")
        m = cache.match_prefix([1, 2, 3, 4], tenant="bob")
        assert m.matched_len == 0
        cache.release(m)
        m = cache.match_prefix([1, 2, 3, 4], lora="adapter-1", tenant="alice")
        assert m.matched_len == 0
        cache.release(m)
        m = cache.match_prefix([1, 2, 3, 4], tenant="alice")
        assert m.device_len == 4
        for h in (m, r):
            cache.release(h)
        # bob's and alice's adapter's namespaces hold nothing: reclaimed once released
        assert cache.statistics().namespaces == 1


async def test_selective_write_through_backs_up_on_second_hit(engine: ManualCopyEngine) -> None:
    async with akv.HiCache(
        small_config(write_policy="write_through_selective"), copy_engine=engine
    ) as cache:
        r = insert(cache, [1, 2, 3, 4])
        assert r.write_through is None and not engine.pending
        cache.release(r)
        cache.release(cache.match_prefix([1, 2, 3, 4]))
        assert not engine.pending
        cache.release(cache.match_prefix([1, 2, 3, 4]))
        assert len(engine.pending) == 1
        engine.complete_all()
        await cache.flush()
        assert cache.statistics().host.evictable_pages == 2
        cache.check_invariants()


async def test_write_back_stages_on_eviction() -> None:
    async with akv.HiCache(small_config(write_policy="write_back")) as cache:
        slots = cache.alloc(4)
        written = write_kv(cache, slots, seed=3)
        r = cache.insert([1, 2, 3, 4], slots)
        assert r.write_through is None
        cache.release(r)
        assert cache.statistics().host.evictable_pages == 0
        assert cache.evict(2) == 0  # staged, not freed yet: nothing blocks the loop
        await cache.flush()
        stats = cache.statistics()
        assert stats.device.free_pages == 16 and stats.host.evictable_pages == 2
        m = cache.match_prefix([1, 2, 3, 4])
        assert m.host_len == 4
        await cache.load_back(m)
        for a, b in zip(read_kv(cache, m.device_indices), written, strict=True):
            assert torch.equal(a, b)
        cache.release(m)
        cache.check_invariants()


async def test_filling_every_tier_evicts_instead_of_failing() -> None:
    cfg = small_config(page_size=2, device_pages=8, host_pages=8)
    async with akv.HiCache(cfg) as cache:
        for i in range(40):
            slots = await cache.alloc_wait(6)  # waits only for acks, never fails here
            write_kv(cache, slots, seed=i)
            cache.release(cache.insert([i, i, i + 1, i + 1, i + 2, i + 2], slots))
        with pytest.raises(akv.CapacityError):  # more than the pool: a clear error
            await cache.alloc_wait(18)
        await cache.flush()
        cache.check_invariants()
        stats = cache.statistics()
        assert stats.device.free_pages + stats.device.evictable_pages == 8
        assert stats.write_through_done >= 1


async def test_host_full_skips_backup_and_counts_it(engine: ManualCopyEngine) -> None:
    async with akv.HiCache(small_config(host_pages=1), copy_engine=engine) as cache:
        r = insert(cache, [1, 2, 3, 4])
        assert r.write_through is None
        assert cache.statistics().write_through_skipped_pages == 2
        cache.release(r)
        cache.check_invariants()


async def test_events_async_iteration_and_clear_on_close(engine: ManualCopyEngine) -> None:
    cache = akv.HiCache(small_config(), copy_engine=engine)
    seen: list[akv.KVEvent] = []

    async def consume() -> None:
        async for ev in cache.events():
            seen.append(ev)

    async with cache:
        task = asyncio.create_task(consume())
        r = insert(cache, [1, 2, 3, 4])
        engine.complete_all()
        await cache.flush()
        cache.release(r)
        cache.evict(2)
    await asyncio.wait_for(task, 5)
    kinds = [(type(e).__name__, getattr(e, "medium", None)) for e in seen]
    assert kinds == [
        ("BlockStored", "GPU"),
        ("BlockStored", "CPU"),
        ("BlockRemoved", "GPU"),
        ("BlockRemoved", "CPU"),  # at close: the host copy goes; storage would stay
    ]


async def test_statistics_and_repr(engine: ManualCopyEngine) -> None:
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        r = insert(cache, [1, 2, 3, 4])
        text = repr(cache)
        assert re.search(r"device=2/16 \(evictable=0 protected=2\)", text), text
        assert "in_flight=1" in text
        stats = cache.statistics()
        with pytest.raises(AttributeError):
            stats.nodes = 5  # type: ignore[misc]
        assert stats.ops_in_flight == 1 and stats.nodes == 1
        engine.complete_all()
        await cache.flush()
        cache.release(r)
        assert "device=2/16 (evictable=2 protected=0)" in repr(cache)
        assert "host=2/32 (evictable=2 protected=0)" in repr(cache)
