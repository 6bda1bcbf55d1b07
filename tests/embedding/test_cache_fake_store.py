"""EmbeddingCache over the real ``MooncakeStorage`` logic with an in-memory, gated client.

Deterministic interleavings: a closed gate parks the worker inside a store call, so tests can
look at entry states while I/O is in flight, cancel callers, and release the worker later.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from aiocache_kv.embedding import EmbeddingCache, InsertBatchStats, embedding_key
from aiocache_kv.embedding.keys import canonical_hashes

from .fakes import FakeClient, FakeMooncakeStorage

DIM = 16


def emb(seed: int, tokens: int = 4) -> torch.Tensor:
    return torch.randn(tokens, DIM, generator=torch.Generator().manual_seed(seed))


def node(client: FakeClient, ns: str, pool: int = 1 << 16, **kw: object) -> EmbeddingCache:
    store = FakeMooncakeStorage()
    store.client = client
    return EmbeddingCache(pool_bytes=pool, store=store, namespace=ns, **kw)  # type: ignore[arg-type]


async def entered(client: FakeClient, name: str) -> None:
    assert await asyncio.to_thread(client.entered[name].wait, 5), f"no worker entered {name}"
    client.entered[name].clear()


async def settle(cache: EmbeddingCache) -> None:
    while cache._cleanups:
        await asyncio.wait(list(cache._cleanups))


async def test_local_hit_is_pushed_again_but_bytes_only_sent_when_the_store_lost_them(
    fake_store: FakeMooncakeStorage, ns: str
) -> None:
    client = fake_store.client
    async with EmbeddingCache(pool_bytes=1 << 16, store=fake_store, namespace=ns) as a:
        x = emb(1)
        key = embedding_key(ns, b"h", torch.float32)
        assert await a.insert_batch(["h"], [x]) == InsertBatchStats(1, 0, 0)
        sent = fake_store.statistics().bytes_written
        assert client.puts_per_key[key] == 1 and sent > 0
        puts = client.calls["batch_is_exist"]
        assert await a.insert_batch(["h"], [x]) == InsertBatchStats(0, 1, 0)
        assert client.calls["batch_is_exist"] == puts + 1  # pushed again (one put call) ...
        assert fake_store.statistics().bytes_written == sent  # ... without re-sending bytes
        assert fake_store.statistics().put_skipped == 1
        client.batch_remove([key])  # the global copy is lost (eviction, master restart)
        assert await a.insert_batch(["h"], [x]) == InsertBatchStats(0, 1, 0)
        assert client.puts_per_key[key] == 2  # re-sent from the local pool
        assert fake_store.statistics().bytes_written == 2 * sent
        async with node(client, ns) as b:
            (y,) = await b.get_batch(["h"])
            assert y is not None and torch.equal(x, y)
            s = b.statistics()
            assert (s.get_store_hits, s.ready) == (1, 1)
            await b.get_batch(["h"])
            assert b.statistics().get_local_hits == 1  # the fetch filled b's pool
            b.check_invariants()


async def test_a_reader_waits_for_a_filling_entry_and_it_is_fetched_once(ns: str) -> None:
    client = FakeClient()
    x = emb(2)
    async with node(client, ns) as a:
        await a.insert_batch(["h"], [x])
    async with node(client, ns) as b:
        client.gates["batch_get_into"].clear()
        t1 = asyncio.create_task(b.get_batch(["h"]))
        await entered(client, "batch_get_into")
        assert b.statistics().filling == 1
        t2 = asyncio.create_task(b.get_batch(["h"]))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not t2.done()  # it waits: the slot is half-written
        client.gates["batch_get_into"].set()
        (r1,), (r2,) = await t1, await t2
        assert r1 is not None and r2 is not None and torch.equal(r1, x) and torch.equal(r2, x)
        assert client.calls["batch_get_into"] == 1
        b.check_invariants()


async def test_cancelled_get_frees_its_slots_only_after_the_worker_released_them(ns: str) -> None:
    client = FakeClient()
    async with node(client, ns) as a:
        await a.insert_batch(["h1", "h2"], [emb(1), emb(2)])
    async with node(client, ns) as b:
        client.gates["batch_get_into"].clear()
        t = asyncio.create_task(b.get_batch(["h1", "h2", "absent"]))
        await entered(client, "batch_get_into")
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        s = b.statistics()
        assert (s.filling, s.cleanups_pending) == (2, 1) and s.used_bytes > 0
        b.check_invariants()
        client.gates["batch_get_into"].set()
        await settle(b)
        s = b.statistics()
        assert (s.entries, s.used_bytes, s.cleanups_pending) == (0, 0, 0)
        b.check_invariants()
        got = await b.get_batch(["h1", "h2"])
        assert all(g is not None for g in got)


async def test_cancel_during_size_lookup_drops_the_entries_at_once(ns: str) -> None:
    client = FakeClient()
    async with node(client, ns) as a:
        await a.insert_batch(["h"], [emb(1)])
    async with node(client, ns) as b:
        client.gates["batch_get_replica_desc"].clear()
        t = asyncio.create_task(b.get_batch(["h"]))
        await entered(client, "batch_get_replica_desc")
        assert b.statistics().lookup == 1
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert b.statistics().entries == 0  # no slot was reserved yet
        b.check_invariants()
        client.gates["batch_get_replica_desc"].set()


async def test_cancelled_insert_keeps_its_entries_pinned_until_the_worker_is_done(
    ns: str,
) -> None:
    client = FakeClient()
    per = 512  # one 4x16 float32 entry: 64 + 256 + 72 -> 448 (64-aligned), two fit in 1024
    async with node(client, ns, pool=2 * per) as a:
        client.gates["batch_put_from"].clear()
        t = asyncio.create_task(a.insert_batch(["a", "b"], [emb(1), emb(2)]))
        await entered(client, "batch_put_from")
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        s = a.statistics()
        assert (s.ready, s.pinned, s.evictable, s.cleanups_pending) == (2, 2, 0, 1)
        # pinned slots are never evicted, even for a newcomer that needs the room
        assert await a.insert_batch(["c"], [emb(3)]) == InsertBatchStats(0, 0, 1)
        client.gates["batch_put_from"].set()
        await settle(a)
        s = a.statistics()
        assert (s.pinned, s.evictable, s.cleanups_pending) == (0, 2, 0)
        a.check_invariants()
        assert (await a.insert_batch(["c"], [emb(3)])).new == 1  # now a is evicted
        assert a.lru_order() == [b"b", b"c"]


async def test_a_pinned_entry_is_not_evicted_for_a_newcomer(ns: str) -> None:
    client = FakeClient()
    # one 4x16 float32 entry: header 64 + data 256 + trailer 72 -> 448 bytes, 64-aligned
    async with node(client, ns, pool=2 * 448) as a:
        await a.insert_batch(["old"], [emb(0)])
        client.gates["batch_put_from"].clear()
        t1 = asyncio.create_task(a.insert_batch(["p"], [emb(1)]))
        await entered(client, "batch_put_from")
        assert a.lru_order() == [b"old"]  # p is pinned by its push
        t2 = asyncio.create_task(a.insert_batch(["q"], [emb(2)]))
        await entered(client, "batch_put_from")
        assert set(a._entries) == {b"p", b"q"}  # old was the only possible victim
        client.gates["batch_put_from"].set()
        assert (await t1).new == 1 and (await t2).new == 1
        # both pushes ran on the two workers at once: they unpin in whichever order they end
        assert sorted(a.lru_order()) == [b"p", b"q"]
        a.check_invariants()


async def test_two_inserts_of_one_hash_send_its_bytes_once(ns: str) -> None:
    client = FakeClient()
    async with node(client, ns) as a:
        client.gates["batch_put_from"].clear()
        t1 = asyncio.create_task(a.insert_batch(["h"], [emb(1)]))
        await entered(client, "batch_put_from")
        t2 = asyncio.create_task(a.insert_batch(["h", "k"], [emb(1), emb(2)]))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not t2.done() and a.statistics().entries == 1  # t2 waits, reserving nothing
        client.gates["batch_put_from"].set()
        assert await t1 == InsertBatchStats(1, 0, 0)
        assert await t2 == InsertBatchStats(1, 1, 0)
        key = embedding_key(ns, b"h", torch.float32)
        assert client.puts_per_key[key] == 1
        assert client.calls["batch_put_from"] == 2  # t2 sent only k
        a.check_invariants()


async def test_push_timeout_is_counted_and_slots_stay_pinned_until_release(ns: str) -> None:
    client = FakeClient()
    async with node(client, ns, timeout=0.2) as a:
        client.gates["batch_put_from"].clear()
        st = await a.insert_batch(["a", "b"], [emb(1), emb(2)])
        assert st == InsertBatchStats(new=2, local_hit=0, skipped=0, push_failed=2)
        s = a.statistics()
        assert (s.pinned, s.store_errors, s.push_failed) == (2, 1, 2)
        got = await a.get_batch(["a"])  # still readable locally
        assert got[0] is not None
        client.gates["batch_put_from"].set()
        await settle(a)
        assert a.statistics().pinned == 0
        a.check_invariants()


async def test_corrupt_or_foreign_objects_are_misses(ns: str) -> None:
    client = FakeClient()
    async with node(client, ns) as a:
        await a.insert_batch(["bad", "good"], [emb(1), emb(2)])
    key = embedding_key(ns, b"bad", torch.float32)
    raw = bytearray(client.objects[key])
    raw[100] ^= 0xFF
    client.objects[key] = bytes(raw)
    async with node(client, ns) as f32:
        got = await f32.get_batch(["bad", "good"])
        assert got[0] is None and got[1] is not None and torch.equal(got[1], emb(2))
        s = f32.statistics()
        assert s.get_invalid == 0 and s.get_misses == 1 and s.entries == 1
        f32.check_invariants()
    assert key not in client.objects  # the backend removed the corrupt object
    # another dtype's cache reads other keys: a plain miss, nothing fetched, nothing evicted
    async with node(client, ns, dtype=torch.float16) as f16:
        await f16.insert_batch(["mine"], [emb(3).half()])
        assert await f16.get_batch(["good"]) == [None]
        s = f16.statistics()
        assert (s.get_invalid, s.get_misses, s.entries) == (0, 1, 1), s
        assert await f16.get_batch(["mine"]) != [None]  # not evicted for the foreign object


async def test_many_tasks_on_overlapping_hashes(ns: str) -> None:
    client = FakeClient()
    hashes = [f"img{i}" for i in range(12)]
    want = {h: emb(i, tokens=1 + i % 5) for i, h in enumerate(hashes)}
    rng = random.Random(3)
    async with node(client, ns, pool=6 * 512) as a, node(client, ns, pool=4 * 512) as b:
        pushed: dict[int, set[str]] = {id(a): set(), id(b): set()}

        async def worker(cache: EmbeddingCache, seed: int) -> None:
            r = random.Random(seed)
            for _ in range(15):
                pick = r.sample(hashes, r.randint(1, 4))
                if r.random() < 0.5:
                    pushed[id(cache)].update(pick)
                    st = await cache.insert_batch(pick, [want[h] for h in pick])
                    assert st.new + st.local_hit + st.skipped == len(pick)
                else:
                    for h, got in zip(pick, await cache.get_batch(pick), strict=True):
                        assert got is None or torch.equal(got, want[h]), h
                if r.random() < 0.3:
                    await asyncio.sleep(0)

        tasks = [worker(a if i % 3 else b, rng.randrange(1 << 30)) for i in range(40)]
        await asyncio.gather(*tasks)
        for cache in (a, b):
            await settle(cache)
            cache.check_invariants()
            s = cache.statistics()
            assert s.pinned == 0 and s.filling == 0 and s.lookup == 0
        assert all(n == 1 for n in client.puts_per_key.values())
        # within a node a key's bytes go out once; two nodes may both find a key absent and
        # both send it (the store's existence check is not a lock), never more than that
        sizes = sum(len(v) for v in client.objects.values())
        assert a._store is not None and b._store is not None
        sent = a._store.statistics().bytes_written + b._store.statistics().bytes_written
        both = pushed[id(a)] & pushed[id(b)]
        racy = sum(
            len(client.objects[embedding_key(ns, h, torch.float32)])
            for h in canonical_hashes(sorted(both))
        )
        assert sizes <= sent <= sizes + racy


async def test_close_with_a_hung_store_is_bounded(ns: str) -> None:
    client = FakeClient()
    client.gates["batch_put_from"].clear()  # the store hangs (a stopped master)
    try:
        loop = asyncio.get_running_loop()
        async with node(client, ns, timeout=0.2) as a:
            st = await a.insert_batch(["a"], [emb(1)])
            assert st.push_failed == 1
            t0 = loop.time()
        assert loop.time() - t0 < 2.0, "aclose waited for a hung worker"
    finally:
        client.gates["batch_put_from"].set()


async def test_object_failing_the_integrity_check_is_a_counted_miss(ns: str) -> None:
    """A stored object whose bytes were flipped is never returned: the store's verify fails,
    it removes the object and counts it ``corrupt``; the cache counts a miss (not
    ``get_invalid``, which is for objects that verify but cannot be used)."""
    client = FakeClient()
    async with node(client, ns) as a:
        await a.insert_batch(["img"], [emb(5)])
        await settle(a)
    (key,) = client.objects
    obj = bytearray(client.objects[key])
    obj[len(obj) // 2] ^= 0x08
    client.objects[key] = bytes(obj)
    store = FakeMooncakeStorage()
    store.client = client
    async with EmbeddingCache(pool_bytes=1 << 16, store=store, namespace=ns) as b:
        assert await b.get_batch(["img"]) == [None]
        s = b.statistics()
        assert (s.get_misses, s.get_invalid, s.get_store_hits) == (1, 0, 0)
        assert store.statistics().corrupt == 1
    assert key not in client.objects
