"""``insert_batch`` reads the caller's tensors only before its first suspension.

A serving loop reuses its embedding buffers: once ``insert_batch`` is suspended (on the
implicit ``start()`` of a first call, or behind another call's fetch or push of an entry of the
batch), the caller may write the next item's embedding into the same tensor, or resize it.
What is cached (and pushed to the global store) under a hash is what the tensor held at the
call, never what it holds later; a copy that raises leaves no extent, pin or entry behind.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from aiocache_kv.embedding import EmbeddingCache
from aiocache_kv.embedding.pool import EntryPool

from .fakes import FakeClient, FakeMooncakeStorage

DIM = 8
IMG_A = torch.full((4, DIM), 1.0)
IMG_B = torch.full((4, DIM), 2.0)


async def _entered(client: FakeClient, name: str) -> None:
    assert await asyncio.to_thread(client.entered[name].wait, 5), f"no worker entered {name}"
    client.entered[name].clear()


async def _push_held(emb: EmbeddingCache, client: FakeClient) -> asyncio.Task[object]:
    """A push of ``X`` held in the store; returns its task."""
    client.gates["batch_put_from"].clear()
    t0 = asyncio.create_task(emb.insert_batch(["X"], [torch.zeros(4, DIM)]))
    await _entered(client, "batch_put_from")
    return t0


async def test_buffer_reused_while_waiting_for_a_push(ns: str) -> None:
    client = FakeClient()
    async with EmbeddingCache(
        pool_bytes=1 << 16, store=FakeMooncakeStorage(client), namespace=ns
    ) as emb:
        t0 = await _push_held(emb, client)
        buf = IMG_A.clone()
        t1 = asyncio.create_task(emb.insert_batch(["X", "A"], [torch.zeros(4, DIM), buf]))
        await asyncio.sleep(0.05)
        assert not t1.done(), "the second call must wait behind X's push"
        buf.copy_(IMG_B)  # the caller reuses its buffer for the next image
        client.gates["batch_put_from"].set()
        await t0
        await t1
        (got,) = await emb.get_batch(["A"])
        assert got is not None and torch.equal(got, IMG_A), got
        emb.check_invariants()
    # another node reads A from the global store: the bytes pushed are A's too
    async with EmbeddingCache(
        pool_bytes=1 << 16, store=FakeMooncakeStorage(client), namespace=ns
    ) as other:
        (remote,) = await other.get_batch(["A"])
        assert remote is not None and torch.equal(remote, IMG_A), remote


@pytest.mark.parametrize("change", ["reuse", "empty"])
async def test_buffer_changed_during_the_implicit_start(ns: str, change: str) -> None:
    """Bytes and shape are the call's: a buffer reused, or emptied (not tabled as 0 tokens)."""
    emb = EmbeddingCache(pool_bytes=1 << 16, store=None, namespace=ns)
    buf = IMG_A.clone()
    t = asyncio.create_task(emb.insert_batch(["A"], [buf]))
    await asyncio.sleep(0)  # suspended in the implicit start()
    assert not t.done()
    if change == "reuse":
        buf.copy_(IMG_B)
    else:
        buf.resize_(0, DIM)
    await t
    (got,) = await emb.get_batch(["A"])
    assert got is not None and torch.equal(got, IMG_A), got
    emb.check_invariants()
    await emb.aclose()


async def test_buffer_shrunk_while_waiting_for_a_push(ns: str) -> None:
    client = FakeClient()
    async with EmbeddingCache(
        pool_bytes=1 << 16, store=FakeMooncakeStorage(client), namespace=ns
    ) as emb:
        t0 = await _push_held(emb, client)
        a, b = IMG_A.clone(), IMG_B.clone()
        t1 = asyncio.create_task(emb.insert_batch(["X", "A", "B"], [torch.zeros(4, DIM), a, b]))
        await asyncio.sleep(0.05)
        b.resize_(2, DIM)
        client.gates["batch_put_from"].set()
        await t0
        stats = await t1
        assert (stats.new, stats.local_hit, stats.push_failed) == (2, 1, 0), stats
        got = await emb.get_batch(["A", "B"])
        assert got[0] is not None and torch.equal(got[0], IMG_A), got
        assert got[1] is not None and torch.equal(got[1], IMG_B), got
        emb.check_invariants()
        assert emb.statistics().pinned == 0


async def test_a_copy_that_raises_leaves_nothing_behind(
    ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with EmbeddingCache(pool_bytes=1 << 16, store=None, namespace=ns) as emb:
        await emb.insert_batch(["W"], [IMG_A.clone()])
        before = emb.statistics()
        real = EntryPool.add_ready
        calls = 0

        def failing(self: EntryPool, *args: object) -> object:
            nonlocal calls
            calls += 1
            if calls == 2:  # the batch's second new entry: its copy fails
                args = (*args[:3], torch.zeros(3))  # a source that cannot be copied
            return real(self, *args)  # type: ignore[arg-type]

        monkeypatch.setattr(EntryPool, "add_ready", failing)
        with pytest.raises(RuntimeError):
            await emb.insert_batch(["W", "A", "B"], [IMG_A.clone(), IMG_A.clone(), IMG_B.clone()])
        monkeypatch.setattr(EntryPool, "add_ready", real)
        emb.check_invariants()
        after = emb.statistics()
        assert after.pinned == 0, after
        assert after.entries == before.entries + 1, (before, after)  # A was copied whole
        (b,) = await emb.get_batch(["B"])
        assert b is None
        # the pool is whole: everything unpinned can be evicted
        assert emb.evict() == after.used_bytes
        emb.check_invariants()
