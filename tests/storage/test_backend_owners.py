"""One cache per storage backend object (``storage/owners.py``).

Two caches handed the same backend object shared its per-user state: a second
``HiCache`` on one ``FileStorage`` took the first one's eviction notices (the first kept
claiming pages the store had evicted), the first close closed the backend under the other
(its backups then failed quietly), and a ``HiCache`` sharing a ``MooncakeStorage`` with an
``EmbeddingCache`` set ``defer_checksum`` on it, so the embedding reads checked trailers only.
The second user's start is now refused with a ``ConfigError`` and nothing of the first
changes.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from pathlib import Path

import pytest
import torch

import aiocache_kv as akv
from aiocache_kv.distributed.coordinator import LocalCoordinator
from aiocache_kv.embedding import EmbeddingCache
from aiocache_kv.errors import ConfigError, HostMemoryError, StorageUnavailableError
from aiocache_kv.storage import FileStorage, owners
from aiocache_kv.testing.memory_storage import MemoryStorage
from tests.conftest import small_config
from tests.flaky_stores import FlakyFile
from tests.test_split_ack import insert

from .conftest import MasterProc, loopback_client


class Owner:
    """A stand-in owner (owners are held weakly)."""


def cfg(store: akv.StorageBackend) -> akv.CacheConfig:
    return small_config(
        storage=store,
        storage_retry_seconds=0.0,
        prefetch_threshold_tokens=0,
        prefetch_policy="wait_complete",
    )


async def test_second_hicache_on_one_file_storage_is_refused(tmp_path: Path) -> None:
    store = FileStorage(tmp_path / "s", capacity_bytes=None)
    async with akv.HiCache(cfg(store)) as first:
        first.release(insert(first, [1, 2, 3, 4]))
        await first.flush()
        stored = store.total_bytes()
        assert stored > 0
        second = akv.HiCache(cfg(store))
        with pytest.raises(ConfigError, match="already used by CacheCore"):
            await second.start()
        await second.aclose()  # must not close the first cache's backend
        # the first cache still backs up and reads: its backend is open and its own
        first.release(insert(first, [9, 8, 7, 6]))
        await first.flush()
        assert store.total_bytes() > stored
        assert first.statistics().backup_pages_failed == 0
        first.evict(1 << 30)
        first.evict(1 << 30, "host")
        res = await first.prefetch([9, 8, 7, 6], policy="wait_complete")
        assert res.hit_tokens == 4
        first.check_invariants()
    # closed: the claim ended, another cache may use the directory through a new object
    assert owners.usable_by(store, Owner())
    async with akv.HiCache(cfg(FileStorage(tmp_path / "s", capacity_bytes=None))) as third:
        res = await third.prefetch([1, 2, 3, 4], policy="wait_complete")
        assert res.hit_tokens == 4


async def test_claim_of_a_cache_collected_unclosed_is_void(tmp_path: Path) -> None:
    store = FileStorage(tmp_path / "s", capacity_bytes=None)
    owner = akv.HiCache(cfg(store))
    owners.claim(store, owner)
    assert not owners.usable_by(store, Owner())
    with pytest.raises(ConfigError):
        owners.claim(store, Owner())
    owners.claim(store, owner)  # the same owner again: no change
    del owner
    gc.collect()
    assert owners.usable_by(store, Owner())
    other = Owner()
    owners.claim(store, other)
    owners.release(store, Owner())  # not the holder: no change
    assert not owners.usable_by(store, Owner())
    owners.release(store, other)
    assert owners.usable_by(store, Owner())


@pytest.mark.filterwarnings("ignore::ResourceWarning")
async def test_a_started_cache_dropped_unclosed_is_collected(tmp_path: Path) -> None:
    """Found by an adversarial round: the copy worker kept its last job (whose completion
    leads to the cache) alive while it waited for the next, and the thread held the engine,
    so a cache dropped unclosed after one insert was never collected and its claim never
    ended: every new cache on the backend was refused, and the pools and the thread leaked."""
    store = FileStorage(tmp_path / "s", capacity_bytes=None)
    before = set(threading.enumerate())
    first = akv.HiCache(cfg(store))
    await first.start()
    first.release(insert(first, [1, 2, 3, 4]))
    await first.flush()
    workers = {t for t in set(threading.enumerate()) - before if t.name == "aiocache-kv-copy"}
    assert workers, "no copy worker running"
    gone = weakref.ref(first)
    del first
    for _ in range(200):  # a worker may hold its last job for an instant after its hand-off
        gc.collect()
        if gone() is None:
            break
        await asyncio.sleep(0.01)
    assert gone() is None, "a started cache dropped unclosed stays alive"
    for t in workers:
        await asyncio.to_thread(t.join, 10)
        assert not t.is_alive(), "the collected cache's copy worker still runs"
    async with akv.HiCache(cfg(store)) as second:  # the claim ended with the cache
        res = await second.prefetch([1, 2, 3, 4], policy="wait_complete")
        assert res.hit_tokens == 4


@pytest.mark.mooncake
@pytest.mark.timeout(120)
async def test_embedding_cache_refused_a_store_a_hicache_uses(mooncake_master: MasterProc) -> None:
    store = loopback_client(mooncake_master, 64 << 20)
    async with akv.HiCache(cfg(store)) as kv:
        assert getattr(store, "defer_checksum", False)  # the KV cache's load-back verifies
        emb = EmbeddingCache(pool_bytes=1 << 20, store=store, namespace="owners-emb")
        with pytest.raises(ConfigError, match="already used by CacheCore"):
            await emb.start()
        await emb.aclose()  # must not close the KV cache's client
        kv.release(insert(kv, [5, 6, 7, 8]))
        await kv.flush()
        assert kv.statistics().backup_pages_failed == 0
        kv.evict(1 << 30)
        kv.evict(1 << 30, "host")
        res = await kv.prefetch([5, 6, 7, 8], policy="wait_complete")
        assert res.hit_tokens == 4


@pytest.mark.mooncake
@pytest.mark.timeout(120)
async def test_hicache_refused_a_store_an_embedding_cache_uses(
    mooncake_master: MasterProc,
) -> None:
    store = loopback_client(mooncake_master, 64 << 20)
    async with EmbeddingCache(pool_bytes=1 << 20, store=store, namespace="owners-emb2") as emb:
        kv = akv.HiCache(cfg(store))
        with pytest.raises(ConfigError, match="already used by EmbeddingCache"):
            await kv.start()
        await kv.aclose()
        assert not getattr(store, "defer_checksum", False)  # embedding reads verify in full
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
        h = bytes(range(32))
        await emb.insert_batch([h], [x])
        got = await emb.get_batch([h])
        assert got[0] is not None and torch.equal(got[0], x)


async def test_a_multi_user_backend_serves_several_caches() -> None:
    """``MemoryStorage`` stands for one store every node reaches: it is never claimed."""
    store = MemoryStorage(0)
    async with akv.HiCache(cfg(store)) as writer, akv.HiCache(cfg(store)) as reader:
        writer.release(insert(writer, [1, 2, 3, 4]))
        await writer.flush()
        res = await reader.prefetch([1, 2, 3, 4], policy="wait_complete")
        assert res.hit_tokens == 4


async def test_deferred_checksum_is_set_by_each_cache_that_opens_the_backend(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A backend reused after a close takes the new cache's verification mode: the flag a
    first cache set is not left on for a cache that verifies at read time (tensor
    parallelism, whose coordinator defers: the start reads only that)."""

    class Deferring(MemoryStorage):
        defer_checksum = False

    store = Deferring(0)
    async with akv.HiCache(cfg(store)):
        assert store.defer_checksum is True
    assert store.defer_checksum is True  # as the first cache left it
    cache = akv.HiCache(cfg(store))
    with monkeypatch.context() as patch:  # the start of a cache whose ranks must agree
        patch.setattr(LocalCoordinator, "deferred", True)
        await cache.start()
    try:
        assert store.defer_checksum is False
    finally:
        await cache.aclose()


async def test_a_new_cache_may_retry_a_start_that_gave_up(tmp_path: Path) -> None:
    """``async with`` never closes a cache whose start raised: a retry is a new cache on the
    same backend, and the first one's claim must not refuse it (it used to, until a cyclic
    garbage collection happened to run)."""
    store = FlakyFile(tmp_path / "s")
    gc.disable()  # the claim must end without the collector's help
    try:
        with pytest.raises(StorageUnavailableError):
            async with akv.HiCache(cfg(store)):
                pass
        async with akv.HiCache(cfg(store)) as cache:
            cache.release(insert(cache, [1, 2, 3, 4]))
            await cache.flush()
            assert cache.statistics().backup_pages_ok == 2
    finally:
        gc.enable()


@pytest.mark.mooncake
@pytest.mark.timeout(120)
async def test_an_embedding_cache_may_retry_a_start_that_gave_up(
    mooncake_master: MasterProc,
) -> None:
    """A start refused for its pool size ("lower pool_bytes") is retried by a new cache."""
    store = loopback_client(mooncake_master, 64 << 20)
    gc.disable()
    try:
        with pytest.raises(HostMemoryError):
            await EmbeddingCache(pool_bytes=1 << 60, store=store, namespace="owners-r").start()
        async with EmbeddingCache(pool_bytes=1 << 20, store=store, namespace="owners-r") as emb:
            x = torch.ones(2, 8)
            h = bytes(range(32))
            await emb.insert_batch([h], [x])
            got = await emb.get_batch([h])
            assert got[0] is not None and torch.equal(got[0], x)
    finally:
        gc.enable()


def test_a_claim_does_not_keep_the_backend_of_a_collected_owner(tmp_path: Path) -> None:
    store = FileStorage(tmp_path / "s", capacity_bytes=None)
    owner = Owner()
    owners.claim(store, owner)
    alive = weakref.ref(store)
    del owner, store  # the owner dropped without closing
    gc.collect()
    assert alive() is None, "the claim registry kept the backend alive"
