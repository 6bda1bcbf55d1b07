"""ZmqEventPublisher: vLLM's KV-event wire format over real ZeroMQ sockets on 127.0.0.1.

The payloads are decoded by a decoder written to vLLM's schema (``vllm/distributed/kv_events.py``:
tagged ``array_like`` structs, positional fields) and, when msgspec is installed, by msgspec
structs mirroring vLLM's definitions (byte-for-byte).  Without pyzmq/msgpack these tests skip
locally and FAIL under ``CI=true``.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

import aiocache_kv as akv
from aiocache_kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    MissingDependencyError,
    ZmqEventPublisher,
)
from aiocache_kv.events.kv_events import lora_id_of
from aiocache_kv.events.zmq import END_SEQ, EventEncoding, encode_batch
from aiocache_kv.testing import ManualCopyEngine
from tests.conftest import small_config
from tests.test_split_ack import insert

TOPIC = "kv-events"
ANY_PORT = "tcp://127.0.0.1:*"
RECV_TIMEOUT = 5.0


def require_events_deps() -> tuple[Any, Any]:
    """``(zmq.asyncio, msgpack)``; skip if missing - but fail under ``CI=true``."""
    try:
        import msgpack
        import zmq.asyncio
    except ImportError as exc:
        msg = f"the events extra is not installed ({exc}): pip install 'aiocache_kv[events]'"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI: {msg}")
        pytest.skip(msg)
    return zmq.asyncio, msgpack


@pytest.fixture
def zmq_asyncio() -> Any:
    return require_events_deps()[0]


@pytest.fixture
def msgpack() -> Any:
    return require_events_deps()[1]


@pytest.fixture
def zctx(zmq_asyncio: Any) -> Iterator[Any]:
    ctx = zmq_asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


# ------------------------------------------------------------------ vLLM-schema decoder


def decode_vllm_batch(msgpack: Any, payload: bytes) -> tuple[float, list[KVEvent], int | None]:
    """Decode ``payload`` as vLLM's ``KVEventBatch`` (positional, tag first) into our events.

    Written to vLLM's declaration order: BlockStored(block_hashes, parent_block_hash, token_ids,
    block_size, lora_id, medium, lora_name, [extra_keys, group_idx, ...]),
    BlockRemoved(block_hashes, medium, [group_idx]), AllBlocksCleared(); or the tagged maps of
    the same fields.  ``extra_keys`` and ``event_version`` are dropped.
    """
    batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    assert isinstance(batch, list) and len(batch) == 3, batch
    ts, raw_events, rank = batch
    assert isinstance(ts, float)
    out: list[KVEvent] = []
    for raw in raw_events:
        if isinstance(raw, dict):  # map encoding
            tag = raw.pop("type")
            fields = raw
        else:
            tag, *vals = raw
            names = {
                "BlockStored": [
                    "block_hashes",
                    "parent_block_hash",
                    "token_ids",
                    "block_size",
                    "lora_id",
                    "medium",
                    "lora_name",
                ],
                "BlockRemoved": ["block_hashes", "medium"],
                "AllBlocksCleared": [],
            }[tag]
            if tag == "BlockStored" and len(vals) == len(names) + 1:
                names.append("extra_keys")
            assert len(vals) == len(names), (tag, vals)
            fields = dict(zip(names, vals, strict=True))
        if tag == "BlockStored":
            fields.pop("event_version", None)
            fields.pop("extra_keys", None)  # checked against vLLM's structs where it matters
            out.append(BlockStored(**fields))
        elif tag == "BlockRemoved":
            out.append(BlockRemoved(**fields))
        else:
            assert tag == "AllBlocksCleared" and not fields
            out.append(AllBlocksCleared())
    return ts, out, rank


async def recv(sock: Any, timeout: float = RECV_TIMEOUT) -> list[bytes]:
    frames: list[bytes] = await asyncio.wait_for(sock.recv_multipart(), timeout)
    return frames


async def published(pub: ZmqEventPublisher, batches: int = 0, events: int = 0) -> None:
    """Wait until ``pub`` has sent that many batches and events (its ``run`` task caught up)."""
    deadline = time.monotonic() + RECV_TIMEOUT
    while pub.next_seq < batches or pub.events_published < events:
        assert time.monotonic() < deadline, f"{pub.next_seq} batches sent, {batches} expected"
        await asyncio.sleep(0.001)


async def subscriber(zctx: Any, endpoint: str, topic: str = TOPIC) -> Any:
    import zmq

    sub = zctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt_string(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint)
    await asyncio.sleep(0.2)  # PUB/SUB slow joiner: let the subscription reach the publisher
    return sub


@pytest.fixture
async def publisher(zmq_asyncio: Any) -> AsyncIterator[ZmqEventPublisher]:
    pub = ZmqEventPublisher(ANY_PORT, topic=TOPIC, replay_endpoint=ANY_PORT, buffer_steps=8)
    await pub.start()
    yield pub
    await pub.aclose()


# ------------------------------------------------------------------ tests


async def test_cache_events_reach_a_real_subscriber(
    publisher: ZmqEventPublisher, zctx: Any, msgpack: Any, engine: ManualCopyEngine
) -> None:
    """Inserts, write-through and eviction of a real HiCache, in order, seq 0, 1, 2, ..."""
    assert publisher.endpoint.startswith("tcp://127.0.0.1:")
    sub = await subscriber(zctx, publisher.endpoint)
    sent: list[list[KVEvent]] = []
    t0 = time.time()
    cache = akv.HiCache(small_config(), copy_engine=engine)
    async with cache:
        task = asyncio.create_task(publisher.run(cache, on_batch=sent.append))
        r = insert(cache, [1, 2, 3, 4])
        await published(publisher, 1)
        engine.complete_all()
        await cache.flush()
        cache.release(r)
        assert cache.evict(2) == 2
        await published(publisher, events=3)
        # two inserts in one loop tick -> one batch
        r2 = insert(cache, [5, 6, 7, 8])
        r3 = insert(cache, [9, 9, 9, 9], seed=1)
        await published(publisher, len(sent) + 1)
        assert [type(e).__name__ for e in sent[-1]] == ["BlockStored", "BlockStored"]
        engine.complete_all()
        await cache.flush()
        cache.release(r2)
        cache.release(r3)
    await asyncio.wait_for(task, RECV_TIMEOUT)  # the cache closed: run() returns

    received: list[KVEvent] = []
    for seq, batch in enumerate(sent):
        topic, seq_bytes, payload = await recv(sub)
        assert topic == TOPIC.encode()
        assert len(seq_bytes) == 8 and int.from_bytes(seq_bytes, "big") == seq
        ts, events, rank = decode_vllm_batch(msgpack, payload)
        assert t0 <= ts <= time.time() and rank == 0  # vLLM's default rank
        assert events == batch
        received.extend(events)
    assert publisher.next_seq == len(sent)
    assert publisher.events_published == len(received)
    kinds = [(type(e).__name__, getattr(e, "medium", None)) for e in received]
    assert kinds == [
        ("BlockStored", "GPU"),
        ("BlockStored", "CPU"),
        ("BlockRemoved", "GPU"),
        ("BlockStored", "GPU"),
        ("BlockStored", "GPU"),
        ("BlockStored", "CPU"),
        ("BlockStored", "CPU"),
        ("BlockRemoved", "GPU"),  # at close: device and host pages go, storage would stay
        ("BlockRemoved", "CPU"),
    ]
    assert len(sent[0]) == 1
    first = received[0]
    assert isinstance(first, BlockStored)
    assert first.token_ids == [1, 2, 3, 4] and first.block_size == 2
    # full-width page identities, as bytes (vLLM's ExternalBlockHash is bytes | int)
    assert len(first.block_hashes) == 2
    assert all(type(h) is bytes and len(h) == 32 for h in first.block_hashes)
    removed = received[2]
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == first.block_hashes
    sub.close(linger=0)


async def test_wire_bytes_match_vllm_msgspec_structs() -> None:
    """Byte-for-byte against msgspec structs mirroring vLLM's; decodable by old and new ones."""
    require_events_deps()
    import msgspec  # a dev dependency: CI must run this check, never skip it

    h = [b"\xff" * 32, bytes(31) + b"\x39"]
    parent = b"\x80" + bytes(30) + b"\x05"
    ours: list[KVEvent] = [
        BlockStored(h, parent, [1, 2, 3, 4], 2, "GPU"),
        BlockStored(h[:1], None, [7, 8], 2, "CPU", lora_id=3),
        BlockRemoved(h, "STORAGE"),
        AllBlocksCleared(),
    ]
    for array_like, encoding in ((True, "array"), (False, "map")):
        for schema in ("medium", "lora_name", "group_idx"):
            ns = vllm_structs(msgspec, schema, array_like)
            batch_t, stored_t, removed_t, cleared_t = ns
            extra = () if schema == "medium" else (None,)
            theirs = batch_t(
                ts=1757500000.25,
                events=[
                    stored_t(h, parent, [1, 2, 3, 4], 2, None, "GPU", *extra),
                    stored_t(h[:1], None, [7, 8], 2, 3, "CPU", *extra),
                    removed_t(h, "STORAGE"),
                    cleared_t(),
                ],
                data_parallel_rank=1,
            )
            for rank in (1, None):
                mine = encode_batch(ours, 1757500000.25, rank, encoding)  # type: ignore[arg-type]
                decoded = msgspec.msgpack.decode(mine, type=batch_t)
                assert decoded.events == theirs.events, (schema, encoding)
                assert decoded.data_parallel_rank == rank and decoded.ts == 1757500000.25
            theirs_bytes = msgspec.msgpack.encode(theirs)
            mine = encode_batch(ours, 1757500000.25, 1, encoding)  # type: ignore[arg-type]
            if schema == "lora_name" or (schema == "group_idx" and not array_like):
                # array: the schema we emit; map: defaulted fields are omitted
                assert mine == theirs_bytes, (schema, encoding)


def vllm_structs(msgspec: Any, schema: str, array_like: bool) -> tuple[Any, Any, Any, Any]:
    """msgspec structs as ``vllm/distributed/kv_events.py`` declares them.

    ``medium``: BlockStored up to ``medium``; ``lora_name``: plus ``lora_name``; ``group_idx``:
    plus the defaulted ``extra_keys``, ``group_idx``, ``kv_cache_spec_*`` (``array_like`` on
    the events, or tagged maps after vllm-project/vllm#42892).  ``defstruct`` because this
    module's annotations are strings.
    """
    ext_hash = bytes | int
    opts: dict[str, Any] = dict(omit_defaults=True, gc=False)
    batch = msgspec.defstruct(
        "EventBatch",
        [("ts", float), ("events", list[Any]), ("data_parallel_rank", int | None, None)],
        array_like=True,
        **opts,
    )
    base = msgspec.defstruct("KVCacheEvent", [], array_like=array_like, tag=True, **opts)
    stored_fields: list[tuple[Any, ...]] = [
        ("block_hashes", list[ext_hash]),
        ("parent_block_hash", ext_hash | None),
        ("token_ids", list[int]),
        ("block_size", int),
        ("lora_id", int | None),
        ("medium", str | None),
    ]
    removed_fields: list[tuple[Any, ...]] = [
        ("block_hashes", list[ext_hash]),
        ("medium", str | None),
    ]
    if schema != "medium":
        stored_fields.append(("lora_name", str | None))
    if schema == "group_idx":
        stored_fields += [
            ("extra_keys", list[tuple[Any, ...] | None] | None, None),
            ("group_idx", int | None, None),
            ("kv_cache_spec_kind", str | None, None),
            ("kv_cache_spec_sliding_window", int | None, None),
        ]
        removed_fields.append(("group_idx", int | None, None))
    stored = msgspec.defstruct("BlockStored", stored_fields, bases=(base,))
    removed = msgspec.defstruct("BlockRemoved", removed_fields, bases=(base,))
    cleared = msgspec.defstruct("AllBlocksCleared", [], bases=(base,))
    kv_batch = msgspec.defstruct(
        "KVEventBatch", [("events", list[stored | removed | cleared])], bases=(batch,)
    )
    return kv_batch, stored, removed, cleared


async def test_publish_sequence_rank_and_map_encoding(zctx: Any, msgpack: Any) -> None:
    async with ZmqEventPublisher(
        ANY_PORT, topic="t", data_parallel_rank=3, event_encoding="map"
    ) as pub:
        sub = await subscriber(zctx, pub.endpoint, "t")
        stored = BlockStored([11, 12], 10, [1, 2, 3, 4], 2, "CPU", lora_id=7)
        seqs = [await pub.publish([stored]), await pub.publish([]), await pub.publish([stored])]
        assert seqs == [0, 1, 2]
        for seq in seqs:
            topic, seq_bytes, payload = await recv(sub)
            assert (topic, int.from_bytes(seq_bytes, "big")) == (b"t", seq)
            raw = msgpack.unpackb(payload)
            assert raw[2] == 3
            if seq != 1:
                assert raw[1] == [
                    {
                        "type": "BlockStored",
                        "block_hashes": [11, 12],
                        "parent_block_hash": 10,
                        "token_ids": [1, 2, 3, 4],
                        "block_size": 2,
                        "lora_id": 7,
                        "medium": "CPU",
                        "lora_name": None,
                    }
                ]
                assert decode_vllm_batch(msgpack, payload)[1] == [stored]
            else:
                assert raw[1] == []
        sub.close(linger=0)


@pytest.mark.parametrize("encoding", ["map", "array"])
async def test_replay_sends_missed_batches_then_end_marker(
    zctx: Any, msgpack: Any, encoding: EventEncoding
) -> None:
    """No subscriber saw anything; a DEALER (or REQ) asks the ROUTER from a start seq.

    ``map`` (the default) answers in vLLM's current framing, the topic before each seq and an
    empty topic frame before the end marker; ``array`` in the older one, without the topic.
    """
    import zmq

    publisher = ZmqEventPublisher(
        ANY_PORT, topic=TOPIC, replay_endpoint=ANY_PORT, buffer_steps=8, event_encoding=encoding
    )
    await publisher.start()
    payloads = []
    for i in range(10):  # buffer_steps=8: seqs 0 and 1 fall out of the buffer
        ev = BlockRemoved([i], "GPU")
        await publisher.publish([ev], ts=float(i))
        payloads.append(encode_batch([ev], float(i), encoding=encoding))
    assert publisher.replay_endpoint is not None
    dealer = zctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(publisher.replay_endpoint)
    topic = [TOPIC.encode()] if encoding == "map" else []
    end = [b"", END_SEQ, b""] if encoding == "map" else [END_SEQ, b""]
    try:
        for start, expected in ((5, [5, 6, 7, 8, 9]), (0, list(range(2, 10))), (42, [])):
            await dealer.send_multipart((b"", start.to_bytes(8, "big")))
            got = []
            while True:
                empty, *frames = await recv(dealer)
                assert empty == b""
                if frames == end:
                    break
                assert len(frames) == len(topic) + 2, frames
                assert frames[: len(topic)] == topic
                seq_bytes, payload = frames[len(topic) :]
                seq = int.from_bytes(seq_bytes, "big")
                assert payload == payloads[seq]
                assert decode_vllm_batch(msgpack, payload)[1] == [BlockRemoved([seq], "GPU")]
                got.append(seq)
            assert got == expected
        # a malformed request is ignored; the socket keeps serving
        await dealer.send_multipart((b"", b"x", b"y"))
        await dealer.send_multipart((b"", (9).to_bytes(8, "big")))
        assert int.from_bytes((await recv(dealer))[-2], "big") == 9
        assert (await recv(dealer))[1:] == end
    finally:
        dealer.close(linger=0)
        await publisher.aclose()


# ------------------------------------------------------------------ vLLM's current consumers


async def test_default_stream_decodes_with_current_vllm_structs(
    zctx: Any, engine: ManualCopyEngine
) -> None:
    """A vLLM consumer of today (msgspec, tagged-map events) decodes every default batch.

    It subscribes like vLLM's example subscriber, misses nothing it cannot replay, and asks
    the ROUTER for the batches again, reading replies as ``[topic, seq, payload]``.
    """
    require_events_deps()
    import msgspec
    import zmq

    from tests import vllm_kv_events_schema as vllm

    decoder = msgspec.msgpack.Decoder(type=vllm.KVEventBatch)
    async with ZmqEventPublisher(ANY_PORT, topic=TOPIC, replay_endpoint=ANY_PORT) as pub:
        sub = await subscriber(zctx, pub.endpoint)
        async with akv.HiCache(small_config(), copy_engine=engine) as cache:
            task = asyncio.create_task(pub.run(cache))
            r1 = insert(cache, [1, 2, 3, 4])
            await published(pub, 1)
            slots = cache.alloc(4)
            r2 = cache.insert([1, 2, 3, 4], slots, lora="adapter-a", tenant="acme")
            await published(pub, 2)
            engine.complete_all()
            await cache.flush()
            cache.release(r1)
            cache.release(r2)
        await asyncio.wait_for(task, RECV_TIMEOUT)

        live = []
        for seq in range(pub.next_seq):
            topic, seq_bytes, payload = await recv(sub)
            assert (topic, int.from_bytes(seq_bytes, "big")) == (TOPIC.encode(), seq)
            live.append(decoder.decode(payload))  # raises on an array-shaped event
        sub.close(linger=0)

        replay = zctx.socket(zmq.DEALER)
        replay.setsockopt(zmq.LINGER, 0)
        replay.connect(pub.replay_endpoint)
        await replay.send_multipart((b"", (0).to_bytes(8, "big")))
        replayed = []
        while True:
            _, topic, seq_bytes, payload = await recv(replay)  # what vLLM's subscriber reads
            if seq_bytes == vllm.END_SEQ:
                assert (topic, payload) == (b"", b"")
                break
            assert topic == TOPIC.encode()
            replayed.append(decoder.decode(payload))
        replay.close(linger=0)
    assert replayed == live

    assert all(batch.data_parallel_rank == 0 for batch in live)
    events = [ev for batch in live for ev in batch.events]
    stored = [ev for ev in events if isinstance(ev, vllm.BlockStored)]
    base, adapter = stored[0], stored[1]
    assert (base.medium, adapter.medium) == ("GPU", "GPU")
    assert base.lora_name is None and base.lora_id is None and base.extra_keys is None
    assert adapter.token_ids == base.token_ids == [1, 2, 3, 4]
    assert set(adapter.block_hashes).isdisjoint(base.block_hashes)
    assert adapter.lora_name == "adapter-a" and adapter.lora_id == lora_id_of("adapter-a")
    assert adapter.event_version == 1
    # one entry per block, the adapter on each; the tenant salt is not published by default
    assert adapter.extra_keys == [(vllm.LoRAKey(name="adapter-a"),)] * 2
    last = events[-1]  # at close: the host pages go (storage would stay)
    assert isinstance(last, vllm.BlockRemoved) and last.medium == "CPU"


async def test_legacy_array_option_decodes_with_pre_map_vllm_structs(
    zctx: Any, engine: ManualCopyEngine
) -> None:
    """``event_encoding="array"``: what vLLM's structs before #42892 decode, adapter included."""
    require_events_deps()
    import msgspec
    import zmq

    from tests.vllm_kv_events_schema import legacy

    decoder = msgspec.msgpack.Decoder(type=legacy.KVEventBatch)
    async with ZmqEventPublisher(
        ANY_PORT, topic=TOPIC, replay_endpoint=ANY_PORT, event_encoding="array"
    ) as pub:
        sub = await subscriber(zctx, pub.endpoint)
        async with akv.HiCache(small_config(), copy_engine=engine) as cache:
            task = asyncio.create_task(pub.run(cache))
            slots = cache.alloc(4)
            r = cache.insert([5, 6, 7, 8], slots, lora="adapter-b")
            await published(pub, 1)
            engine.complete_all()
            await cache.flush()
            cache.release(r)
        await asyncio.wait_for(task, RECV_TIMEOUT)
        batches = []
        for _ in range(pub.next_seq):
            batches.append(decoder.decode((await recv(sub))[2]))
        sub.close(linger=0)

        replay = zctx.socket(zmq.DEALER)
        replay.setsockopt(zmq.LINGER, 0)
        replay.connect(pub.replay_endpoint)
        await replay.send_multipart((b"", (0).to_bytes(8, "big")))
        replayed = []
        while True:
            _, seq_bytes, payload = await recv(replay)  # the older framing: no topic
            if seq_bytes == END_SEQ:
                assert payload == b""
                break
            replayed.append(decoder.decode(payload))
        replay.close(linger=0)
    assert replayed == batches
    first = batches[0].events[0]
    assert isinstance(first, legacy.BlockStored)
    assert (first.token_ids, first.medium, first.lora_name) == ([5, 6, 7, 8], "GPU", "adapter-b")
    assert first.lora_id == lora_id_of("adapter-b")
    assert batches[0].data_parallel_rank == 0


async def test_lora_namespace_block_stored_carries_adapter(engine: ManualCopyEngine) -> None:
    """The namespace's adapter (and tenant) reach ``BlockStored`` and vLLM's ``extra_keys``."""
    require_events_deps()
    import msgspec

    from tests import vllm_kv_events_schema as vllm

    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        slots = cache.alloc(6)
        r = cache.insert([1, 2, 3, 4, 5, 6], slots, lora="sql-lora", tenant="acme")
        engine.complete_all()
        await cache.flush()
        slots = cache.alloc(2)
        r2 = cache.insert([7, 8], slots)  # base model, no tenant
        events = cache.take_events()
        cache.release(r)
        cache.release(r2)
    stored = [e for e in events if isinstance(e, BlockStored)]
    gpu, cpu, base = stored
    assert (gpu.medium, cpu.medium, base.medium) == ("GPU", "CPU", "GPU")
    for ev in (gpu, cpu):
        assert ev.lora_name == "sql-lora" and ev.cache_salt == "acme"
        assert ev.lora_id == lora_id_of("sql-lora")
    assert (base.lora_name, base.lora_id, base.cache_salt) == (None, None, None)

    # the id: stable, positive, 63-bit; distinct adapters get distinct ids
    assert lora_id_of("sql-lora") == lora_id_of("sql-lora") and lora_id_of("") is None
    assert 0 < lora_id_of("sql-lora") < 2**63  # type: ignore[operator]
    assert lora_id_of("sql-lora") != lora_id_of("sql-lora2")

    decoder = msgspec.msgpack.Decoder(type=vllm.KVEventBatch)
    lora = vllm.LoRAKey(name="sql-lora")
    plain = decoder.decode(encode_batch([gpu], 1.0)).events[0]
    assert isinstance(plain, vllm.BlockStored)
    assert plain.lora_name == "sql-lora" and plain.extra_keys == [(lora,)] * 3
    salted = decoder.decode(encode_batch([gpu], 1.0, publish_cache_salt=True)).events[0]
    assert isinstance(salted, vllm.BlockStored)
    # vLLM: the adapter on every block, the salt on the first block of the sequence only
    assert salted.extra_keys == [(lora, vllm.CacheSaltKey(salt="acme")), (lora,), (lora,)]
    tail = BlockStored([7], gpu.block_hashes[-1], [7, 8], 2, "GPU", cache_salt="acme")
    assert decoder.decode(encode_batch([tail], 1.0, publish_cache_salt=True)).events[0] == (
        vllm.BlockStored([7], gpu.block_hashes[-1], [7, 8], 2, None, "GPU", None)
    )


async def test_close_ends_run_cleanly(zctx: Any, engine: ManualCopyEngine) -> None:
    pub = ZmqEventPublisher(ANY_PORT, replay_endpoint=ANY_PORT)
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        task = asyncio.create_task(pub.run(cache))  # starts the publisher
        r = insert(cache, [1, 2, 3, 4])
        await published(pub, 1)
        await asyncio.wait_for(pub.aclose(), RECV_TIMEOUT)
        await asyncio.wait_for(task, RECV_TIMEOUT)  # run() returned, nothing raised
        await pub.aclose()  # idempotent
        with pytest.raises(RuntimeError, match="closed"):
            await pub.publish([AllBlocksCleared()])
        with pytest.raises(RuntimeError, match="closed"):
            await pub.start()
        # events after the publisher closed stay in the cache's log
        engine.complete_all()
        await cache.flush()
        assert [type(e).__name__ for e in cache.take_events()] == ["BlockStored"]
        cache.release(r)


async def test_publish_before_start_raises(zmq_asyncio: Any) -> None:
    pub = ZmqEventPublisher(ANY_PORT)
    with pytest.raises(RuntimeError, match="not started"):
        await pub.publish([AllBlocksCleared()])
    await pub.aclose()


@pytest.mark.parametrize("module", ["zmq", "zmq.asyncio", "msgpack"])
def test_missing_dependency_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, module: str) -> None:
    import types

    for other in {"zmq", "zmq.asyncio", "msgpack"} - {module}:  # present (as stubs) or not
        monkeypatch.setitem(sys.modules, other, types.ModuleType(other))
    monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError
    with pytest.raises(MissingDependencyError, match=r"aiocache_kv\[events\]") as info:
        ZmqEventPublisher()
    assert isinstance(info.value, ImportError) and isinstance(info.value, akv.KVCacheError)
    assert ("pyzmq" if module.startswith("zmq") else "msgpack") in str(info.value)


@pytest.mark.parametrize(("ci", "outcome"), [("true", "fail"), ("", "skip")])
def test_missing_pyzmq_fails_under_ci_and_skips_locally(
    monkeypatch: pytest.MonkeyPatch, ci: str, outcome: str
) -> None:
    monkeypatch.setitem(sys.modules, "zmq.asyncio", None)
    monkeypatch.setenv("CI", ci)
    expected = pytest.fail.Exception if outcome == "fail" else pytest.skip.Exception
    with pytest.raises(expected, match="events extra"):
        require_events_deps()


def free_tcp_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


@pytest.fixture
def server_mod(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``examples/server.py`` as a module (loaded off the event loop)."""
    import importlib.util
    from pathlib import Path

    pytest.importorskip("aiohttp")
    path = Path(__file__).resolve().parents[1] / "examples" / "server.py"
    spec = importlib.util.spec_from_file_location("example_server_kv_events", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


async def test_example_server_publishes_with_kv_events_flag(
    zctx: Any, msgpack: Any, server_mod: Any
) -> None:
    """``examples/server.py --kv-events tcp://127.0.0.1:PORT``: a request's KV, then its
    removal from device and host at close."""
    aiohttp = pytest.importorskip("aiohttp")
    import msgspec
    from aiohttp import web

    from aiocache_kv.models import GPT2Spec
    from tests import vllm_kv_events_schema as vllm

    mod = server_mod
    endpoint = f"tcp://127.0.0.1:{free_tcp_port()}"
    parsed = mod.parse_args(["--kv-events", endpoint, "--storage", "none"])
    assert parsed.kv_events == endpoint and mod.parse_args([]).kv_events is None
    assert parsed.kv_events_encoding == "map"  # vLLM's current protocol unless asked
    legacy = mod.parse_args(["--kv-events", endpoint, "--kv-events-encoding", "array"])
    assert legacy.kv_events_encoding == "array"
    opts = mod.ServerOptions(
        port=0,
        model=GPT2Spec(n_layer=2, n_head=2, n_embd=32, vocab_size=256, n_positions=128, seed=1),
        page_size=8,
        device_pages=16,
        host_pages=32,
        storage="none",
        max_new_tokens=8,
        kv_events=endpoint,
    )
    runner = web.AppRunner(mod.make_app(opts))
    await runner.setup()  # builds the model, opens the cache, binds the publisher
    sub = await subscriber(zctx, endpoint)
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        async with aiohttp.ClientSession() as session:
            body = {"tokens": list(range(1, 21)), "max_new_tokens": 4}
            async with session.post(f"http://{host}:{port}/generate", json=body) as r:
                assert r.status == 200, await r.text()
            _, seq_bytes, payload = await recv(sub)
            assert int.from_bytes(seq_bytes, "big") == 0
            events = decode_vllm_batch(msgpack, payload)[1]
            assert isinstance(events[0], BlockStored) and events[0].medium == "GPU"
            batch = msgspec.msgpack.decode(payload, type=vllm.KVEventBatch)  # today's vLLM
            assert isinstance(batch.events[0], vllm.BlockStored)
            assert batch.events[0].token_ids == events[0].token_ids
            assert events[0].token_ids[:16] == list(range(1, 17))
            async with session.get(f"http://{host}:{port}/metrics") as r:
                text = await r.text()
            from prometheus_client.parser import text_string_to_metric_families

            stored = [
                s
                for fam in text_string_to_metric_families(text)
                for s in fam.samples
                if s.name == "aiocache_kv_events_total"
                and s.labels == {"type": "BlockStored", "medium": "GPU"}
            ]
            assert stored and stored[0].value > 0
    finally:
        await runner.cleanup()  # the cache closes before the publisher: its removals go out
        try:
            kinds: list[tuple[str, str | None]] = []
            while ("BlockRemoved", "CPU") not in kinds:
                kinds += [
                    (type(e).__name__, getattr(e, "medium", None))
                    for e in decode_vllm_batch(msgpack, (await recv(sub))[2])[1]
                ]
        finally:
            sub.close(linger=0)
