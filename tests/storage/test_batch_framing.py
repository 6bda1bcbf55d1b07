"""The batched framing in C (``_blocksum.seal`` / ``verify``) against its Python reference,
and the fast paths of the Mooncake backend and the executor's batched reads around it."""

from __future__ import annotations

import asyncio
import random
import struct
import threading
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import aiocache_kv as akv
from aiocache_kv.errors import InvalidInputError, StorageKeyError, StorageTimeoutError
from aiocache_kv.storage import integrity, prefetch_reads
from aiocache_kv.storage.base import PageBuffer
from aiocache_kv.storage.executor import BatchReports, StorageIO
from aiocache_kv.storage.integrity import (
    FRAME_OVERHEAD,
    Verdict,
    py_seal_many,
    py_verify_many,
    seal_many,
    verify_many,
)
from aiocache_kv.storage.key_layout import key_components
from aiocache_kv.storage.keys import MAX_KEY_LEN, storage_key
from aiocache_kv.storage.prefetch import PrefetchStatus
from aiocache_kv.testing.fake_mooncake import FakeMooncakeClient, FakeMooncakeStorage
from aiocache_kv.tree.hashing import chain_hashes
from tests.test_storage_tier import PROMPT, StallSecondBatch, _seed, cfg, stored_prompt

from .test_executor import ScriptedBackend, _batches

BLOCK = 16384
TRAILER = struct.Struct("<4sHHQQQ32sII")
T = FRAME_OVERHEAD
#: slot sizes: under one word, under one block, whole blocks, a word tail, a byte tail
SLOTS = [T + 1, T + 7, T + 8, T + 60, 4096 + T, BLOCK + T, 3 * BLOCK + 8 + T, 2 * BLOCK + 13 + T]
KEYS = ["t/" + "0" * 63 + "1/kv", "ns-é/ü", "k\udcff", "鍵/" + "x" * 30, "a"]


def idents(n: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(32) for _ in range(n)]


needs_c = pytest.mark.skipif(integrity._EXT is None, reason="_blocksum not built")


def slots(sizes: list[int], seed: int) -> list[PageBuffer]:
    g = torch.Generator().manual_seed(seed)
    return [
        PageBuffer.from_tensor(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g))
        for n in sizes
    ]


def twin(bufs: list[PageBuffer]) -> list[PageBuffer]:
    return [PageBuffer.from_tensor(b.tensor.clone()) for b in bufs]


def reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """Python only from here on: numpy/torch checksums, struct trailers."""
    monkeypatch.setattr(integrity, "_EXT", None)


@needs_c
def test_c_seal_writes_the_reference_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    sizes = SLOTS + SLOTS[::-1]
    keys = [KEYS[i % len(KEYS)] + str(i) for i in range(len(sizes))]
    ids = idents(len(sizes), seed=1)
    fast = slots(sizes, seed=1)
    ref = twin(fast)
    seal_many(fast, keys, ids)
    reference(monkeypatch)
    py_seal_many(ref, keys, ids)
    for a, b in zip(fast, ref, strict=True):
        assert bytes(a.view) == bytes(b.view)
    assert verify_many(fast, keys, identities=ids) == [Verdict.OK] * len(fast)  # by Python
    # the identity is bound: the same pages read for other tokens are not theirs
    assert verify_many(fast, keys, identities=ids[1:] + ids[:1]) == [Verdict.BAD_IDENTITY] * len(
        fast
    )
    assert verify_many(fast, keys) == [Verdict.BAD_IDENTITY] * len(fast)  # key-bound default


@needs_c
def test_c_seal_of_one_slot_twice_keeps_the_last_key() -> None:
    (buf,) = slots([BLOCK + T], seed=2)
    seal_many([buf, buf], ["first", "second"])
    assert integrity.verify(buf, "second") is Verdict.OK
    assert integrity.verify(buf, "first") is Verdict.BAD_KEY


def _frame(buf: PageBuffer, **fields: int | bytes) -> None:
    """Rewrite ``buf``'s trailer with ``fields`` changed and a *valid* trailer crc (so the
    checks after the trailer's own crc are reached)."""
    n = buf.nbytes - FRAME_OVERHEAD
    names = ("magic", "version", "algo", "length", "s1", "s2", "ident", "key_crc", "crc")
    values = dict(zip(names, TRAILER.unpack_from(buf.view, n), strict=True))
    values.update(fields)
    head = TRAILER.pack(*[values[k] for k in names])[:68]
    buf.view[n:] = head + struct.pack("<I", zlib.crc32(head))


KINDS = 13  # the ways _damaged treats a slot (0 and 10: intact)


def _damaged(
    seed: int,
) -> tuple[list[PageBuffer], list[str], list[int | None], list[bytes]]:
    """Sealed slots, most of them damaged one way or another, the sizes 'read' and the
    identities the reader expects."""
    sizes = [SLOTS[i % len(SLOTS)] for i in range(3 * len(SLOTS) + 2)]
    keys = [KEYS[i % len(KEYS)] + f"/{i}" for i in range(len(sizes))]
    ids = idents(len(sizes), seed)
    bufs = slots(sizes, seed=seed)
    py_seal_many(bufs, keys, ids)
    got: list[int | None] = [b.nbytes for b in bufs]
    rng = random.Random(seed)
    for i, buf in enumerate(bufs):
        n = buf.nbytes - FRAME_OVERHEAD
        kind = i % KINDS
        if kind == 1:
            buf.view[rng.randrange(n)] ^= 1 << rng.randrange(8)  # payload bit flip
        elif kind == 2:
            buf.view[n + rng.randrange(FRAME_OVERHEAD)] ^= 0x10  # trailer byte flip
        elif kind == 3:
            _frame(buf, magic=b"AKVQ")
        elif kind == 4:
            _frame(buf, version=1)  # the format before page identities
        elif kind == 5:
            _frame(buf, algo=7)
        elif kind == 6:
            _frame(buf, length=n - 8)  # a truncated page's length
        elif kind == 7:
            keys[i] += "-other"  # a valid page of another key
        elif kind == 8:
            _frame(buf, s2=0)  # a checksum that does not match
        elif kind == 9:
            got[i] = buf.nbytes - 1  # a short object
        elif kind == 10:
            got[i] = None  # "the slot size"
        elif kind == 11:
            got[i] = buf.nbytes + 8  # a longer object
        elif kind == 12:
            ids[i] = rng.randbytes(32)  # a valid page computed from other tokens
    return bufs, keys, got, ids


@needs_c
@pytest.mark.parametrize("seed", range(4))
def test_c_verify_gives_the_reference_verdicts(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    bufs, keys, got, ids = _damaged(seed)
    fast = verify_many(bufs, keys, got, ids)
    reference(monkeypatch)
    slow = py_verify_many(bufs, keys, got, ids)
    assert fast == slow
    assert fast == [
        integrity.verify(b, k, n, ident)
        for b, k, n, ident in zip(bufs, keys, got, ids, strict=True)
    ]
    assert set(fast) == set(Verdict)  # every verdict was reached
    assert [v is Verdict.OK for v in fast].count(True) == sum(
        1 for i in range(len(bufs)) if i % KINDS in (0, 10)
    )


@needs_c
@settings(max_examples=60, deadline=None)
@given(
    size=st.sampled_from(SLOTS),
    where=st.floats(0, 1, exclude_max=True),
    bit=st.integers(0, 7),
    key=st.text(min_size=1, max_size=40),
)
def test_any_flipped_bit_is_caught_the_same_way(
    size: int, where: float, bit: int, key: str
) -> None:
    (buf,) = slots([size], seed=size)
    ident = random.Random(size).randbytes(32)
    seal_many([buf], [key], [ident])
    assert verify_many([buf], [key], identities=[ident]) == [Verdict.OK]
    buf.view[int(where * size)] ^= 1 << bit
    fast = verify_many([buf], [key], identities=[ident])
    saved = integrity._EXT
    integrity._EXT = None
    try:
        slow = verify_many([buf], [key], identities=[ident])
    finally:
        integrity._EXT = saved
    assert fast == slow and fast != [Verdict.OK]


@needs_c
def test_c_calls_check_their_inputs() -> None:
    ext = integrity._EXT
    assert ext is not None
    (buf,) = slots([BLOCK + T], seed=3)
    i32 = [bytes(32)]
    with pytest.raises(ValueError, match="one key and one identity per buffer"):
        ext.seal([buf.view], [], i32)
    with pytest.raises(ValueError, match="one key and one identity per buffer"):
        ext.seal([buf.view], ["k"], [])
    with pytest.raises(TypeError):
        ext.seal([buf.view], [b"bytes"], i32)
    for bad in (bytes(31), bytes(33), bytearray(32), "x" * 32, None):
        with pytest.raises(ValueError, match="must be 32 bytes"):
            ext.seal([buf.view], ["k"], [bad])
        with pytest.raises(ValueError, match="must be 32 bytes"):
            ext.verify([buf.view], ["k"], [bad], [None])
    with pytest.raises(ValueError, match="no room"):
        ext.seal([memoryview(bytearray(T))], ["k"], i32)
    with pytest.raises(BufferError):
        ext.seal([bytes(100)], ["k"], i32)  # read-only: nothing to seal into
    with pytest.raises(ValueError, match="one key, one identity and one size"):
        ext.verify([buf.view], ["k"], i32, [])
    with pytest.raises(TypeError):
        ext.verify([buf.view], ["k"], i32, ["100"])
    assert ext.verify([memoryview(bytearray(T))], ["k"], i32, [None]) == [1]  # BAD_LENGTH
    assert ext.verify([buf.view], ["k"], i32, [1 << 80]) == [1]  # not the slot's size
    assert ext.verify([], [], [], []) == [] and ext.seal([], [], []) is None
    with pytest.raises(InvalidInputError, match="must be 32 bytes"):  # the Python entry too
        seal_many([buf], ["k"], [bytes(8)])
    with pytest.raises(InvalidInputError, match="1 keys but 2 identities"):
        verify_many([buf], ["k"], identities=[bytes(32)] * 2)


def test_check_batch_fast_path_rejects_what_check_keys_rejects() -> None:
    buf = PageBuffer.allocate(64 + FRAME_OVERHEAD)
    integrity.check_batch(["k" * (MAX_KEY_LEN // 4)], [buf])
    integrity.check_batch(["k" * MAX_KEY_LEN], [buf])  # long, still within the limit
    for bad in ("", "k" * (MAX_KEY_LEN + 1), "é" * (MAX_KEY_LEN // 2 + 1), 7):
        with pytest.raises(StorageKeyError):
            integrity.check_batch([bad], [buf])  # type: ignore[list-item]
    with pytest.raises(InvalidInputError):
        integrity.check_batch(["k"], [PageBuffer.allocate(FRAME_OVERHEAD)])
    with pytest.raises(InvalidInputError):
        integrity.check_batch(["k"], [bytearray(100)])  # type: ignore[list-item]
    with pytest.raises(InvalidInputError):
        integrity.check_batch(["k", "j"], [buf])


# ---------------------------------------------------------------------- Mooncake fast paths


def _pool(n: int, slot: int, seed: int) -> tuple[torch.Tensor, list[PageBuffer]]:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * slot,), dtype=torch.uint8, generator=g)
    return raw, [PageBuffer.from_tensor(raw[i * slot : (i + 1) * slot]) for i in range(n)]


def test_mooncake_all_good_batches_keep_exact_counters() -> None:
    slot = 4096 + FRAME_OVERHEAD
    s = FakeMooncakeStorage(FakeMooncakeClient())
    s.open()
    src, sbufs = _pool(6, slot, seed=4)
    dst, dbufs = _pool(6, slot, seed=5)
    s.register_buffer(src)
    s.register_buffer(dst)
    keys = [storage_key("t", (0x10 + i).to_bytes(32, "big")) for i in range(6)]
    assert s.put(keys, sbufs) == [True] * 6
    assert s.get_into(keys, dbufs) == [True] * 6
    assert torch.equal(src, dst)
    st_ = s.statistics()
    assert (st_.puts, st_.put_ok, st_.put_skipped, st_.bytes_written) == (6, 6, 0, 6 * slot)
    assert (st_.gets, st_.hits, st_.misses, st_.corrupt, st_.bytes_read) == (6, 6, 0, 0, 6 * slot)
    assert st_.unregistered_buffers == 0
    # a repeated key and a damaged page take the full path: same counters as before
    assert s.put([keys[0], keys[0]], [sbufs[0], sbufs[1]]) == [True, True]
    raw = bytearray(s.raw_client.objects[keys[2]])
    raw[5] ^= 1
    s.raw_client.objects[keys[2]] = bytes(raw)
    assert s.get_into(keys, dbufs) == [True, True, False, True, True, True]
    after = s.statistics()
    assert (after.put_ok - st_.put_ok, after.put_skipped - st_.put_skipped) == (1, 1)
    assert (after.hits - st_.hits, after.corrupt, after.removed) == (5, 1, 1)


def test_mooncake_counts_buffers_outside_registered_memory() -> None:
    slot = 256 + FRAME_OVERHEAD
    s = FakeMooncakeStorage(FakeMooncakeClient())
    s.open()
    pool, bufs = _pool(4, slot, seed=6)
    s.register_buffer(pool[: 2 * slot])  # the first two slots only
    keys = [storage_key("t", (0x20 + i).to_bytes(32, "big")) for i in range(4)]
    assert s.put(keys[:2], bufs[:2]) == [True] * 2
    assert s.statistics().unregistered_buffers == 0
    assert s.put(keys, bufs) == [True] * 4
    assert s.statistics().unregistered_buffers == 2


# ---------------------------------------------------------------------- executor reports


async def test_a_report_gap_still_reports_every_batch_in_order_on_the_loop() -> None:
    io = StorageIO(ScriptedBackend(), workers=1)
    loop_thread = threading.get_ident()
    seen: list[tuple[int, int]] = []
    await io.get_into_batches(
        _batches(6, 2), lambda i, res: seen.append((i, threading.get_ident())), report_gap=60.0
    )
    assert seen == [(i, loop_thread) for i in range(6)]
    await io.aclose()


class HeldSecondBatch(ScriptedBackend):
    """Batch 1 starts only once ``release`` is set (after batch 0 was reported)."""

    def __init__(self, block_at: int) -> None:
        super().__init__(block_at=block_at)
        self.release = threading.Event()

    def get_into(
        self,
        keys: Sequence[str],
        buffers: Sequence[PageBuffer],
        identities: Sequence[bytes] | None = None,
    ) -> list[bool]:
        if self.calls == 1:
            self.release.wait(10)
        return super().get_into(keys, buffers, identities)


async def _until(cond: Callable[[], bool]) -> None:
    for _ in range(1000):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition never held")


async def test_batches_waiting_for_a_wake_up_are_drained_at_the_deadline() -> None:
    """Batch 0 is reported at once; batch 1 lands while the gap holds its report back, then
    batch 2 stalls past the deadline: the caller (or the call's own end) drains batch 1."""
    backend = HeldSecondBatch(block_at=2)
    io = StorageIO(backend, workers=1)
    seen: list[int] = []
    reports = BatchReports(lambda i, res: seen.append(i))
    task = asyncio.ensure_future(
        io.get_into_batches(_batches(4, 2), reports, timeout=5.0, report_gap=60.0)
    )
    await _until(lambda: seen == [0])
    backend.release.set()
    await _until(lambda: backend.calls == 3)  # batch 1 landed, batch 2 stalls
    await asyncio.sleep(0.05)
    assert seen == [0]  # batch 1's wake-up is held back by the gap
    reports.drain()  # the caller's deadline
    assert seen == [0, 1]
    backend.gate.set()
    await task
    assert seen == [0, 1, 2, 3]
    await io.aclose()


async def test_a_timed_out_call_drains_what_landed() -> None:
    backend = HeldSecondBatch(block_at=2)
    backend.release.set()
    io = StorageIO(backend, workers=1)
    seen: list[int] = []
    with pytest.raises(StorageTimeoutError):
        await io.get_into_batches(
            _batches(4, 2), lambda i, res: seen.append(i), timeout=0.3, report_gap=60.0
        )
    assert seen == [0, 1]  # drained when the call timed out
    backend.gate.set()
    await io.drain()
    await io.aclose()


async def test_prefetch_commits_batches_whose_report_the_gap_held_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """8 pages, 2 a batch over 2 workers (A: pages 0-1 and 4-5, B: 2-3 and 6-7); B's second
    batch hangs past the deadline.  With a report gap longer than the whole wait, A's second
    batch is never announced to the loop, yet it landed in time: the prefetch drains it at
    its deadline and commits the leading run 0-5."""
    monkeypatch.setattr(prefetch_reads, "REPORT_GAP", 60.0)
    await stored_prompt(tmp_path)
    store = StallSecondBatch(tmp_path)
    opts = dict(
        storage=store,
        prefetch_policy="timeout",
        prefetch_timeout_base=0.5,
        prefetch_timeout_per_1k=0.0,
        prefetch_batch_pages=2,
    )
    async with akv.HiCache(cfg(tmp_path, **opts)) as cache:
        ns = cache._ns(None, None)
        hashes = chain_hashes(_seed(ns.tag), PROMPT, 2)
        store.stalled_key = storage_key(ns.tag, hashes[6], key_components(cache.config)[0])
        store.stall.clear()
        res = await cache.prefetch(PROMPT)
        assert res.status is PrefetchStatus.PARTIAL and res.hit_tokens == 12
        m = cache.match_prefix(PROMPT)
        assert (m.device_len, m.host_len) == (0, 12)
        cache.release(m)
        store.stall.set()
        await cache.flush()
        assert cache.statistics().host.quarantined_pages == 0
        cache.check_invariants()
