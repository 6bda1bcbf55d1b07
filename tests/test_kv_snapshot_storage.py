"""Snapshots on the replay socket carry every medium's claims, storage included.

Real ZeroMQ sockets on 127.0.0.1, decoded with vLLM's msgspec structs.  A consumer that
subscribes late, applies a snapshot and then every batch ``>= S`` must hold what a consumer
of every batch holds: on GPU and CPU what the tree holds, in STORAGE at least the tree's
storage-resident pages and only pages the store holds (``FileStorage``, bounded), also once
the cache closed while the publisher stays open (the example server closes it last).  A
publisher reused for a new cache snapshots the new one.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Hashable, Iterator
from pathlib import Path
from typing import Any

import pytest

import aiocache_kv as akv
from aiocache_kv.events import ZmqEventPublisher
from aiocache_kv.storage import tier
from tests.conftest import small_config
from tests.storage.test_storage_claims import (
    RecordingStore,
    View,
    claims_config,
    page_file_bytes,
    tree_view,
    workload,
)
from tests.test_kv_snapshot import DECODER, apply, ask_snapshot
from tests.test_split_ack import insert
from tests.test_zmq_events import ANY_PORT, RECV_TIMEOUT, TOPIC, recv, subscriber

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgspec")

Pairs = set[tuple[Hashable, str]]  # (block hash, medium)


@pytest.fixture
def zctx() -> Iterator[Any]:
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


def pairs(media: dict[str, set[Hashable]]) -> Pairs:
    return {(h, m) for m, held in media.items() for h in held}


async def caught_up(pub: ZmqEventPublisher, cache: akv.HiCache) -> None:
    """Wait until ``pub.run(cache)`` sent every event the cache published."""
    deadline = asyncio.get_running_loop().time() + RECV_TIMEOUT
    while pub.events_published < cache.statistics().events_published:
        assert asyncio.get_running_loop().time() < deadline, "the publisher fell behind"
        await asyncio.sleep(0.001)


async def read_until(sub: Any, view: Pairs, start: int, pub: ZmqEventPublisher) -> int:
    """Apply every batch ``>= start`` the subscriber receives until the last one ``pub``
    sent; the sequence number to go on from."""
    while start < pub.next_seq:
        _, seq_bytes, payload = await recv(sub)
        seq = int.from_bytes(seq_bytes, "big")
        if seq >= start:
            apply(view, DECODER.decode(payload).events)
            start = seq + 1
    return start


async def test_a_late_consumer_holds_every_mediums_claims_before_and_after_close(
    zctx: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tier, "BACKUP_PART_BYTES", 1)  # backups spread: slices evict
    size = await page_file_bytes(tmp_path)
    store = RecordingStore(tmp_path / "kv", 20 * size, seed=5)
    rng = random.Random(5)
    full = View()  # every batch run() sends, as it sends it
    prompts: list[list[int]] = []
    async with ZmqEventPublisher(
        ANY_PORT, topic=TOPIC, replay_endpoint=ANY_PORT, snapshot_interval=0.0
    ) as pub:
        assert pub.replay_endpoint is not None
        cache = akv.HiCache(claims_config(store))
        await cache.start()
        task = asyncio.create_task(pub.run(cache, on_batch=full.feed))
        try:
            await workload(cache, rng, 30, prompts)
            await caught_up(pub, cache)
            sub = await subscriber(zctx, pub.endpoint)
            start, snap, _ = await ask_snapshot(zctx, pub.replay_endpoint)
            late: Pairs = set()
            apply(late, snap)
            outside = {h for h, m in late if m == "STORAGE"} - tree_view(cache)["STORAGE"]
            assert outside  # claims of pages whose nodes left the tree, or lost a page
            await workload(cache, rng, 30, prompts)
            await cache.flush()
            await caught_up(pub, cache)
            start = await read_until(sub, late, start, pub)
            assert late == pairs(full.media)
            in_tree, there = tree_view(cache), await store.present()
            assert full.media["GPU"] == in_tree["GPU"] and full.media["CPU"] == in_tree["CPU"]
            assert in_tree["STORAGE"] <= full.media["STORAGE"] <= there
            assert cache.statistics().evicted_pages_storage > 0
            assert any(m == "STORAGE" for _, m in late)
        finally:
            await cache.aclose()  # the publisher stays open: the example server's order
        await asyncio.wait_for(task, RECV_TIMEOUT)
        await read_until(sub, late, start, pub)
        assert late == pairs(full.media)
        assert not full.media["GPU"] | full.media["CPU"]
        assert full.media["STORAGE"] and full.media["STORAGE"] <= await store.present()
        # a consumer that asks now gets what the stream left claimed: storage only
        _, after, _ = await ask_snapshot(zctx, pub.replay_endpoint)
        fresh: Pairs = set()
        apply(fresh, after)
        assert fresh == pairs(full.media)
        sub.close(linger=0)


async def test_a_publisher_reused_for_a_new_cache_snapshots_the_new_one(zctx: Any) -> None:
    async with ZmqEventPublisher(
        ANY_PORT, topic=TOPIC, replay_endpoint=ANY_PORT, snapshot_interval=0.0
    ) as pub:
        assert pub.replay_endpoint is not None
        for k, tokens in enumerate(([1, 2, 3, 4], [7, 8, 9, 10, 11, 12])):
            async with akv.HiCache(small_config()) as cache:
                task = asyncio.create_task(pub.run(cache))
                cache.release(insert(cache, tokens, seed=k))
                await cache.flush()
                await caught_up(pub, cache)
                _, snap, _ = await ask_snapshot(zctx, pub.replay_endpoint)
                view: Pairs = set()
                apply(view, snap)
                assert view == pairs(tree_view(cache)), f"cache {k}"
                assert len(view) == len(tokens)  # GPU and CPU, a page of 2 each
            await asyncio.wait_for(task, RECV_TIMEOUT)
        # one chosen with serve_snapshots stays, whatever run publishes
        async with akv.HiCache(small_config()) as chosen, akv.HiCache(small_config()) as other:
            pub.serve_snapshots(chosen)
            chosen.release(insert(chosen, [5, 6]))
            await chosen.flush()
            task = asyncio.create_task(pub.run(other))
            await asyncio.sleep(0.01)
            _, snap, _ = await ask_snapshot(zctx, pub.replay_endpoint)
            view = set()
            apply(view, snap)
            assert view == pairs(tree_view(chosen))
        await asyncio.wait_for(task, RECV_TIMEOUT)
