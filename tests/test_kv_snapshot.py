"""A consumer that joins late resyncs from a snapshot on the replay socket, then the stream.

Real ZeroMQ sockets on 127.0.0.1; the snapshot and the live batches are decoded with vLLM's
own msgspec structs (``tests/vllm_kv_events_schema.py``).  The consumer's view after the
snapshot plus every batch ``>= S`` must equal what the cache holds, medium by medium.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

import aiocache_kv as akv
from aiocache_kv.events import ZmqEventPublisher
from aiocache_kv.events.zmq import SNAPSHOT_REQUEST
from aiocache_kv.testing import ManualCopyEngine
from tests.conftest import small_config
from tests.test_split_ack import insert
from tests.test_zmq_events import ANY_PORT, RECV_TIMEOUT, TOPIC, published, recv, subscriber

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")
from tests import vllm_kv_events_schema as vllm  # noqa: E402

DECODER = msgspec.msgpack.Decoder(type=vllm.KVEventBatch)


@pytest.fixture
def zctx() -> Iterator[Any]:
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


View = set[tuple[int, str]]  # (block hash, medium)


def apply(view: View, events: list[Any]) -> None:
    for ev in events:
        if isinstance(ev, vllm.BlockStored):
            view |= {(h, ev.medium) for h in ev.block_hashes}
        elif isinstance(ev, vllm.BlockRemoved):
            view -= {(h, ev.medium) for h in ev.block_hashes}


def truth(cache: akv.HiCache) -> View:
    """What the cache holds, medium by medium (CPU: only blocks announced on CPU)."""
    return {(h, ev.medium) for ev in cache.snapshot_events() for h in ev.block_hashes}


async def ask_snapshot(zctx: Any, endpoint: str) -> tuple[int, list[Any], int]:
    """Send a snapshot request; return (S, the decoded events, messages)."""
    sock = zctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    await sock.send_multipart((b"", SNAPSHOT_REQUEST))
    events: list[Any] = []
    seqs: set[int] = set()
    messages = 0
    try:
        while True:
            _, topic, seq_bytes, payload = await recv(sock)
            if seq_bytes == vllm.END_SEQ:
                assert topic == b""
                start = int.from_bytes(payload, "big")
                break
            assert topic == TOPIC.encode()
            seqs.add(int.from_bytes(seq_bytes, "big"))
            events += DECODER.decode(payload).events
            messages += 1
    finally:
        sock.close(linger=0)
    assert seqs <= {start}, (seqs, start)
    return start, events, messages


async def test_late_consumer_resyncs_from_snapshot_then_stream(
    zctx: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("aiocache_kv.events.zmq.SNAPSHOT_CHUNK", 2)  # several messages
    engine = ManualCopyEngine()
    async with ZmqEventPublisher(
        ANY_PORT, topic=TOPIC, replay_endpoint=ANY_PORT, snapshot_interval=0.0
    ) as pub:
        assert pub.replay_endpoint is not None
        async with akv.HiCache(small_config(), copy_engine=engine) as cache:
            task = asyncio.create_task(pub.run(cache))
            hs = [insert(cache, [1, 2, 3, 4]), insert(cache, [1, 2, 5, 6, 7, 8])]
            slots = cache.alloc(4)
            hs.append(cache.insert([9, 9, 9, 9], slots, lora="adapter-a"))
            engine.complete_all()
            await cache.flush()
            await published(pub, 1)
            for h in hs:
                cache.release(h)
            assert cache.evict(2, tier="device") >= 2  # some blocks leave the GPU
            await asyncio.sleep(0.05)
            # the late consumer: subscribe first, then ask for the snapshot
            sub = await subscriber(zctx, pub.endpoint)
            start, snap, messages = await ask_snapshot(zctx, pub.replay_endpoint)
            assert messages >= 2 and all(isinstance(e, vllm.BlockStored) for e in snap)
            view: View = set()
            apply(view, snap)
            assert view == truth(cache)
            # the cache moves on; the consumer applies every batch >= S from the stream
            more = insert(cache, [1, 2, 3, 4, 10, 11])
            engine.complete_all()
            await cache.flush()
            cache.release(more)
            await published(pub, start + 1)
            while True:
                _, seq_bytes, payload = await recv(sub)
                seq = int.from_bytes(seq_bytes, "big")
                if seq >= start:
                    apply(view, DECODER.decode(payload).events)
                if seq == pub.next_seq - 1:
                    break
            assert view == truth(cache)
            sub.close(linger=0)
        await asyncio.wait_for(task, RECV_TIMEOUT)


async def test_snapshot_without_a_source_and_rate_limit(zctx: Any) -> None:
    async with ZmqEventPublisher(
        ANY_PORT, topic=TOPIC, replay_endpoint=ANY_PORT, snapshot_interval=0.3
    ) as pub:
        assert pub.replay_endpoint is not None
        start, events, messages = await _ask_raw(zctx, pub.replay_endpoint)
        assert (start, events, messages) == (None, [], 0)  # no source: the end marker alone
        async with akv.HiCache(small_config()) as cache:
            pub.serve_snapshots(cache)
            h = insert(cache, [1, 2])
            cache.release(h)
            await cache.flush()  # written through: on GPU and CPU
            first = await ask_snapshot(zctx, pub.replay_endpoint)
            again = await ask_snapshot(zctx, pub.replay_endpoint)  # nothing published since
            assert first == again and pub.snapshots_built == 1
            await pub.publish(cache.take_events())  # now S moved: a new one, not sooner
            t0 = asyncio.get_running_loop().time()
            start, snap, _ = await ask_snapshot(zctx, pub.replay_endpoint)
            assert pub.snapshots_built == 2 and start == 1 and len(snap) == 2  # GPU, CPU
            assert asyncio.get_running_loop().time() - t0 >= 0.2
    with pytest.raises(akv.InvalidInputError, match="snapshot_interval"):
        ZmqEventPublisher(ANY_PORT, snapshot_interval=-1)


async def _ask_raw(zctx: Any, endpoint: str) -> tuple[int | None, list[Any], int]:
    sock = zctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    await sock.send_multipart((b"", SNAPSHOT_REQUEST))
    _, topic, seq_bytes, last = await recv(sock)
    sock.close(linger=0)
    assert (topic, seq_bytes) == (b"", vllm.END_SEQ)
    return (int.from_bytes(last, "big") if last else None), [], 0
