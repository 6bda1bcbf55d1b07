"""``HiCache.drop``: purge a prefix or a tenant from device, host and storage (issue #26).

Interleavings are made deterministic with the hand-completed copy engine and the gates of
``MemoryStorage`` (a put or read held in its worker until the test lets it go).
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

import aiocache_kv as akv
from aiocache_kv.errors import DropIncompleteError, InvalidInputError, InvalidTypeError
from aiocache_kv.metrics import CacheCollector
from aiocache_kv.namespace import namespace_of
from aiocache_kv.storage.base import PageBuffer
from aiocache_kv.storage.file import FileStorage
from aiocache_kv.testing import ManualCopyEngine, MemoryStorage
from aiocache_kv.tree.hashing import chain_hashes, namespace_seed
from tests.conftest import small_config
from tests.test_cache import read_kv
from tests.test_metrics import CollectorRegistry, scrape, val
from tests.test_split_ack import insert, write_kv

A = [1, 2, 3, 4, 5, 6]
B = [1, 2, 3, 4, 7, 8]


def removed(events: list[akv.KVEvent], medium: str) -> set[bytes]:
    return {h for e in events if isinstance(e, akv.BlockRemoved) and e.medium == medium
            for h in e.block_hashes}  # fmt: skip


def page_hash(tokens: list[int], i: int, *, tenant: str = "", p: int = 2) -> bytes:
    ns = namespace_of("default", tenant, "")
    return chain_hashes(namespace_seed(ns.tag), tokens[: (i + 1) * p], p)[i]


async def settle(cache: akv.HiCache) -> None:
    """Let the reaper and zeroing scheduled on the loop run (they are loop callbacks and
    tasks: nothing waits on a clock)."""
    purger = cache._purger
    await asyncio.sleep(0)
    if purger is not None and purger._tasks:
        await asyncio.wait(list(purger._tasks))


async def populated(cache: akv.HiCache, engine: ManualCopyEngine, *prompts: list[int]) -> None:
    for i, tokens in enumerate(prompts):
        r = insert(cache, tokens, seed=i)
        engine.complete_all()
        await cache.flush()
        cache.release(r)


async def test_drop_prefix_misses_siblings_survive_events(engine: ManualCopyEngine) -> None:
    async with akv.HiCache(small_config(enable_kv_events=True), copy_engine=engine) as cache:
        await populated(cache, engine, A, B)
        cache.take_events()
        res = await cache.drop(A)  # the page [5, 6] (A's last) and what follows it
        assert (res.nodes, res.device_pages, res.host_pages, res.deferred_nodes) == (1, 1, 1, 0)
        assert cache.cached_len(A) == 4 and cache.cached_len(B) == 6
        events = cache.take_events()
        assert removed(events, "GPU") == removed(events, "CPU") == {page_hash(A, 2)}
        cache.check_invariants()
        res = await cache.drop([1, 2, 3, 4, 99])  # whole pages only: [3, 4] and below
        assert res.nodes >= 2
        assert cache.cached_len(B) == 2 and cache.cached_len(A) == 2
        cache.check_invariants()
        stats = cache.statistics()
        assert stats.device.free_pages == stats.device.total_pages - 1
        assert stats.drops == 2 and stats.dropped_pages_device == 3
        assert stats.dropped_pages_host == 3
        # a prefix that is not cached drops nothing
        res = await cache.drop([50, 51, 52, 53])
        assert res.nodes == 0 and cache.statistics().drops == 2


async def test_drop_tenant_leaves_other_tenants(engine: ManualCopyEngine) -> None:
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        for tenant in ("a", "b"):
            r = cache.insert(A, cache.alloc(6), tenant=tenant)
            engine.complete_all()
            cache.release(r)
        r = cache.insert(B, cache.alloc(6), tenant="a", lora="x")
        engine.complete_all()
        cache.release(r)
        res = await cache.drop(tenant="a")  # every adapter of tenant a
        assert res.nodes >= 2
        assert cache.cached_len(A, tenant="a") == 0
        assert cache.cached_len(B, tenant="a", lora="x") == 0
        assert cache.cached_len(A, tenant="b") == 6
        assert cache.statistics().namespaces == 1
        cache.check_invariants()


async def test_drop_while_a_request_holds_the_match(engine: ManualCopyEngine) -> None:
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        slots = cache.alloc(6)
        written = write_kv(cache, slots, seed=3)
        r = cache.insert(A, slots)
        engine.complete_all()
        await cache.flush()
        cache.release(r)
        m = cache.match_prefix(A)
        assert m.device_len == 6
        res = await cache.drop(tenant=None)
        assert res.deferred_nodes == 1 and res.device_pages == 0
        assert cache.cached_len(A) == 0  # a new request misses and recomputes
        cache.check_invariants()
        cache.evict(100)  # an eviction meanwhile never takes the detached pages
        cache.check_invariants()
        for a, b in zip(read_kv(cache, m.device_indices), written, strict=True):
            assert torch.equal(a, b)  # still readable by the request that holds them
        r2 = insert(cache, A, seed=9)  # recomputed: new pages, no clash with the old ones
        engine.complete_all()
        cache.release(r2)
        cache.check_invariants()
        cache.release(m)
        await settle(cache)
        cache.check_invariants()
        stats = cache.statistics()
        assert stats.dropped_pages_device == 3 and stats.dropped_pages_host == 3
        await cache.drop()
        await settle(cache)
        stats = cache.statistics()
        assert stats.device.free_pages == stats.device.total_pages
        assert stats.host.free_pages == stats.host.total_pages
        assert stats.nodes == 0 and stats.namespaces == 0


async def test_drop_races_a_load_back_in_flight(engine: ManualCopyEngine) -> None:
    async with akv.HiCache(small_config(enable_kv_events=True), copy_engine=engine) as cache:
        await populated(cache, engine, A)
        cache.evict(100)  # device copies go: host-only now
        m = cache.match_prefix(A)
        assert (m.device_len, m.host_len) == (0, 6)
        load = asyncio.create_task(cache.load_back(m))
        await asyncio.sleep(0)
        assert engine.pending
        cache.take_events()
        res = await cache.drop(A[:2])
        assert res.deferred_nodes == 1
        # announced removed at once: nothing can match it any more
        assert removed(cache.take_events(), "CPU") == {page_hash(A, i) for i in range(3)}
        cache.check_invariants()
        engine.complete_all()  # lands on the detached node
        await load
        assert m.device_len == 6
        assert not cache.take_events()  # a dropped node's device copy is never announced
        cache.check_invariants()
        cache.release(m)
        await settle(cache)
        cache.check_invariants()
        stats = cache.statistics()
        assert stats.device.free_pages == stats.device.total_pages
        assert stats.host.free_pages == stats.host.total_pages


async def test_drop_races_a_write_through_in_flight(engine: ManualCopyEngine) -> None:
    store = MemoryStorage()
    async with akv.HiCache(small_config(storage=store), copy_engine=engine) as cache:
        r = insert(cache, A)
        cache.release(r)
        assert engine.pending
        res = await cache.drop(A)
        assert res.deferred_nodes == 1
        engine.complete_all()  # the host copy lands on a dropped node: no backup starts
        await cache.flush()
        await settle(cache)
        cache.check_invariants()
        keys = list(store.contents())  # the head that stays ([1, 2, 3, 4]) is backed up
        assert len(keys) == 2 and not any(page_hash(A, 2).hex() in k for k in keys)
        stats = cache.statistics()
        assert stats.device.free_pages == stats.device.total_pages - 2
        assert stats.host.free_pages == stats.host.total_pages - 2


async def test_zeroize_overwrites_freed_pages(engine: ManualCopyEngine) -> None:
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        await populated(cache, engine, A, [9, 9, 8, 8])
        m = cache.match_prefix(A)
        dev = m.device_indices.view(-1, 2)[:, 0] // 2  # page ids
        cache.release(m)
        host = cache.host_pool
        assert host is not None
        rows = sorted(_host_rows(cache, A))
        assert len(rows) == 3 and bool((host.raw[rows] != 0).any())
        keep = cache.match_prefix([9, 9, 8, 8])
        keep_dev = keep.device_indices.clone()
        cache.release(keep)
        keep_kv = read_kv(cache, keep_dev)
        res = await cache.drop(A[:2], zeroize=True)  # all three pages of A
        pool = cache.device_pool
        assert pool is not None
        assert res.zeroized_bytes == 3 * pool.nbytes // pool.num_pages + 3 * host.raw.shape[1]
        assert bool((pool.buffer[:, :, dev] == 0).all())
        assert bool((host.raw[rows] == 0).all())
        for a, b in zip(read_kv(cache, keep_dev), keep_kv, strict=True):
            assert torch.equal(a, b)  # the other prompt's pages are untouched
        assert cache.statistics().zeroized_bytes == res.zeroized_bytes
        cache.check_invariants()


def _host_rows(cache: akv.HiCache, tokens: list[int]) -> set[int]:
    node, _ = cache._core.tree.match(cache._default_ns, tokens, len(tokens))
    rows: set[int] = set()
    while node.parent is not None:
        assert node.host_pages is not None
        rows.update(int(x) for x in node.host_pages)
        node = node.parent
    return rows


async def test_zeroize_of_pages_in_use_waits_for_release(engine: ManualCopyEngine) -> None:
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        slots = cache.alloc(6)
        written = write_kv(cache, slots, seed=5)
        r = cache.insert(A, slots)
        engine.complete_all()
        await cache.flush()
        m = cache.match_prefix(A)
        cache.release(r)
        res = await cache.drop(A[:2], zeroize=True)
        assert res.deferred_nodes == 1 and res.zeroized_bytes == 0
        for a, b in zip(read_kv(cache, m.device_indices), written, strict=True):
            assert torch.equal(a, b)  # not zeroed under its reader
        idx = m.device_indices.clone()
        cache.release(m)
        await settle(cache)
        assert all(bool((t == 0).all()) for t in read_kv(cache, idx))
        stats = cache.statistics()
        assert stats.device.free_pages == stats.device.total_pages
        assert stats.device.quarantined_pages == 0 and stats.zeroized_bytes > 0
        cache.check_invariants()


async def test_hostile_inputs_raise_and_change_nothing(engine: ManualCopyEngine) -> None:
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        await populated(cache, engine, A)
        before = cache.statistics()
        bad: list[tuple[dict[str, object], type[Exception]]] = [
            ({"tokens": [1]}, InvalidInputError),  # shorter than a page
            ({"tokens": [1, -2]}, InvalidInputError),
            ({"tokens": "ab"}, InvalidTypeError),
            ({"tokens": [1.5, 2]}, InvalidTypeError),
            ({"tenant": 5}, InvalidTypeError),
            ({"lora": b"x"}, InvalidTypeError),
            ({"tiers": "device"}, InvalidTypeError),
            ({"tiers": ["device"]}, InvalidInputError),
            ({"tiers": ["gpu", "host"]}, InvalidInputError),
            ({"tiers": []}, InvalidInputError),
            ({"zeroize": 1}, InvalidTypeError),
            ({"timeout": math.nan}, InvalidInputError),
            ({"timeout": -1}, InvalidInputError),
            ({"timeout": math.inf}, InvalidInputError),
            ({"timeout": True}, InvalidInputError),
        ]
        for kwargs, err in bad:
            with pytest.raises(err):
                await cache.drop(**kwargs)  # type: ignore[arg-type]
        assert cache.statistics() == before
        assert cache.cached_len(A) == 6
        cache.check_invariants()


# ---------------------------------------------------------------------- storage


def fcfg(path: Path, **kw: object) -> akv.CacheConfig:
    opts: dict[str, object] = dict(
        storage=FileStorage(path), prefetch_threshold_tokens=0, prefetch_policy="wait_complete"
    )
    opts.update(kw)
    return small_config(**opts)


async def test_drop_tenant_removes_it_from_file_storage_for_every_node(tmp_path: Path) -> None:
    prompt = list(range(10, 26))
    async with akv.HiCache(fcfg(tmp_path, enable_kv_events=True)) as cache:
        for tenant in ("a", "b"):
            r = insert(cache, prompt, seed=1)
            r2 = cache.insert(prompt, cache.alloc(16), tenant=tenant)
            await cache.flush()
            cache.release(r)
            cache.release(r2)
        assert cache.statistics().backup_pages_ok == 24
        cache.take_events()
        res = await cache.drop(tenant="a")
        assert res.storage_pages == 8 and res.storage_claims == 8
        assert removed(cache.take_events(), "STORAGE") == set(
            chain_hashes(namespace_seed(namespace_of("default", "a", "").tag), prompt, 2)
        )
        cache.check_invariants()
    # another node over the same directory: it never saw tenant b's nor a's pages
    async with akv.HiCache(fcfg(tmp_path)) as cache:
        pa = await cache.prefetch(prompt, tenant="a")
        pb = await cache.prefetch(prompt, tenant="b")
        assert pa.hit_tokens == 0 and pb.hit_tokens == 16
        res = await cache.drop(tenant="b")  # pages this node never wrote
        assert res.storage_pages == 8
    async with akv.HiCache(fcfg(tmp_path)) as cache:
        assert (await cache.prefetch(prompt, tenant="b")).hit_tokens == 0
        assert (await cache.prefetch(prompt)).hit_tokens == 16  # the default tenant stays


async def test_drop_prefix_removes_its_pages_from_storage(tmp_path: Path) -> None:
    prompt = list(range(10, 26))
    async with akv.HiCache(fcfg(tmp_path)) as cache:
        r = insert(cache, prompt)
        await cache.flush()
        cache.release(r)
        res = await cache.drop(prompt[:8], tiers=["storage"])  # storage only: memory keeps it
        assert res.storage_pages == 5 and res.nodes == 0
        assert cache.cached_len(prompt) == 16
        cache.check_invariants()
    async with akv.HiCache(fcfg(tmp_path)) as cache:
        assert (await cache.prefetch(prompt)).hit_tokens == 6  # up to the dropped page


async def test_late_backup_put_is_removed_again() -> None:
    store = MemoryStorage()
    cfg = small_config(storage=store, storage_workers=2)
    async with akv.HiCache(cfg) as cache:
        store.gates["put"].clear()  # the backup's put waits in its worker
        r = insert(cache, A)
        await r.write_through  # type: ignore[misc]
        cache.release(r)
        res = await cache.drop(tenant=None)
        assert res.deferred_nodes == 1  # the backup still reads its host copy
        store.gates["put"].set()
        await cache.flush()  # the backup lands (on a dropped node: never claimed)
        await cache.flush()  # the late put's removal
        await settle(cache)
        assert not store.contents()
        stats = cache.statistics()
        assert stats.late_puts_removed == 3
        assert stats.host.free_pages == stats.host.total_pages
        cache.check_invariants()


class GatedRemove(MemoryStorage):
    """MemoryStorage whose ``remove`` and ``remove_tag`` wait for ``remove_gate`` (held in
    its worker)."""

    def __init__(self) -> None:
        super().__init__()
        self.remove_gate = threading.Event()
        self.remove_gate.set()

    def remove(self, keys: Sequence[str]) -> list[bool]:
        self.remove_gate.wait(self.gate_timeout)
        return super().remove(keys)

    def remove_tag(self, tag: str) -> int:
        self.remove_gate.wait(self.gate_timeout)
        return super().remove_tag(tag)


async def until(cond: Callable[[], bool]) -> None:
    """Until ``cond()`` (state a worker thread changes: no loop event to await)."""
    async with asyncio.timeout(10):
        while not cond():  # noqa: ASYNC110 (a thread's state: no asyncio.Event to wait on)
            await asyncio.sleep(0.001)


async def test_prefetch_in_flight_is_not_attached(engine: ManualCopyEngine) -> None:
    store = GatedRemove()
    cfg = small_config(
        storage=store,
        enable_kv_events=True,  # the pages' claims outlive their nodes: the drop finds them
        storage_workers=4,  # the 3 pages' reads take 3: one stays free for the removal
        prefetch_threshold_tokens=0,
        prefetch_policy="wait_complete",
    )
    async with akv.HiCache(cfg, copy_engine=engine) as cache:
        await populated(cache, engine, A)
        await cache.flush()
        cache.evict(100)
        cache.evict(100, "host")
        assert cache.cached_len(A) == 0 and len(store.contents()) == 3
        io = cache._l3.io  # type: ignore[union-attr]
        store.gates["get_into"].clear()
        fetch = asyncio.create_task(cache.prefetch(A))
        await until(lambda: io.io_statistics().in_flight == 3)  # the reads wait in workers
        store.remove_gate.clear()
        drop = asyncio.create_task(cache.drop(A[:2]))
        await until(lambda: io.io_statistics().in_flight == 4)  # the removal waits too
        store.gates["get_into"].set()  # the reads find the pages: read before the removal
        got = await fetch
        assert got.hit_tokens == 0 and cache.cached_len(A) == 0  # but nothing is attached
        store.remove_gate.set()
        res = await drop
        assert res.storage_pages == 3 and not store.contents()
        stats = cache.statistics()
        assert stats.prefetch_dropped == 1 and stats.host.free_pages == stats.host.total_pages
        cache.check_invariants()


async def test_storage_failure_reports_incomplete_drop(engine: ManualCopyEngine) -> None:
    class Broken(MemoryStorage):
        def remove_tag(self, tag: str) -> int:
            raise akv.StorageError("store down")

    async with akv.HiCache(small_config(storage=Broken()), copy_engine=engine) as cache:
        await populated(cache, engine, A)
        with pytest.raises(DropIncompleteError) as info:
            await cache.drop()
        assert cache.cached_len(A) == 0  # device and host were dropped
        assert info.value.result is not None
        cache.check_invariants()


async def test_drop_metrics(engine: ManualCopyEngine) -> None:
    store = MemoryStorage()
    async with akv.HiCache(small_config(storage=store), copy_engine=engine) as cache:
        reg = CollectorRegistry()
        CacheCollector(cache, registry=reg)
        await populated(cache, engine, A)
        await cache.flush()
        res = await cache.drop(zeroize=True)
        types, s = scrape(reg)
        assert types["aiocache_kv_dropped_pages"] == "counter"
        assert val(s, "aiocache_kv_drops_total") == 1
        assert val(s, "aiocache_kv_dropped_pages_total", tier="device") == 3
        assert val(s, "aiocache_kv_dropped_pages_total", tier="host") == 3
        assert val(s, "aiocache_kv_dropped_pages_total", tier="storage") == 3
        assert val(s, "aiocache_kv_zeroized_bytes_total") == res.zeroized_bytes > 0
        assert val(s, "aiocache_kv_drop_races_total", kind="prefetch") == 0


async def test_timed_out_tenant_drop_still_retracts_its_storage_claims(
    engine: ManualCopyEngine,
) -> None:
    """Found by the stress test: a tenant drop whose ``remove_tag`` timed out kept the claims
    of pages that had left the tree, while its worker went on and removed the keys (claims
    the store no longer backs).  They are retracted whatever the removal's outcome."""

    store = GatedRemove()
    store.remove_gate.clear()
    cfg = small_config(storage=store, enable_kv_events=True)
    async with akv.HiCache(cfg, copy_engine=engine) as cache:
        await populated(cache, engine, A)
        await cache.flush()
        cache.evict(100)
        cache.evict(100, "host")  # the nodes are gone; their storage claims stay
        assert cache.cached_len(A) == 0 and len(store.contents()) == 3
        cache.take_events()
        with pytest.raises(DropIncompleteError):
            await cache.drop(timeout=0.05)  # the removal waits in its worker
        want = {page_hash(A, i) for i in range(3)}
        assert removed(cache.take_events(), "STORAGE") == want
        store.remove_gate.set()
        await until(lambda: not store.contents())  # the worker removed them after all
        cache.check_invariants()


async def test_drop_between_backup_pump_and_put_removes_the_late_put() -> None:
    """Found by the stress test: a backup taken off the queue for a put whose task has not
    run yet was neither queued nor putting, so a drop in that window did not mark it, and
    its put stored the dropped pages for good.  It is marked and its put removed again.
    (A put handed to a worker by the pump itself has no such window: the put here takes the
    task path, which a TP rank or a full executor still take.)"""
    store = MemoryStorage()
    async with akv.HiCache(small_config(storage=store)) as cache:
        l3 = cache._l3
        assert l3 is not None
        l3._send = lambda group, pages, parts: False  # type: ignore[method-assign]
        pump = l3._pump
        drops: list[asyncio.Task[object]] = []

        def drop_then_pump() -> None:  # the drop's first step runs before the put's task
            l3._pump = pump  # type: ignore[method-assign]
            drops.append(asyncio.ensure_future(cache.drop()))
            pump()

        l3._pump = drop_then_pump  # type: ignore[method-assign]
        r = insert(cache, A)
        await r.write_through  # type: ignore[misc]
        cache.release(r)
        await until(lambda: bool(drops))
        await drops[0]
        await cache.flush()  # the put lands on dropped nodes: never claimed
        await cache.flush()  # the late put's removal
        await settle(cache)
        assert not store.contents()
        assert cache.statistics().late_puts_removed == 3
        cache.check_invariants()


async def test_no_backup_of_a_namespace_while_its_drop_removes_keys(
    engine: ManualCopyEngine,
) -> None:
    """A tenant drop removes every key of its tag on a worker.  A page computed again
    meanwhile must not be put then: the removal could delete it under its claim (the stress
    test caught STORAGE claims the store lacked).  It is backed up at a later hit instead."""
    store = GatedRemove()
    cfg = small_config(storage=store, enable_kv_events=True, storage_workers=2)
    async with akv.HiCache(cfg, copy_engine=engine) as cache:
        await populated(cache, engine, A)
        assert len(store.contents()) == 3
        cache.take_events()
        store.remove_gate.clear()
        drop = asyncio.create_task(cache.drop(tenant=None))
        await asyncio.sleep(0)  # the drop detached A and waits for its removal (gated)
        assert not drop.done()
        r = insert(cache, A, seed=1)  # computed again while the keys are being removed
        engine.complete_all()
        await r.write_through  # type: ignore[misc]
        await asyncio.sleep(0)  # the landing copy would start the backup now
        st = cache.statistics()
        assert st.backup_skipped_pages == 3 and st.storage_in_flight == 0, st  # not put
        cache.release(r)
        store.remove_gate.set()
        await drop
        stored = [e for e in cache.take_events() if getattr(e, "medium", "") == "STORAGE"]
        assert not any(isinstance(e, akv.BlockStored) for e in stored)
        assert not store.contents()
        m = cache.match_prefix(A)  # the hit backs it up now
        cache.release(m)
        await cache.flush()
        assert len(store.contents()) == 3
        claims = [e for e in cache.take_events() if isinstance(e, akv.BlockStored)]
        assert any(e.medium == "STORAGE" for e in claims)
        cache.check_invariants()


async def test_a_parent_dropped_after_its_busy_child_waits_for_it(
    engine: ManualCopyEngine,
) -> None:
    """Found by the state machine: a page dropped while its write-through was in flight hangs
    detached below its parent; a later drop of the parent must not free the parent first
    (its device copy would go while the child's still counts on it)."""
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        await populated(cache, engine, A[:2])
        r = insert(cache, A[:4], seed=1)  # the second page's write-through stays in flight
        cache.release(r)
        await cache.drop(A[:4])  # the child: detached, busy with its copy
        res = await cache.drop(A[:2])  # the parent: idle, but the child hangs below it
        assert res.deferred_nodes == 1
        await settle(cache)
        cache.check_invariants()
        engine.complete_all()  # the child's copy lands: both go, child first
        await cache.flush()
        await settle(cache)
        cache.check_invariants()
        st = cache.statistics()
        assert st.device.free_pages == st.device.total_pages and st.nodes == 0, st


async def test_late_put_of_an_evicted_node_is_removed_by_a_tenant_drop() -> None:
    """Found by the stress test (seed 1): a backup missed its deadline, its node was evicted
    from the tree, then the tenant was dropped; the put, still in its worker, landed after the
    drop's removal and stayed.  A tenant drop marks every put of its namespaces."""
    store = MemoryStorage()
    cfg = small_config(storage=store, storage_workers=2, storage_timeout=0.1)
    async with akv.HiCache(cfg) as cache:
        store.gates["put"].clear()  # the backup's put waits in its worker past its deadline
        r = insert(cache, A)
        await r.write_through  # type: ignore[misc]
        cache.release(r)
        await cache.flush()  # the backup failed at its deadline; its put still runs
        cache.evict(100)
        cache.evict(100, "host")
        assert cache.statistics().nodes == 0  # the node left the tree by eviction
        await cache.drop(tenant=None)
        store.gates["put"].set()  # the late put lands now, after the drop's removal
        for _ in range(500):
            if not cache.statistics().storage_calls_running:
                break
            await asyncio.sleep(0.01)
        await cache.flush()  # the late put's removal
        await settle(cache)
        assert not store.contents()
        assert cache.statistics().late_puts_removed == 3
        cache.check_invariants()


async def _late_puts(cache: akv.HiCache, store: MemoryStorage, *prompts: list[int]) -> None:
    """Back ``prompts`` up with every put held in its worker past its deadline: the backups
    fail, the puts still run (until ``store.gates["put"]`` is set)."""
    store.gates["put"].clear()
    for tokens in prompts:
        r = insert(cache, tokens)
        await r.write_through  # type: ignore[misc]
        cache.release(r)
    await cache.flush()  # every backup failed at its deadline; the puts still run


async def _puts_done(cache: akv.HiCache, store: MemoryStorage) -> None:
    store.gates["put"].set()  # the late puts land now, after the drop's removal
    for _ in range(500):
        if not cache.statistics().storage_calls_running:
            break
        await asyncio.sleep(0.01)
    await cache.flush()  # the late puts' removal
    await settle(cache)


async def test_late_put_of_an_evicted_node_is_removed_by_a_prefix_drop() -> None:
    """A prefix drop marks the puts of every node holding the prefix's last page or
    continuing it, found through the parents an evicted node keeps; a late put of another
    prompt of the same tenant lands and stays."""
    store = MemoryStorage()
    cfg = small_config(storage=store, storage_workers=4, storage_timeout=0.1)  # one free
    other = [11, 12, 13, 14]
    async with akv.HiCache(cfg) as cache:
        await _late_puts(cache, store, A, other)
        cache.evict(100)
        cache.evict(100, "host")
        assert cache.statistics().nodes == 0  # both left the tree by eviction
        await cache.drop(A)
        await _puts_done(cache, store)
        assert len(store.contents()) == 2  # the other prompt's two pages only
        assert cache.statistics().late_puts_removed == 3  # A's node: its three pages
        cache.check_invariants()


@pytest.mark.parametrize("prefix", [True, False], ids=["prefix", "tenant"])
async def test_late_put_is_removed_by_a_storage_only_drop(prefix: bool) -> None:
    """A storage-only drop leaves the nodes in the tree and waits for their backups; a put
    that already landed (failed at its deadline) and still runs is marked, evicted node or
    not, and what it put is removed when it is done."""
    store = MemoryStorage()
    cfg = small_config(storage=store, storage_workers=4, storage_timeout=0.1)  # one free
    async with akv.HiCache(cfg) as cache:
        await _late_puts(cache, store, A, [11, 12, 13, 14])
        cache.evict(100)
        cache.evict(100, "host")
        assert cache.statistics().nodes == 0
        await _late_puts(cache, store, B)  # B's node stays in the tree
        assert cache.cached_len(B) == 6
        if prefix:
            await cache.drop(B[:4], tiers=["storage"])  # [3, 4] and what continues it
        else:
            await cache.drop(tenant=None, tiers=["storage"])
        await _puts_done(cache, store)
        # prefix: A's node holds [3, 4], B's node too (they share their first two keys)
        assert len(store.contents()) == (2 if prefix else 0)
        assert cache.statistics().late_puts_removed >= 1
        assert cache.cached_len(B) == 6  # memory untouched
        cache.check_invariants()


def test_continues_walks_the_parents_an_evicted_node_keeps() -> None:
    from aiocache_kv.tree.node import Node, continues

    root = Node([], None, "ns")
    head = Node([1, 2, 3, 4], root, "ns")
    tail = Node([5, 6, 7, 8], head, "ns")
    assert continues(tail, [1, 2, 3, 4, 5, 6], 2)  # holds the last page
    assert continues(tail, [1, 2], 2)  # continues it
    assert continues(head, [1, 2, 3, 4, 5, 6], 2) is False  # ends before the last page
    assert continues(head, [1, 2, 3, 4], 2)  # holds it
    assert not continues(tail, [1, 2, 3, 9, 5, 6], 2)  # another path
    assert not continues(tail, [1, 2, 3, 4, 5, 6, 7, 9], 2)  # diverges in its own key


async def test_aclose_waits_for_a_drops_zeroing(
    engine: ManualCopyEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pages a drop freed late (their reader released them after the drop) are zeroed on a
    worker thread; ``aclose`` returns only once that zeroing is done, not with the thread
    still writing the pools."""
    from aiocache_kv.purge import Purger

    gate = threading.Event()
    done: list[int] = []
    zero = Purger._zero_pages

    def held_zero(self: Purger, dflat: torch.Tensor, hflat: torch.Tensor) -> int:
        assert gate.wait(10), "the zeroing was never let go"
        n = zero(self, dflat, hflat)
        done.append(n)
        return n

    monkeypatch.setattr(Purger, "_zero_pages", held_zero)
    cache = akv.HiCache(small_config(), copy_engine=engine)
    await cache.start()
    try:
        await populated(cache, engine, A)
        m = cache.match_prefix(A)
        res = await cache.drop(A[:2], zeroize=True)
        assert res.deferred_nodes == 1  # in use: zeroed when released
        cache.release(m)
        await asyncio.sleep(0)  # the reaper frees the pages and starts the zeroing
    finally:
        asyncio.get_running_loop().call_later(0.2, gate.set)
        await cache.aclose()
    assert done and done[0] > 0  # zeroed before aclose returned


class _FirstPutHeld(MemoryStorage):
    """The first put waits in its worker until ``hold`` is set; the rest run at once."""

    def __init__(self) -> None:
        super().__init__()
        self.hold = threading.Event()
        self._first = True

    def put(
        self,
        keys: Sequence[str],
        buffers: Sequence[PageBuffer],
        identities: Sequence[bytes] | None = None,
    ) -> list[bool]:
        if self._first:
            self._first = False
            assert self.hold.wait(10), "the held put was never let go"
        return super().put(keys, buffers, identities)


async def test_late_put_removal_retracts_a_claim_made_after_the_drop() -> None:
    """A late put marked by a drop is removed when its worker returns, which may be after
    the same pages, computed again after the drop, were backed up and claimed (the removal
    takes the keys they share): their claims go with it (``BlockRemoved``), never a claim
    the store no longer backs; a later hit backs them up again."""
    store = _FirstPutHeld()
    cfg = small_config(
        storage=store,
        storage_workers=3,
        storage_timeout=0.1,
        storage_retry_seconds=0,  # no back-off after the first backup failed
        enable_kv_events=True,
    )
    async with akv.HiCache(cfg) as cache:
        r = insert(cache, A)
        await r.write_through  # type: ignore[misc]
        cache.release(r)
        await cache.flush()  # the backup failed at its deadline; its put is still held
        cache.evict(100)
        cache.evict(100, "host")
        await cache.drop(tenant=None)  # marks the held put
        r = insert(cache, A, seed=1)  # computed again after the drop
        await r.write_through  # type: ignore[misc]
        cache.release(r)
        await cache.flush()  # backed up and claimed
        assert len(store.contents()) == 3
        cache.take_events()
        store.hold.set()  # the late put returns; its removal takes the shared keys
        for _ in range(500):
            if not cache.statistics().storage_calls_running:
                break
            await asyncio.sleep(0.01)
        await cache.flush()
        await settle(cache)
        claimed = {
            h for e in cache.snapshot_events() if e.medium == "STORAGE" for h in e.block_hashes
        }
        assert not claimed or len(store.contents()) == 3, "a claim the store does not back"
        assert not claimed and not store.contents()
        assert removed(cache.take_events(), "STORAGE") == {page_hash(A, i) for i in range(3)}
        m = cache.match_prefix(A)  # the hit backs them up again
        cache.release(m)
        await cache.flush()
        assert len(store.contents()) == 3
        cache.check_invariants()
