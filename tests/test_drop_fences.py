"""A drop's storage fences stand exactly as long as the drop and the removals it started.

A drop fences what it removes: backups of the namespace are not sent and prefetches of those
pages commit nothing meanwhile.  Two ways that went wrong (found by adversarial trials):

* a storage-only drop cancelled while it waited for backups in flight left its fence for
  good: every later backup of the namespace was skipped and every prefetch committed nothing;
* a drop that stopped waiting (cancelled, or its own deadline) lifted its fence while its
  removal still ran in a worker: the same pages computed again were backed up and claimed
  (``BlockStored`` STORAGE), then the late removal deleted them under the claim.

Interleavings are held with the gates of ``MemoryStorage``.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

import aiocache_kv as akv
from aiocache_kv.errors import DropIncompleteError
from aiocache_kv.storage.fences import FenceHold
from aiocache_kv.testing import MemoryStorage
from aiocache_kv.tree.node import RESIDENT
from tests.conftest import small_config
from tests.test_split_ack import insert

A = list(range(10, 26))  # 8 pages of 2
B = list(range(500, 516))


async def entered(gate: threading.Event) -> None:
    assert await asyncio.to_thread(gate.wait, 5), "no worker reached the gate"
    gate.clear()


def claims_backed(cache: akv.HiCache, store: MemoryStorage) -> None:
    """Every page the tree claims in storage is in the store."""
    l3 = cache._l3
    assert l3 is not None
    held = store.contents()
    for node in cache._tree.walk():
        if node.parent is not None and node.storage is RESIDENT:
            missing = [k for k in l3.node_keys(node) if k not in held]
            assert not missing, f"{node!r} claims {len(missing)} keys the store lacks"


async def stored_now(cache: akv.HiCache, tokens: list[int], seed: int) -> None:
    r = insert(cache, tokens, seed=seed)
    await r.write_through
    cache.release(r)
    await cache.flush()


def config(store: MemoryStorage, **kw: object) -> akv.CacheConfig:
    return small_config(storage=store, prefetch_threshold_tokens=0, **kw)


@pytest.mark.parametrize("how", ["cancel", "timeout"])
async def test_storage_only_drop_that_stops_waiting_lifts_its_fence(how: str) -> None:
    store = MemoryStorage()
    async with akv.HiCache(config(store, storage_timeout=2.0)) as cache:
        store.gates["put"].clear()  # A's backup is held in the store
        r = insert(cache, A, seed=1)
        await r.write_through
        cache.release(r)
        await entered(store.entered["put"])
        t = asyncio.create_task(cache.drop(A, tiers=("storage",), timeout=0.2))
        await asyncio.sleep(0.05)  # waiting for A's backup to land
        assert not t.done()
        if how == "cancel":
            t.cancel()
            with pytest.raises(asyncio.CancelledError):
                await t
        else:
            await t  # its own deadline: nothing of A was stored, nothing to remove
        store.gates["put"].set()
        await cache.flush()
        skipped = cache.statistics().backup_skipped_pages
        await stored_now(cache, B, seed=2)  # the namespace backs up again
        assert cache.statistics().backup_skipped_pages == skipped
        cache.evict(1000)
        cache.evict(1000, tier="host")
        res = await cache.prefetch(B, policy="wait_complete")
        assert res.hit_tokens == len(B), res
        claims_backed(cache, store)
        cache.check_invariants()


@pytest.mark.parametrize("how", ["cancel", "timeout"])
async def test_fence_stands_until_the_removal_worker_returns(how: str) -> None:
    store = MemoryStorage()
    async with akv.HiCache(config(store, storage_timeout=2.0)) as cache:
        await stored_now(cache, A, seed=1)
        assert len(store.contents()) == 8
        store.gates["remove"].clear()
        t = asyncio.create_task(cache.drop(A, timeout=0.2))
        await entered(store.entered["remove"])  # the removal runs in its worker
        if how == "cancel":
            t.cancel()
            with pytest.raises(asyncio.CancelledError):
                await t
        else:
            with pytest.raises(DropIncompleteError):
                await t
        # the same prompt computed again while the removal still runs: not claimed
        skipped = cache.statistics().backup_skipped_pages
        await stored_now(cache, A, seed=1)
        assert cache.statistics().backup_skipped_pages > skipped
        claims_backed(cache, store)
        store.gates["remove"].set()  # the late removal deletes the old keys now
        for _ in range(200):
            if store.calls["remove"]:
                break
            await asyncio.sleep(0.01)
        await cache.flush()
        claims_backed(cache, store)
        # the fence went with the worker: the namespace backs up again
        skipped = cache.statistics().backup_skipped_pages
        await stored_now(cache, B, seed=2)
        assert cache.statistics().backup_skipped_pages == skipped
        claims_backed(cache, store)
        cache.check_invariants()


def test_fence_hold_lifts_once_when_the_drop_and_every_worker_are_done() -> None:
    lifted: list[int] = []
    hold = FenceHold(lambda: lifted.append(1))
    w1, w2 = hold.worker(), hold.worker()
    hold.done()
    hold.done()  # the owner's share goes once
    w1()
    w1()  # so does each worker's
    assert not lifted and not hold.lifted
    w2()
    assert lifted == [1] and hold.lifted
    with pytest.raises(AssertionError):
        hold.worker()


def test_fence_hold_without_workers_lifts_when_the_drop_is_done() -> None:
    lifted: list[int] = []
    hold = FenceHold(lambda: lifted.append(1))
    assert not hold.lifted
    hold.done()
    assert lifted == [1]
