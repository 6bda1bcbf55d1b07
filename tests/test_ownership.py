"""Buffer ownership, hostile input and bounded waits (the wrong-KV issue, items 1-15).

Each test here failed on the code before its fix: a late storage put that stored another
prompt's KV, a child load-back racing a failing parent, untyped errors after state changed,
namespaces that never went away, waits on workers without a bound.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

import aiocache_kv as akv
from aiocache_kv.events import BlockStored
from aiocache_kv.namespace import Namespace, namespace_of
from aiocache_kv.storage import FileStorage, PageBuffer
from aiocache_kv.testing import ManualCopyEngine
from tests.conftest import small_config
from tests.test_cache import read_kv
from tests.test_split_ack import insert, write_kv

A = list(range(10, 18))  # 8 tokens = 4 pages of 2
B = list(range(50, 58))


class GatedStorage(FileStorage):
    """FileStorage whose puts and reads wait for a gate (a stalled store), then run."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.put_gate = threading.Event()
        self.put_gate.set()
        self.get_gate = threading.Event()
        self.get_gate.set()
        self.close_gate = threading.Event()
        self.close_gate.set()

    def put(
        self,
        keys: Sequence[str],
        buffers: Sequence[PageBuffer],
        identities: Sequence[bytes] | None = None,
    ) -> list[bool]:
        self.put_gate.wait(30)
        return super().put(keys, buffers, identities)

    def put_chain(
        self,
        keys: Sequence[str],
        buffers: Sequence[PageBuffer],
        parents: Sequence[str | None],
        identities: Sequence[bytes] | None = None,
    ) -> list[bool]:
        self.put_gate.wait(30)  # the cache's backups come this way
        return super().put_chain(keys, buffers, parents, identities)

    def get_into(
        self,
        keys: Sequence[str],
        buffers: Sequence[PageBuffer],
        identities: Sequence[bytes] | None = None,
    ) -> list[bool]:
        self.get_gate.wait(30)
        return super().get_into(keys, buffers, identities)

    def close(self) -> None:
        self.close_gate.wait(30)
        super().close()


def storage_cfg(store: FileStorage, **kw: object) -> akv.CacheConfig:
    opts: dict[str, object] = dict(
        storage=store, prefetch_threshold_tokens=0, prefetch_policy="wait_complete"
    )
    opts.update(kw)
    return small_config(**opts)


async def served_kv(path: Path, tokens: list[int]) -> list[torch.Tensor]:
    """What a fresh node on ``path`` serves for ``tokens`` (prefetch, match, load back)."""
    async with akv.HiCache(storage_cfg(FileStorage(path))) as cache:
        res = await cache.prefetch(tokens)
        assert res.hit_tokens == len(tokens), res
        m = cache.match_prefix(tokens)
        await cache.load_back(m)
        assert m.device_len == len(tokens)
        kv = read_kv(cache, m.device_indices)
        cache.release(m)
        return kv


# ---------------------------------------------------------------- 1: late backup puts


async def test_late_backup_put_stores_the_bytes_it_was_given(tmp_path: Path) -> None:
    """A put that misses its deadline keeps its host pages: when it finally runs, it stores
    the KV of the keys it names, never what the loop put into reused pages meanwhile."""
    store = GatedStorage(tmp_path)
    # the host pool holds exactly one prompt: B's write-through would reuse A's pages
    cfg = storage_cfg(store, host_pages=4, storage_timeout=0.3)
    async with akv.HiCache(cfg) as cache:
        store.put_gate.clear()  # the store stalls
        slots = cache.alloc(len(A))
        kv_a = write_kv(cache, slots, seed=1)
        r = cache.insert(A, slots)
        await r.write_through
        cache.release(r)
        await cache.flush()  # bounded: the put missed its deadline
        stats = cache.statistics()
        assert stats.backup_pages_failed == 4 and stats.backup_pages_ok == 0
        # A's node is evicted everywhere; its host pages stay with the stuck worker
        cache.evict(100, "device")
        cache.evict(100, "host")
        stats = cache.statistics()
        assert stats.nodes == 0 and stats.host.quarantined_pages == 4
        assert stats.host.free_pages == 0
        slots = cache.alloc(len(B))
        write_kv(cache, slots, seed=2)
        r = cache.insert(B, slots)  # no host page for B: its write-through is skipped
        assert r.write_through is None
        cache.release(r)
        store.put_gate.set()  # the late put runs now
        await cache.flush()
        stats = cache.statistics()
        assert stats.host.quarantined_pages == 0 and stats.host.free_pages == 4
        cache.check_invariants()
    served = await served_kv(tmp_path, A)
    for got, want in zip(served, kv_a, strict=True):
        assert torch.equal(got, want), "a late put stored other KV under A's keys"


# ---------------------------------------------------------------- 3: child load under parent


def host_only_chain(cache: akv.HiCache, engine: ManualCopyEngine) -> None:
    """[1,2,3,4] and [1,2,3,4,5,6,7,8] on host only (two nodes, parent and child)."""
    for r in (insert(cache, [1, 2, 3, 4], seed=1), insert(cache, list(range(1, 9)), seed=2)):
        engine.complete_all()
        cache.release(r)
    cache.evict(100, "device")


async def test_child_load_waits_for_a_failing_parent(engine: ManualCopyEngine) -> None:
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        host_only_chain(cache, engine)
        await cache.flush()
        m1 = cache.match_prefix([1, 2, 3, 4])
        m2 = cache.match_prefix(list(range(1, 9)))
        assert (m1.host_len, m2.host_len) == (4, 8)
        t1 = asyncio.create_task(cache.load_back(m1))
        await asyncio.sleep(0)
        t2 = asyncio.create_task(cache.load_back(m2))
        await asyncio.sleep(0)
        assert len(engine.pending) == 1, "the child's copy must wait for its parent's"
        engine.fail(0)
        for t in (t1, t2):
            with pytest.raises(akv.TransferError):
                await t
        assert not engine.pending
        cache.check_invariants()
        assert (m2.device_len, m2.host_len) == (0, 8)
        for m in (m1, m2):
            cache.release(m)
        assert cache.statistics().device.free_pages == 16


async def test_child_device_event_follows_its_parent(engine: ManualCopyEngine) -> None:
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        host_only_chain(cache, engine)
        cache.take_events()
        m1 = cache.match_prefix([1, 2, 3, 4])
        m2 = cache.match_prefix(list(range(1, 9)))
        t1 = asyncio.create_task(cache.load_back(m1))
        await asyncio.sleep(0)
        t2 = asyncio.create_task(cache.load_back(m2))
        await asyncio.sleep(0)
        assert len(engine.pending) == 1, "a child copy ran beside its parent's"
        engine.complete(0)
        await t1
        for _ in range(5):
            await asyncio.sleep(0)
        assert len(engine.pending) == 1  # the child's copy starts once the parent landed
        engine.complete(0)
        await t2
        gpu = [e for e in cache.take_events() if isinstance(e, BlockStored) and e.medium == "GPU"]
        assert [len(e.token_ids) for e in gpu] == [4, 4]
        assert gpu[1].parent_block_hash == gpu[0].block_hashes[-1]
        assert m2.device_len == 8
        cache.check_invariants()
        for m in (m1, m2):
            cache.release(m)


# ---------------------------------------------------------------- 7, 8, 12: bounded waits


async def test_stuck_prefetch_reader_bounds_flush_and_close(tmp_path: Path) -> None:
    store = GatedStorage(tmp_path)
    async with akv.HiCache(storage_cfg(store)) as cache:
        slots = cache.alloc(len(A))
        write_kv(cache, slots, seed=3)
        cache.release(cache.insert(A, slots))
        await cache.flush()
    store = GatedStorage(tmp_path)
    store.get_gate.clear()  # every read hangs (a FIFO, a stalled store)
    cfg = storage_cfg(store, storage_timeout=0.3)
    try:
        cache = akv.HiCache(cfg)
        await cache.start()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        task = asyncio.create_task(cache.prefetch(A))
        for _ in range(100):
            await asyncio.sleep(0.005)
            if cache.statistics().prefetch_reserved_pages:
                break
        cache.check_invariants()  # a prefetch in flight pins its anchor: still consistent
        res = await task
        assert res.hit_tokens == 0
        await cache.flush()
        assert cache.statistics().host.quarantined_pages == 4
        cache.check_invariants()
        await cache.aclose()
        assert loop.time() - t0 < 5.0, "flush/aclose waited for a stuck worker"
    finally:
        store.get_gate.set()


async def test_close_with_a_hung_backend_is_bounded(tmp_path: Path) -> None:
    store = GatedStorage(tmp_path)
    store.close_gate.clear()  # backend.close hangs (a master stopped with SIGSTOP)
    try:
        loop = asyncio.get_running_loop()
        async with akv.HiCache(storage_cfg(store, storage_timeout=0.3)) as cache:
            cache.release(insert(cache, A))
            await cache.flush()
            t0 = loop.time()
        assert loop.time() - t0 < 3.0
    finally:
        store.close_gate.set()


# ---------------------------------------------------------------- 9, 5, 6, 10: input


@pytest.mark.parametrize("bad", [1 << 63, (1 << 64) - 1, -1])
async def test_out_of_range_token_is_typed_and_changes_nothing(tmp_path: Path, bad: int) -> None:
    cfg = storage_cfg(FileStorage(tmp_path), enable_kv_events=False)
    async with akv.HiCache(cfg) as cache:
        before = cache.statistics()
        toks = [1, 2, 3, bad]
        slots = cache.alloc(4)
        with pytest.raises(akv.InvalidInputError, match="2\\*\\*63"):
            cache.insert(toks, slots)
        with pytest.raises(akv.InvalidInputError):
            await cache.prefetch(toks)
        with pytest.raises(akv.InvalidInputError):
            cache.match_prefix(toks)
        cache.free(slots)
        after = cache.statistics()
        assert after == before
        cache.check_invariants()


def test_namespace_tags_are_injective() -> None:
    a = Namespace("m", "alice", "x\x1fy")
    b = Namespace("m", "alice\x1fx", "y")
    assert a.tag != b.tag
    assert Namespace("m", "a", "").tag != Namespace("m", "", "a").tag


async def test_separator_in_names_does_not_share_stored_pages(tmp_path: Path) -> None:
    async with akv.HiCache(storage_cfg(FileStorage(tmp_path))) as cache:
        slots = cache.alloc(len(A))
        write_kv(cache, slots, seed=5)
        cache.release(cache.insert(A, slots, tenant="alice", lora="x\x1fy"))
        await cache.flush()
        assert cache.statistics().backup_pages_ok == 4
    async with akv.HiCache(storage_cfg(FileStorage(tmp_path))) as cache:
        res = await cache.prefetch(A, tenant="alice\x1fx", lora="y")
        assert res.storage_hit_tokens == 0, "another tenant's stored pages were visible"
        res = await cache.prefetch(A, tenant="alice", lora="x\x1fy")
        assert res.hit_tokens == len(A)


@pytest.mark.parametrize("bad", [0, False, ["a"], b"alice", 1.5])
async def test_tenant_and_lora_must_be_str(engine: ManualCopyEngine, bad: object) -> None:
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        with pytest.raises(akv.InvalidTypeError, match="tenant must be a str"):
            cache.match_prefix([1, 2], tenant=bad)  # type: ignore[arg-type]
        with pytest.raises(akv.InvalidTypeError, match="lora must be a str"):
            cache.match_prefix([1, 2], lora=bad)  # type: ignore[arg-type]
        assert cache.statistics().namespaces == 0


async def test_one_off_tenants_cost_nothing(engine: ManualCopyEngine) -> None:
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        for i in range(3000):
            tenant = f"salt-{i}"
            m = cache.match_prefix([1, 2, 3, 4], tenant=tenant)
            cache.release(m)
            if i % 3 == 0:
                slots = cache.alloc(4)
                r = cache.insert([1, 2, 3, 4], slots, tenant=tenant)
                engine.complete_all()
                cache.release(r)
                cache.evict(100, "device")
                cache.evict(100, "host")
        cache.check_invariants()
        stats = cache.statistics()
        assert stats.namespaces == 0 and stats.nodes == 0
        assert namespace_of.cache_info().currsize <= 4096


# ---------------------------------------------------------------- 13, 14, 15


async def test_hopeless_alloc_evicts_nothing(engine: ManualCopyEngine) -> None:
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        r = insert(cache, [1, 2, 3, 4])
        engine.complete_all()
        cache.release(r)
        with pytest.raises(akv.CapacityError, match="need 17 pages"):
            cache.alloc(34)
        m = cache.match_prefix([1, 2, 3, 4])
        assert m.device_len == 4, "a hopeless alloc evicted other requests' pages"
        cache.release(m)


async def test_take_events_checks_the_owner_thread(engine: ManualCopyEngine) -> None:
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        cache.release(insert(cache, [1, 2]))
        with pytest.raises(akv.OwnershipError):
            await asyncio.to_thread(cache.take_events)
        assert len(cache.take_events()) == 1


async def test_device_pool_too_large_is_a_config_error() -> None:
    cache = akv.HiCache(small_config(device_pages=2**40))
    with pytest.raises(akv.ConfigError, match=str(2**40)):
        await cache.start()


async def test_cuda_without_cuda_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cache = akv.HiCache(small_config(device="cuda"))
    with pytest.raises(akv.ConfigError, match="CUDA is not available"):
        await cache.start()


async def test_device_tensors_are_rejected_without_reading_them(
    engine: ManualCopyEngine,
) -> None:
    """Reading a CUDA tensor on the loop would wait for the device (a meta tensor stands in)."""
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        with pytest.raises(akv.InvalidInputError, match="tokens tensor must be on the CPU"):
            cache.match_prefix(torch.tensor([1, 2], device="meta"))
        slots = cache.alloc(2)
        with pytest.raises(akv.InvalidInputError, match="kv_indices must be a CPU tensor"):
            cache.insert([1, 2], slots.to("meta"))
        cache.free(slots)


# ---------------------------------------------------------------- first-hour seams


async def test_handles_are_context_managers_and_alloc_zero_is_empty(
    engine: ManualCopyEngine,
) -> None:
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        assert cache.alloc(0).numel() == 0
        slots = cache.alloc(5)  # 3 pages: the 5th token's page is the unaligned tail
        with cache.insert([1, 2, 3, 4, 5], slots[:5]) as r:
            assert (r.inserted_len, r.uncached_len) == (4, 1)
        assert r.state is akv.handles.HandleState.RELEASED
        cache.free(slots[4:])  # the tail's page stays the caller's
        with cache.match_prefix([1, 2, 3, 4]) as m:
            assert m.device_len == 4
            cache.release(m)  # released inside the block: the exit does nothing more
        engine.complete_all()
        cache.check_invariants()
        assert cache.statistics().device.protected_pages == 0
