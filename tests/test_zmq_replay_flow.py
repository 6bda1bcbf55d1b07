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
import concurrent.futures
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
MANY = 1500  # connections: their events would fill a monitor pipe of default marks (2 x 1000)


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


def dealer(
    zctx: Any, endpoint: str | None, *, small: bool = False, routing_id: bytes | None = None
) -> Any:
    """A DEALER connected to ``endpoint``; ``small``: with a one-message pipe and a fixed
    64 KiB TCP receive buffer (no autotuning), so that a full replay cannot sit in buffers;
    ``routing_id``: with that explicit routing id."""
    assert endpoint is not None
    sock = zctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if routing_id is not None:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
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


async def no_message(sock: Any, within: float = 0.3) -> None:
    """Nothing arrives on ``sock`` for ``within`` seconds."""
    with pytest.raises(asyncio.TimeoutError):
        frames = await recv(sock, within)
        raise AssertionError(f"unexpected message {[f[:16] for f in frames]}")


async def test_a_reconnect_with_the_same_routing_id_never_gets_the_old_answer(
    zctx: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DEALER with an explicit routing id stops reading mid-replay and closes; a new
    connection with the same id gets its own answer alone, never the rest of the old one
    (which counts as abandoned, not completed).  The retry back-off is stretched so that the
    old cursor is not found gone by a failed send before the new connection asks."""
    monkeypatch.setattr("aiocache_kv.events.zmq_replay._BACKOFF_MIN", 1.0)
    monkeypatch.setattr("aiocache_kv.events.zmq_replay._BACKOFF_MAX", 1.0)
    n = 5000
    async with ZmqEventPublisher(
        ANY_PORT, topic=TOPIC, replay_endpoint=ANY_PORT, buffer_steps=n
    ) as pub:
        await fill(pub, n)
        old = dealer(zctx, pub.replay_endpoint, small=True, routing_id=b"consumer-1")
        await old.send_multipart((b"", (0).to_bytes(8, "big")))
        for _ in range(5):
            await recv(old)
        await asyncio.sleep(0.3)  # the old answer stalls on the full pipe
        old.close(linger=0)
        await asyncio.sleep(0.2)  # the publisher sees the old connection go
        new = dealer(zctx, pub.replay_endpoint, routing_id=b"consumer-1")
        try:
            await new.send_multipart((b"", (n - 2).to_bytes(8, "big")))
            assert (await read_replay(new))[0] == [n - 2, n - 1]
            await no_message(new)
            assert (pub.replays_completed, pub.replays_abandoned) == (1, 1)
        finally:
            new.close(linger=0)


@pytest.mark.parametrize(
    "body",
    [b"", b"\x00" * 7, b"\x00" * 9, SNAPSHOT_REQUEST + b"!", b"\x7f" * (1 << 20)],
    ids=["empty", "short", "long", "almost-snapshot", "1MiB"],
)
async def test_a_request_that_is_neither_a_seq_nor_the_snapshot_marker_is_refused(
    zctx: Any, body: bytes
) -> None:
    """Only an 8-byte start seq or ``SNAPSHOT_REQUEST`` is a request: an empty body is not
    "replay everything", anything else gets no answer (and is not kept; a frame over the
    socket's ``MAXMSGSIZE`` costs its sender the connection); the socket goes on serving."""
    async with ZmqEventPublisher(
        ANY_PORT, topic=TOPIC, replay_endpoint=ANY_PORT, buffer_steps=8
    ) as pub:
        for i in range(3):
            await pub.publish(batch(i), ts=float(i))
        bad = dealer(zctx, pub.replay_endpoint)
        good = dealer(zctx, pub.replay_endpoint)
        try:
            await bad.send_multipart((b"", body))
            await no_message(bad)
            await good.send_multipart((b"", (2).to_bytes(8, "big")))
            assert (await read_replay(good))[0] == [2]
            assert (pub.replays_completed, pub.replays_abandoned) == (1, 0)
        finally:
            bad.close(linger=0)
            good.close(linger=0)


async def test_a_peer_with_a_255_byte_routing_id_is_served(zctx: Any) -> None:
    """The socket's ``MAXMSGSIZE`` bounds requests, not handshakes: the longest routing id
    ZeroMQ allows still connects and gets its answer."""
    async with ZmqEventPublisher(ANY_PORT, topic=TOPIC, replay_endpoint=ANY_PORT) as pub:
        await pub.publish(batch(0), ts=0.0)
        sock = dealer(zctx, pub.replay_endpoint, routing_id=b"r" * 255)
        try:
            await sock.send_multipart((b"", (0).to_bytes(8, "big")))
            assert (await read_replay(sock))[0] == [0]
        finally:
            sock.close(linger=0)


async def test_cancelling_the_task_that_awaits_aclose_still_cancels_it() -> None:
    """``aclose()`` waits for the replay task it cancelled without taking that task's
    ``CancelledError`` as its caller's: the sockets close, then the caller's cancellation
    propagates."""
    pub = ZmqEventPublisher(ANY_PORT, topic=TOPIC, replay_endpoint=ANY_PORT)
    await pub.start()
    after: list[str] = []

    async def closer() -> None:
        await pub.aclose()
        after.append("went on")

    task = asyncio.create_task(closer())
    await asyncio.sleep(0)  # the closer now waits for the replay task
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert after == []
    assert pub.replay_endpoint == ANY_PORT  # the socket is closed: the configured address


class SlowToCancel:
    """An event source whose pending ``__anext__`` takes a while to give up when cancelled."""

    async def events(self) -> Any:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await asyncio.sleep(0.3)
            raise
        yield  # pragma: no cover

    def take_events(self) -> list[KVEvent]:
        return []


async def test_cancelling_run_while_it_stops_its_pending_read_still_cancels_it() -> None:
    """``run`` stopping its pending read (the publisher closed) does not swallow a
    cancellation of its own task meanwhile."""
    pub = ZmqEventPublisher(ANY_PORT, topic=TOPIC)
    await pub.start()
    task = asyncio.create_task(pub.run(SlowToCancel()))  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    await pub.aclose()
    await asyncio.sleep(0.05)  # run now waits for its read to give up
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


class FailingSource:
    calls = 0

    def snapshot_events(self) -> list[BlockStored]:
        self.calls += 1
        raise RuntimeError("source broken")


async def test_a_failing_snapshot_source_answers_the_bare_end_marker_once_per_interval(
    zctx: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A snapshot source that raises: each request still gets an answer (the end marker with
    an empty last frame, as with no source), the failure is logged once with its error, and
    the source is not asked again before ``snapshot_interval`` has passed."""
    caplog.set_level(logging.INFO, logger="aiocache_kv.events")
    source = FailingSource()
    async with ZmqEventPublisher(
        ANY_PORT, topic=TOPIC, replay_endpoint=ANY_PORT, snapshot_interval=10.0
    ) as pub:
        await pub.publish([])
        pub.serve_snapshots(source)
        sock = dealer(zctx, pub.replay_endpoint)
        try:
            for _ in range(3):
                await sock.send_multipart((b"", SNAPSHOT_REQUEST))
            for _ in range(3):
                assert await recv(sock, 2.0) == [b"", b"", END_SEQ, b""]
            assert source.calls == 1
            assert pub.snapshots_built == 0
            await sock.send_multipart((b"", (0).to_bytes(8, "big")))
            assert (await read_replay(sock))[0] == [0]
        finally:
            sock.close(linger=0)
    failures = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(failures) == 1, caplog.text
    assert "source broken" in failures[0].getMessage()


async def test_a_flood_of_bad_requests_is_logged_a_few_times_not_per_request(
    zctx: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Malformed messages, refused bodies and requests beyond a peer's queue are logged at
    warning level the first time (then in counted summaries at most every few seconds), not
    once per message."""
    caplog.set_level(logging.INFO, logger="aiocache_kv.events")
    async with ZmqEventPublisher(
        ANY_PORT, topic=TOPIC, replay_endpoint=ANY_PORT, buffer_steps=8
    ) as pub:
        await pub.publish(batch(0), ts=0.0)
        sock = dealer(zctx, pub.replay_endpoint)
        try:
            for _ in range(300):
                await sock.send_multipart((b"one-part",))
                await sock.send_multipart((b"", b""))
            for _ in range(300):
                await sock.send_multipart((b"", (0).to_bytes(8, "big")))
            answers = 0
            with pytest.raises(asyncio.TimeoutError):
                while True:
                    await read_replay(sock, 0.5)
                    answers += 1
            assert 0 < answers < 300  # beyond the queue's bound: ignored
        finally:
            sock.close(linger=0)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert 1 <= len(warnings) <= 3, caplog.text


@pytest.mark.allow_blocking
async def test_connection_churn_while_the_loop_is_busy_never_blocks_libzmq(zctx: Any) -> None:
    """The server watches connections through a monitor; while the loop is busy (blocked
    here) and cannot read its events, hundreds of connections coming and going must not fill
    the monitor's pipe and block libzmq's I/O thread (which the PUB stream shares): each new
    connection still completes its handshake."""
    async with ZmqEventPublisher(ANY_PORT, topic=TOPIC, replay_endpoint=ANY_PORT) as pub:
        endpoint = pub.replay_endpoint

        def churn() -> int:
            """Connections made, each through its handshake, before one could not be."""
            ctx = zmq.Context()
            try:
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
                for made in range(MANY):
                    sock.connect(endpoint)
                    if not mon.poll(2000):
                        return made
                    mon.recv_multipart()
                    sock.disconnect(endpoint)
                return MANY
            finally:
                ctx.destroy(linger=0)

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            assert pool.submit(churn).result(timeout=60) == MANY  # the loop waits, blocked
        await asyncio.sleep(0.2)
        sock = dealer(zctx, endpoint)
        try:
            await sock.send_multipart((b"", (0).to_bytes(8, "big")))
            assert (await read_replay(sock))[0] == []
        finally:
            sock.close(linger=0)
