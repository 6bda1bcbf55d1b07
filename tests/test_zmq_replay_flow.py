"""Flow control on the publisher's replay socket: real ZeroMQ sockets on 127.0.0.1.

A ROUTER drops a message silently once a peer's pipe is full, so a replay (or snapshot)
larger than the high-water mark used to lose its tail and its end marker.  The publisher now
sends with ``ROUTER_MANDATORY`` and waits for room, peer by peer: every answer arrives whole,
in order, then its end marker; a peer that stops reading is abandoned after
``REPLAY_STALL_TIMEOUT`` without holding up anyone else, and one that leaves mid-answer is
dropped quietly.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest

from aiocache_kv.events import BlockRemoved, BlockStored, KVEvent, ZmqEventPublisher
from aiocache_kv.events.zmq import END_SEQ, SNAPSHOT_REQUEST, encode_batch
from tests.test_zmq_events import ANY_PORT, TOPIC, decode_vllm_batch, recv, subscriber

zmq = pytest.importorskip("zmq")

N = 10_000  # batches: ten times the ROUTER's default send high-water mark (1000)
PER = 50  # block hashes per batch: ~1.7 KB a payload, ~17 MB a full replay
STALL = "aiocache_kv.events.zmq_replay.REPLAY_STALL_TIMEOUT"
BOUND = 2.5  # the stall bound in the test of a silent peer


@pytest.fixture
def zctx() -> Iterator[Any]:
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def msgpack() -> Any:
    return pytest.importorskip("msgpack")


def batch(i: int) -> list[KVEvent]:
    return [BlockRemoved([i, *([bytes(32)] * PER)], "GPU")]


async def fill(pub: ZmqEventPublisher, n: int = N) -> list[bytes]:
    """Publish ``n`` batches (nobody subscribes); return their payloads by seq."""
    payloads = []
    for i in range(n):
        await pub.publish(batch(i), ts=float(i))
        payloads.append(encode_batch(batch(i), float(i)))
    return payloads


def dealer(zctx: Any, endpoint: str | None, *, small: bool = False) -> Any:
    """A DEALER connected to ``endpoint``; ``small``: with a one-message pipe and a fixed
    64 KiB TCP receive buffer (no autotuning), so that a full replay cannot sit in buffers."""
    assert endpoint is not None
    sock = zctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if small:
        sock.setsockopt(zmq.RCVHWM, 1)
        sock.setsockopt(zmq.RCVBUF, 1 << 16)
    sock.connect(endpoint)
    return sock


async def read_replay(sock: Any, timeout: float = 5.0) -> tuple[list[int], list[bytes]]:
    """Read one map-framed replay answer up to its end marker: (seqs, payloads)."""
    seqs, payloads = [], []
    while True:
        empty, topic, seq_bytes, payload = await recv(sock, timeout)
        assert empty == b""
        if seq_bytes == END_SEQ:
            assert (topic, payload) == (b"", b"")
            return seqs, payloads
        assert topic == TOPIC.encode()
        seqs.append(int.from_bytes(seq_bytes, "big"))
        payloads.append(payload)


async def eventually(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


async def test_replay_far_above_the_hwm_arrives_whole_in_order(zctx: Any, msgpack: Any) -> None:
    """(a) 10,000 buffered batches, asked for from 0: every one, in order, then the marker."""
    async with ZmqEventPublisher(
        ANY_PORT, topic=TOPIC, replay_endpoint=ANY_PORT, buffer_steps=N
    ) as pub:
        payloads = await fill(pub)
        sock = dealer(zctx, pub.replay_endpoint)
        try:
            await sock.send_multipart((b"", (0).to_bytes(8, "big")))
            seqs, got = await read_replay(sock)
            assert seqs == list(range(N))
            assert got == payloads
            assert decode_vllm_batch(msgpack, got[-1])[1] == batch(N - 1)
            # the socket keeps serving: a second request on the same connection
            await sock.send_multipart((b"", (N - 3).to_bytes(8, "big")))
            assert (await read_replay(sock))[0] == [N - 3, N - 2, N - 1]
        finally:
            sock.close(linger=0)


class ManyBlocks:
    """A snapshot source with many events (one message each with ``SNAPSHOT_CHUNK`` = 1)."""

    def __init__(self, n: int) -> None:
        self.events = [
            BlockStored([i, *([bytes(32)] * PER)], None, [1, 2], 2, "GPU") for i in range(n)
        ]

    def snapshot_events(self) -> list[BlockStored]:
        return self.events


async def test_big_snapshot_arrives_whole_in_order(
    zctx: Any, msgpack: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(a) The snapshot path: 5,000 messages, all of them, then the marker carrying S."""
    monkeypatch.setattr("aiocache_kv.events.zmq.SNAPSHOT_CHUNK", 1)
    source = ManyBlocks(5000)
    async with ZmqEventPublisher(ANY_PORT, topic=TOPIC, replay_endpoint=ANY_PORT) as pub:
        pub.serve_snapshots(source)
        await pub.publish([])
        sock = dealer(zctx, pub.replay_endpoint)
        try:
            await sock.send_multipart((b"", SNAPSHOT_REQUEST))
            events = []
            while True:
                _, topic, seq_bytes, payload = await recv(sock)
                if seq_bytes == END_SEQ:
                    assert topic == b"" and int.from_bytes(payload, "big") == 1
                    break
                assert (topic, int.from_bytes(seq_bytes, "big")) == (TOPIC.encode(), 1)
                events += decode_vllm_batch(msgpack, payload)[1]
            assert events == source.events
        finally:
            sock.close(linger=0)


async def test_a_peer_that_never_reads_holds_up_nobody_and_is_abandoned(
    zctx: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(b) One peer asks for everything and never reads; another's replay and the PUB stream
    go on meanwhile, and the silent peer is given up after the stall bound."""
    monkeypatch.setattr(STALL, BOUND)
    async with ZmqEventPublisher(
        ANY_PORT, topic=TOPIC, replay_endpoint=ANY_PORT, buffer_steps=N + 1000
    ) as pub:
        await fill(pub)
        sub = await subscriber(zctx, pub.endpoint)
        stuck = dealer(zctx, pub.replay_endpoint, small=True)
        good = dealer(zctx, pub.replay_endpoint)
        try:
            t0 = time.monotonic()
            await stuck.send_multipart((b"", (0).to_bytes(8, "big")))
            await asyncio.sleep(0.3)  # its pipe and TCP buffers fill up
            await good.send_multipart((b"", (0).to_bytes(8, "big")))

            async def live() -> float:
                worst = 0.0
                for _ in range(20):
                    t = time.monotonic()
                    seq = await pub.publish([BlockRemoved([1], "GPU")])
                    _, seq_bytes, _ = await recv(sub, 1.0)
                    assert int.from_bytes(seq_bytes, "big") == seq
                    worst = max(worst, time.monotonic() - t)
                    await asyncio.sleep(0.01)
                return worst

            (seqs, _), worst = await asyncio.gather(read_replay(good), live())
            assert len(seqs) >= N and seqs == list(range(len(seqs)))
            assert worst < 0.5, f"a live batch took {worst:.3f} s to arrive"
            assert pub.replays_abandoned == 0  # served while the stuck peer still waited

            await eventually(lambda: pub.replays_abandoned == 1, 5.0, "stuck peer kept")
            assert time.monotonic() - t0 >= BOUND
            # what reached the stuck peer before it was given up: in order, no end marker
            got = []
            with pytest.raises(asyncio.TimeoutError):
                while True:
                    frames = await recv(stuck, 0.5)
                    got.append(frames[2])
            assert END_SEQ not in got
            assert [int.from_bytes(s, "big") for s in got] == list(range(len(got)))
            # still serving
            await good.send_multipart((b"", (N - 1).to_bytes(8, "big")))
            assert (await read_replay(good))[0][0] == N - 1
        finally:
            for sock in (sub, stuck, good):
                sock.close(linger=0)


async def test_a_peer_that_leaves_mid_replay_is_dropped_quietly(
    zctx: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """(c) A peer closes after a few replies: dropped at once (not after the stall bound),
    nothing reaches the loop's exception handler, the socket serves the next peer."""
    monkeypatch.setattr(STALL, 60.0)
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    caplog.set_level(logging.INFO, logger="aiocache_kv.events")
    try:
        async with ZmqEventPublisher(
            ANY_PORT, topic=TOPIC, replay_endpoint=ANY_PORT, buffer_steps=N
        ) as pub:
            await fill(pub)
            for _ in range(2):
                leaver = dealer(zctx, pub.replay_endpoint, small=True)
                await leaver.send_multipart((b"", (0).to_bytes(8, "big")))
                for _ in range(10):
                    await recv(leaver)
                leaver.close(linger=0)
            await eventually(lambda: pub.replays_abandoned == 2, 5.0, "leavers kept")
            sock = dealer(zctx, pub.replay_endpoint)
            try:
                await sock.send_multipart((b"", (N - 2).to_bytes(8, "big")))
                assert (await read_replay(sock))[0] == [N - 2, N - 1]
            finally:
                sock.close(linger=0)
    finally:
        loop.set_exception_handler(None)
    assert errors == []
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert caplog.text.count("kv_events_replay_peer_gone") == 2  # EHOSTUNREACH, not a stall
