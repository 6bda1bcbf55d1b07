"""``EmbeddingCache.aclose()``: one close, run to the end whoever stops waiting for it.

The close waits for the workers that still hold pool slots (a cancelled push's cleanup), then
closes the store client and its worker threads.  A cancelled ``aclose()`` only stops its
caller's wait; a second ``aclose()`` waits for the same close.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from aiocache_kv.embedding import EmbeddingCache
from aiocache_kv.errors import CacheClosedError

from .fakes import FakeClient, FakeMooncakeStorage

DIM = 16


def emb(seed: int) -> torch.Tensor:
    return torch.randn(4, DIM, generator=torch.Generator().manual_seed(seed))


def io_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("aiocache-kv-emb")]


async def node_with_a_held_slot(ns: str, timeout: float = 5.0) -> tuple[EmbeddingCache, FakeClient]:
    """A started cache whose cancelled insert left a worker parked in ``batch_put_from``
    (gate closed), so its close has a cleanup to wait for."""
    client = FakeClient()
    store = FakeMooncakeStorage(client)
    cache = EmbeddingCache(pool_bytes=1 << 16, store=store, namespace=ns, timeout=timeout)
    await cache.start()
    client.gates["batch_put_from"].clear()
    t = asyncio.create_task(cache.insert_batch(["a"], [emb(1)]))
    assert await asyncio.to_thread(client.entered["batch_put_from"].wait, 5)
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t
    assert cache.statistics().cleanups_pending == 1
    return cache, client


async def wait_for_no_io_threads(before: set[str]) -> list[str]:
    for _ in range(200):
        left = [n for n in io_threads() if n not in before]
        if not left:
            return []
        await asyncio.sleep(0.01)
    return left


async def test_a_cancelled_aclose_still_closes_the_store_and_its_threads(ns: str) -> None:
    before = set(io_threads())
    cache, client = await node_with_a_held_slot(ns)
    try:
        closer = asyncio.create_task(cache.aclose())
        await asyncio.sleep(0.05)  # it waits for the worker that holds the slot
        assert not closer.done() and cache.statistics().state == "closing"
        closer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closer
        with pytest.raises(CacheClosedError):
            await cache.get_batch(["a"])
        client.gates["batch_put_from"].set()  # the worker lets go of the slot
        await asyncio.wait_for(cache.aclose(), 5)  # waits for the close still under way
        assert cache.statistics().state == "closed"
        assert client.closed, "the store client was never closed"
        assert cache._io is not None and cache._io._closed
        assert await wait_for_no_io_threads(before) == []
    finally:
        client.gates["batch_put_from"].set()


async def test_the_close_completes_when_every_caller_stopped_waiting(ns: str) -> None:
    cache, client = await node_with_a_held_slot(ns)
    try:
        closer = asyncio.create_task(cache.aclose())
        await asyncio.sleep(0.05)
        closer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closer
        client.gates["batch_put_from"].set()
        for _ in range(300):  # nobody awaits aclose() any more: the close goes on by itself
            if client.closed:
                break
            await asyncio.sleep(0.01)
        assert client.closed and cache.statistics().state == "closed"
    finally:
        client.gates["batch_put_from"].set()


async def test_a_second_aclose_waits_for_the_first_to_finish(ns: str) -> None:
    cache, client = await node_with_a_held_slot(ns)
    try:
        first = asyncio.create_task(cache.aclose())
        await asyncio.sleep(0.05)
        second = asyncio.create_task(cache.aclose())
        await asyncio.sleep(0.05)
        assert not second.done(), "a second aclose() returned before the close was done"
        assert not client.closed
        client.gates["batch_put_from"].set()
        await asyncio.wait_for(second, 5)
        assert client.closed and cache.statistics().state == "closed"
        await asyncio.wait_for(first, 5)
        await cache.aclose()  # idempotent once closed
    finally:
        client.gates["batch_put_from"].set()


async def test_aclose_before_start_and_twice_is_fine(ns: str) -> None:
    client = FakeClient()
    cache = EmbeddingCache(pool_bytes=1 << 16, store=FakeMooncakeStorage(client), namespace=ns)
    await asyncio.gather(cache.aclose(), cache.aclose())
    assert cache.statistics().state == "closed"
    with pytest.raises(CacheClosedError):
        await cache.start()
