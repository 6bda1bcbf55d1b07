"""``HiCache.aclose`` and ``start`` when the caller goes away, or the store is stuck.

Found by adversarial trials, each now a test:

* an ``aclose`` cancelled while the copy engine drained marked the cache CLOSED and skipped
  closing the storage tier: its workers and backend stayed open for good, and a second
  ``aclose`` returned at once (so did one called while the first still ran);
* a ``start`` cancelled, or failing, after the storage tier opened left it open, and a retry
  built a second tier beside it;
* after ``drop(zeroize=True)`` of pages a stuck put still read, ``flush`` and ``aclose`` waited
  for the store with no bound;
* a foreground prefetch whose read landed after ``aclose`` committed pages into the closed
  cache's tree and published ``BlockStored`` after the close's removals.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import torch

import aiocache_kv as akv
from aiocache_kv.errors import InvalidTypeError, StorageUnavailableError
from aiocache_kv.lifecycle import Lifecycle
from aiocache_kv.testing import MemoryStorage, RandomDelayEngine
from tests.conftest import small_config
from tests.flaky_stores import FlakyMemory
from tests.test_split_ack import insert

A = list(range(10, 42))


async def stored(cache: akv.HiCache, tokens: list[int]) -> None:
    r = insert(cache, tokens)
    assert r.write_through is not None
    await r.write_through
    cache.release(r)
    await cache.flush()
    assert cache.statistics().backup_pages_ok >= len(tokens) // cache.config.page_size


def storage_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if "storage" in t.name and t.is_alive())


async def threads_gone(before: list[str]) -> list[str]:
    for _ in range(200):
        left = [t for t in storage_threads() if t not in before]
        if not left:
            return []
        await asyncio.sleep(0.01)
    return left


class SlowOpen(MemoryStorage):
    """Its ``open`` waits for ``release`` (and then fails, with ``fail``)."""

    def __init__(self, *, fail: bool = False) -> None:
        super().__init__()
        self.release = threading.Event()
        self.fail = fail
        self.opens = self.closes = 0

    def open(self) -> None:
        self.opens += 1
        self.release.wait(5)
        if self.fail:
            raise StorageUnavailableError("store down")
        super().open()

    def close(self) -> None:
        self.closes += 1
        super().close()


async def busy_cache(store: MemoryStorage) -> akv.HiCache:
    cache = akv.HiCache(
        small_config(storage=store, storage_timeout=2.0),
        copy_engine=RandomDelayEngine(seed=1, max_delay=0.3),
    )
    await cache.start()
    for i in range(4):
        cache.release(insert(cache, [100 * i + j for j in range(6)], seed=i))
    return cache


async def test_a_cancelled_aclose_still_closes_the_storage_tier() -> None:
    before = storage_threads()
    store = MemoryStorage()
    cache = await busy_cache(store)
    t = asyncio.create_task(cache.aclose())
    await asyncio.sleep(0.05)  # waiting for the copy engine to drain
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t
    await cache.aclose()  # waits for the close that goes on
    assert cache._state is Lifecycle.CLOSED
    assert store._closed, "the backend was never closed"
    assert await threads_gone(before) == []


async def test_a_second_aclose_waits_for_the_first() -> None:
    store = MemoryStorage()
    cache = await busy_cache(store)
    first = asyncio.create_task(cache.aclose())
    await asyncio.sleep(0.01)
    await cache.aclose()
    assert cache._state is Lifecycle.CLOSED
    assert store._closed
    await first


@pytest.mark.parametrize("how", ["cancel", "fail"])
async def test_start_that_does_not_finish_closes_the_storage_tier(how: str) -> None:
    before = storage_threads()
    store = SlowOpen(fail=how == "fail")
    cache = akv.HiCache(small_config(storage=store, storage_open_timeout=10))
    t = asyncio.create_task(cache.start())
    await asyncio.sleep(0.2)  # the open is held in its worker
    if how == "cancel":
        t.cancel()
        store.release.set()
        with pytest.raises(asyncio.CancelledError):
            await t
    else:
        store.release.set()
        with pytest.raises(StorageUnavailableError):
            await t
    assert cache._state is Lifecycle.NEW
    assert cache._l3 is None
    if how == "cancel":
        await cache.start()  # a retry builds one tier, and closes it
    await cache.aclose()  # waits for the tier the start gave up on too
    assert store.closes == 1 and store._closed, (store.opens, store.closes)
    assert await threads_gone(before) == []


async def test_zeroing_behind_a_stuck_put_does_not_hold_flush_or_aclose() -> None:
    store = MemoryStorage(gate_timeout=20.0)
    st = 0.3
    cache = akv.HiCache(small_config(storage=store, storage_timeout=st))
    await cache.start()
    store.gates["put"].clear()
    r = insert(cache, A[:16])
    assert r.write_through is not None
    await r.write_through
    cache.release(r)
    await asyncio.to_thread(store.entered["put"].wait, 5)
    await cache.drop(A[:16], tiers=("device", "host"), zeroize=True)
    await asyncio.sleep(st + 0.1)  # the backup's deadline failed it; the node is reaped
    t0 = time.monotonic()
    await asyncio.wait_for(cache.flush(), 4 * st)
    t1 = time.monotonic()
    await asyncio.wait_for(cache.aclose(), 6 * st)
    t2 = time.monotonic()
    assert t1 - t0 < 4 * st and t2 - t1 < 6 * st
    assert cache.statistics().host.quarantined_pages > 0, "pages a worker reads were freed"
    store.gates["put"].set()  # the worker returns: the pages are zeroed then
    await asyncio.sleep(0.2)


async def test_a_read_landing_after_aclose_commits_nothing() -> None:
    store = MemoryStorage(gate_timeout=20.0)
    async with akv.HiCache(small_config(storage=store)) as first:
        r = insert(first, A)
        assert r.write_through is not None
        await r.write_through
        first.release(r)
        await first.flush()
    cache = akv.HiCache(
        small_config(
            storage=store,
            storage_timeout=0.3,
            prefetch_threshold_tokens=0,
            prefetch_policy="wait_complete",
        )
    )
    await cache.start()
    cache.take_events()
    store.gates["get_into"].clear()
    p = asyncio.create_task(cache.prefetch(A))
    await asyncio.to_thread(store.entered["get_into"].wait, 5)
    await cache.aclose()
    closing = cache.take_events()
    store.gates["get_into"].set()
    res = await p
    assert res.hit_tokens == 0, res
    assert [n for n in cache._tree.walk() if n.parent is not None] == []
    assert cache.take_events() == [], "events after the close's removals"
    assert all(not isinstance(e, akv.BlockStored) for e in closing)


@pytest.mark.parametrize("engine", [5, "cpu", object()])
def test_a_copy_engine_of_the_wrong_type_is_refused_at_construction(engine: object) -> None:
    with pytest.raises(InvalidTypeError, match="copy_engine"):
        akv.HiCache(small_config(), copy_engine=engine)  # type: ignore[arg-type]


async def test_invariants_hold_after_closing_with_live_handles() -> None:
    cache = akv.HiCache(small_config())
    await cache.start()
    r = insert(cache, A[:8])
    m = cache.match_prefix(A[:8])
    assert m.device_len == 8
    await cache.aclose()
    cache.check_invariants()  # the close took the live handles' pins with it
    with pytest.raises(akv.CacheClosedError):
        cache.release(m)
    del r


async def test_a_retried_start_has_one_storage_tier_hooked() -> None:
    """The tier a failed start built is unhooked: a split of a node whose backup is in flight
    retargets that backup once (twice, its put landed on duplicated heads and the ack tripped
    an assertion, then ``flush`` hung)."""
    store = FlakyMemory()
    cache = akv.HiCache(small_config(storage=store, device_pages=32, host_pages=64))
    with pytest.raises(StorageUnavailableError):
        await cache.start()
    await cache.start()
    try:
        store.gates["put"].clear()  # hold the backup's put
        prompt = list(range(100, 124))
        r = insert(cache, prompt, seed=1)
        assert r.write_through is not None
        await r.write_through  # the host copy landed: the backup started (held)
        other = prompt[:16] + [99] * 8  # shares 8 pages: splits the node under backup
        own = cache.alloc(8)
        r2 = cache.insert(other, torch.cat([r.device_indices[:16], own]))
        store.gates["put"].set()
        await asyncio.wait_for(cache.flush(), 10)
        cache.release(r)
        cache.release(r2)
        cache.check_invariants()
        st = cache.statistics()
        assert st.backup_pages_failed == 0 and st.backup_pages_ok >= 12, st
    finally:
        await asyncio.wait_for(cache.aclose(), 10)
    assert store._closed


async def test_a_file_storage_start_cancelled_then_retried(tmp_path: Path) -> None:
    class SlowFirstOpen(akv.FileStorage):
        first = True

        def open(self) -> None:
            if self.first:
                self.first = False
                time.sleep(0.4)
            super().open()

    cache = akv.HiCache(small_config(storage=SlowFirstOpen(tmp_path / "s")))
    t = asyncio.create_task(cache.start())
    await asyncio.sleep(0.1)
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t
    await asyncio.sleep(0.6)  # the abandoned tier's workers stop; its backend stays open
    await cache.start()  # the retry opens the same backend again
    await stored(cache, A[:16])
    await cache.aclose()


@pytest.mark.parametrize("started", ["never", "failed"])
async def test_aclose_twice_on_a_cache_that_never_ran(started: str) -> None:
    """A second ``aclose`` of a cache closed before it ran returns at once (it started the
    close sequence of a cache with no pools)."""
    store = FlakyMemory()
    cache = akv.HiCache(small_config(storage=store))
    if started == "failed":
        with pytest.raises(StorageUnavailableError):
            await cache.start()
    await cache.aclose()
    await asyncio.wait_for(cache.aclose(), 5)
    assert cache._state is Lifecycle.CLOSED
    with pytest.raises(akv.CacheClosedError):
        await cache.start()
