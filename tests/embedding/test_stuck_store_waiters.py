"""Calls waiting on an entry a stuck store call holds end within ``timeout`` (found by an
adversarial round).

A get or push that times out leaves its entry to the worker still in the store call: FILLING
(a get) or pinned (a push) until the worker returns, which a stuck client may never do. A
second call for the same hash waited on that entry without a bound (an insert of a batch that
merely contained the hash too, so the batch's other entries were never cached), and
``aclose()`` stranded such waiters for good. Cancelling the call that ran the implicit start
also cancelled every call waiting on that start.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from aiocache_kv.embedding import EmbeddingCache
from aiocache_kv.errors import CacheClosedError

from .fakes import FakeClient, FakeMooncakeStorage

T = 0.2  # the caches' store timeout


def node(client: FakeClient, timeout: float = T) -> EmbeddingCache:
    store = FakeMooncakeStorage(client)
    return EmbeddingCache(
        pool_bytes=1 << 16, store=store, namespace="ns", pin_memory=False, timeout=timeout
    )


async def stored(client: FakeClient, h: bytes) -> None:
    async with node(client, timeout=5.0) as writer:
        await writer.insert_batch([h], [torch.ones(2, 4)])


async def test_a_get_behind_a_stuck_get_is_a_miss_within_the_timeout() -> None:
    client = FakeClient()
    await stored(client, b"a")
    async with node(client) as cache:
        client.gates["batch_get_into"].clear()  # the store stalls
        try:
            assert await cache.get_batch([b"a"]) == [None]  # timed out: a miss
            t0 = time.monotonic()
            assert await asyncio.wait_for(cache.get_batch([b"a"]), 10 * T) == [None]
            assert time.monotonic() - t0 < 3 * T
            stats = await asyncio.wait_for(
                cache.insert_batch([b"a", b"b"], [torch.ones(2, 4), torch.zeros(2, 4)]), 10 * T
            )
            assert (stats.new, stats.skipped) == (1, 1), stats  # "a" held, "b" cached
        finally:
            client.gates["batch_get_into"].set()


async def test_an_insert_behind_a_stuck_push_skips_the_held_entry() -> None:
    client = FakeClient()
    async with node(client) as cache:
        client.gates["batch_put_from"].clear()
        try:
            first = await cache.insert_batch([b"a"], [torch.ones(2, 4)])
            assert (first.new, first.push_failed) == (1, 1)
            t0 = time.monotonic()
            second = await asyncio.wait_for(
                cache.insert_batch([b"a", b"b"], [torch.ones(2, 4), torch.zeros(2, 4)]), 10 * T
            )
            assert time.monotonic() - t0 < 4 * T  # the wait, then b's own push timing out
            assert (second.new, second.skipped) == (1, 1), second
            assert await cache.get_batch([b"b"]) != [None]
        finally:
            client.gates["batch_put_from"].set()


@pytest.mark.parametrize("kind", ["insert", "get"])
async def test_close_ends_the_calls_waiting_behind_a_stuck_store_call(kind: str) -> None:
    client = FakeClient()
    if kind == "get":
        await stored(client, b"a")
    cache = node(client, timeout=2 * T)
    await cache.start()
    gate = client.gates["batch_put_from" if kind == "insert" else "batch_get_into"]
    gate.clear()
    try:
        if kind == "insert":
            await cache.insert_batch([b"a"], [torch.ones(2, 4)])
            waiter = asyncio.ensure_future(cache.insert_batch([b"a"], [torch.ones(2, 4)]))
        else:
            await cache.get_batch([b"a"])
            waiter = asyncio.ensure_future(cache.get_batch([b"a"]))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        closing = asyncio.ensure_future(cache.aclose())  # bounded by about 3 x its timeout
        with pytest.raises(CacheClosedError):
            await asyncio.wait_for(waiter, 2 * T)  # woken as the close starts
        await closing
    finally:
        gate.set()


async def test_cancelling_the_call_that_starts_the_cache_spares_its_waiters() -> None:
    cache = EmbeddingCache(pool_bytes=1 << 16, store=None, pin_memory=False)
    first = asyncio.ensure_future(cache.insert_batch([b"a"], [torch.ones(2, 4)]))
    await asyncio.sleep(0)  # inside the implicit start
    second = asyncio.ensure_future(cache.get_batch([b"a"]))
    await asyncio.sleep(0)  # waiting on that start
    first.cancel()
    results = await asyncio.gather(first, second, return_exceptions=True)
    assert isinstance(results[0], asyncio.CancelledError)
    assert results[1] == [None]  # it started the cache itself
    assert cache.statistics().state == "running"
    await cache.aclose()
