"""A prefetch that makes pages storage-resident announces them in STORAGE when the stream
does not claim them yet.

Before, a prefetch's commit published ``BlockStored`` for the host copy only: after a restart
over the same store, or after a backup whose failed page announced none of its node, the
cache claimed the fetched pages in STORAGE (``snapshot()``, ``snapshot_events()``) while the
stream had never announced them, and a later ``drop`` published ``BlockRemoved(STORAGE)`` for
pages the stream never stored.  Snapshot + stream from any point must equal a later snapshot.
"""

from __future__ import annotations

from collections.abc import Iterable

import aiocache_kv as akv
from aiocache_kv.storage.keys import parse_storage_key
from aiocache_kv.testing.memory_storage import MemoryStorage
from tests.conftest import small_config
from tests.test_split_ack import insert

MEDIA = ("GPU", "CPU", "STORAGE")
TOKENS = [10, 11, 12, 13, 14, 15]  # three pages of the small config


def cfg(store: MemoryStorage) -> akv.CacheConfig:
    return small_config(
        storage=store,
        storage_retry_seconds=0.0,
        prefetch_threshold_tokens=0,
        prefetch_policy="wait_complete",
    )


class Consumer:
    """An index built from events, as a KV-event subscriber keeps one; it records every
    removal of a block it was never told about."""

    def __init__(self) -> None:
        self.held: dict[str, set[bytes]] = {m: set() for m in MEDIA}
        self.unknown_removed: list[tuple[str, bytes]] = []

    def apply(self, events: Iterable[akv.KVCacheEvent]) -> Consumer:
        for e in events:
            if isinstance(e, akv.BlockStored):
                self.held[e.medium].update(e.block_hashes)
            elif isinstance(e, akv.BlockRemoved):
                gone = set(e.block_hashes)
                self.unknown_removed += [(e.medium, h) for h in gone - self.held[e.medium]]
                self.held[e.medium] -= gone
            elif isinstance(e, akv.AllBlocksCleared):
                self.held = {m: set() for m in MEDIA}
        return self


def assert_stream_matches(cache: akv.HiCache, stream: Consumer) -> None:
    later = Consumer().apply(cache.snapshot_events())
    assert stream.held == later.held
    assert not stream.unknown_removed
    assert len(stream.held["STORAGE"]) == sum("STORAGE" in b.tiers for b in cache.snapshot())


async def test_prefetch_after_restart_announces_its_storage_pages() -> None:
    store = MemoryStorage(0)
    async with akv.HiCache(cfg(store)) as first:
        first.release(insert(first, TOKENS))
        await first.flush()
    async with akv.HiCache(cfg(store)) as cache:  # a restart over the same store
        stream = Consumer().apply(cache.snapshot_events())
        stream.apply(cache.take_events())
        res = await cache.prefetch(TOKENS)
        assert res.hit_tokens == len(TOKENS)
        await cache.flush()
        stream.apply(cache.take_events())
        assert len(stream.held["STORAGE"]) == 3
        assert_stream_matches(cache, stream)
        await cache.drop(TOKENS[:2])  # retracts what the stream was told
        stream.apply(cache.take_events())
        assert_stream_matches(cache, stream)
        assert stream.held == {m: set() for m in MEDIA}


async def test_prefetch_of_pages_a_failed_backup_left_unannounced() -> None:
    store = MemoryStorage(0)
    async with akv.HiCache(cfg(store)) as cache:
        stream = Consumer()
        cache.release(insert(cache, TOKENS))
        await cache.flush()
        events = cache.take_events()
        stream.apply(events)
        keys = sorted(store.contents())
        assert len(stream.held["STORAGE"]) == 3
        (stored,) = [e for e in events if isinstance(e, akv.BlockStored) and e.medium == "STORAGE"]
        third = stored.block_hashes[-1]
        await cache.drop(TOKENS[:2], tiers=("storage",))  # the node is storage-absent now
        stream.apply(cache.take_events())
        # the next backup of the node fails on its last page: nothing of it is announced
        store.fail_put_keys |= {k for k in keys if parse_storage_key(k).page_hash == third}
        cache.release(cache.match_prefix(TOKENS))
        await cache.flush()
        stream.apply(cache.take_events())
        assert not stream.held["STORAGE"]
        cache.evict(100, "device")
        await cache.flush()
        cache.evict(100, "host")
        stream.apply(cache.take_events())
        res = await cache.prefetch(TOKENS)  # finds the two pages that did land
        assert res.hit_tokens == 4
        await cache.flush()
        stream.apply(cache.take_events())
        assert len(stream.held["STORAGE"]) == 2
        assert_stream_matches(cache, stream)
        cache.check_invariants()


async def test_prefetch_of_claimed_pages_announces_nothing_new_in_storage() -> None:
    store = MemoryStorage(0)
    async with akv.HiCache(cfg(store)) as cache:
        cache.release(insert(cache, TOKENS))
        await cache.flush()
        cache.evict(100, "device")
        await cache.flush()
        cache.evict(100, "host")  # the stream still claims the pages in STORAGE
        cache.take_events()
        await cache.prefetch(TOKENS)
        events = cache.take_events()
        assert not [e for e in events if isinstance(e, akv.BlockStored) and e.medium == "STORAGE"]
        assert [e for e in events if isinstance(e, akv.BlockStored) and e.medium == "CPU"]
