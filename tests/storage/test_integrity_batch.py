"""Batched seal/verify: same bytes and verdicts as the per-page path, per-page detection."""

from __future__ import annotations

import random
import struct
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aiocache_kv.errors import InvalidInputError
from aiocache_kv.storage import integrity
from aiocache_kv.storage.base import PageBuffer
from aiocache_kv.storage.integrity import (
    FRAME_OVERHEAD,
    Verdict,
    checksum,
    checksums,
    py_checksum,
    seal,
    seal_many,
    verify,
    verify_many,
)

BLOCK = 16384


def pool_slots(
    rows: int, slot: int, *, stride: int | None = None, offset: int = 0, seed: int = 0
) -> tuple[torch.Tensor, list[PageBuffer]]:
    """``rows`` slots of ``slot`` bytes, ``stride`` apart in one random tensor (a host pool)."""
    stride = stride if stride is not None else -(-slot // 64) * 64
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (offset + rows * stride,), dtype=torch.uint8, generator=g)
    bufs = [
        PageBuffer.from_tensor(raw[offset + r * stride : offset + r * stride + slot])
        for r in range(rows)
    ]
    return raw, bufs


def keys_for(n: int) -> list[str]:
    return [f"tag/{i:016x}/kv" for i in range(n)]


def per_page(bufs: list[PageBuffer], nbytes: int) -> list[tuple[int, int]]:
    """The reference: numpy/torch, one page at a time."""
    return [py_checksum(b.tensor[:nbytes]) for b in bufs]


@pytest.fixture(params=["c", "python"], autouse=True)
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test here runs on the C extension and on the numpy/torch path."""
    if request.param == "python":
        monkeypatch.setattr(integrity, "_EXT", None)
    elif integrity._EXT is None:
        pytest.skip("aiocache_kv.storage._blocksum not built (pip install -e . builds it)")
    return str(request.param)


def test_c_extension_is_the_one_in_use(impl: str) -> None:
    assert integrity.CHECKSUM_IMPL == "c"
    assert (integrity._EXT is None) == (impl == "python")


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 15, BLOCK - 1, BLOCK, BLOCK + 5, 3 * BLOCK + 13])
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_checksum_equals_the_reference_at_every_edge(n: int, offset: int) -> None:
    g = torch.Generator().manual_seed(n * 7 + offset)
    raw = torch.randint(0, 256, (n + offset + 8,), dtype=torch.uint8, generator=g)
    data = raw[offset : offset + n]
    assert checksum(data) == py_checksum(data)
    assert checksums([PageBuffer.from_tensor(raw[offset:])], n) == [py_checksum(data)]


@pytest.mark.parametrize(
    ("slot", "stride", "offset"),
    [
        (4 * BLOCK + FRAME_OVERHEAD, None, 0),  # a host pool: rows rounded up to 64 bytes
        (4 * BLOCK + FRAME_OVERHEAD, 4 * BLOCK + FRAME_OVERHEAD, 0),  # packed rows
        (BLOCK + 8 + FRAME_OVERHEAD, None, 0),  # a tail of one word after the blocks
        (3 * BLOCK + 5 + FRAME_OVERHEAD, None, 0),  # a tail that is not whole words
        (100, 104, 0),  # smaller than one block
        (4 * BLOCK + FRAME_OVERHEAD, None, 3),  # unaligned slots: the per-page fallback
    ],
)
def test_checksums_equal_per_page(slot: int, stride: int | None, offset: int) -> None:
    _, bufs = pool_slots(24, slot, stride=stride, offset=offset, seed=slot)
    n = slot - FRAME_OVERHEAD
    assert checksums(bufs, n) == per_page(bufs, n)


def test_checksums_any_row_selection() -> None:
    """Dense, sparse, unordered, duplicated and foreign rows all give the per-page sums."""
    _, bufs = pool_slots(64, 2 * BLOCK + FRAME_OVERHEAD, seed=7)
    _, other = pool_slots(4, 2 * BLOCK + FRAME_OVERHEAD, seed=8)  # another storage
    n = 2 * BLOCK
    rng = random.Random(0)
    for _ in range(40):
        pick = rng.sample(bufs, rng.randint(1, 64))
        if rng.random() < 0.3:
            pick += pick[:3]  # the same slot twice
        if rng.random() < 0.3:
            pick += other[: rng.randint(1, 4)]
        rng.shuffle(pick)
        assert checksums(pick, n) == per_page(pick, n)
    sparse = [bufs[i] for i in (0, 1, 2, 30, 31, 63)]  # runs, not one span
    assert checksums(sparse, n) == per_page(sparse, n)


def test_checksums_shorter_buffer_raises() -> None:
    with pytest.raises(InvalidInputError):
        checksums([PageBuffer.allocate(64)], 128)


def test_seal_many_writes_the_per_page_trailers() -> None:
    raw_a, batch = pool_slots(16, 4 * BLOCK + FRAME_OVERHEAD, seed=3)
    raw_b, single = pool_slots(16, 4 * BLOCK + FRAME_OVERHEAD, seed=3)
    keys = keys_for(16)
    seal_many(batch, keys)
    for buf, key in zip(single, keys, strict=True):
        seal(buf, key)
    assert torch.equal(raw_a, raw_b)
    assert verify_many(batch, keys) == [Verdict.OK] * 16


def test_seal_many_mixed_sizes_and_validation() -> None:
    _, small = pool_slots(3, 4096 + FRAME_OVERHEAD, seed=1)
    _, big = pool_slots(3, 2 * BLOCK + 7 + FRAME_OVERHEAD, seed=2)
    bufs = [small[0], big[0], small[1], big[1], small[2], big[2]]
    keys = keys_for(6)
    seal_many(bufs, keys)
    assert [verify(b, k) for b, k in zip(bufs, keys, strict=True)] == [Verdict.OK] * 6
    with pytest.raises(InvalidInputError):
        seal_many(bufs, keys[:-1])
    with pytest.raises(InvalidInputError):
        seal_many([PageBuffer.allocate(FRAME_OVERHEAD)], ["k"])
    with pytest.raises(InvalidInputError):
        verify_many(bufs, keys, [None])


def _damage(buf: PageBuffer, how: str) -> None:
    n = buf.nbytes - FRAME_OVERHEAD
    if how == "flip":
        buf.view[n // 2] ^= 0x10
    elif how == "magic":
        buf.view[n] ^= 0xFF
    elif how == "trailer":
        buf.view[n + 17] ^= 0x01
    elif how == "version":
        trailer = bytearray(buf.view[n:])
        struct.pack_into("<H", trailer, 4, integrity.FORMAT_VERSION + 1)
        struct.pack_into("<I", trailer, 68, zlib.crc32(bytes(trailer[:68])))
        buf.view[n:] = bytes(trailer)
    elif how == "swap":
        a = bytes(buf.view[0:BLOCK])
        buf.view[0:BLOCK] = buf.view[BLOCK : 2 * BLOCK]
        buf.view[BLOCK : 2 * BLOCK] = a


def test_verify_many_flags_each_damaged_page_only() -> None:
    _, bufs = pool_slots(12, 4 * BLOCK + FRAME_OVERHEAD, seed=5)
    keys = keys_for(12)
    seal_many(bufs, keys)
    _damage(bufs[1], "flip")
    _damage(bufs[3], "magic")
    _damage(bufs[4], "trailer")
    _damage(bufs[6], "version")
    _damage(bufs[8], "swap")
    check_keys = list(keys)
    check_keys[9] = "other/0000000000000009/kv"  # a valid page of another key
    sizes: list[int | None] = [None] * 12
    sizes[10] = bufs[10].nbytes - 1  # a short object
    got = verify_many(bufs, check_keys, sizes)
    assert got == [
        verify(b, k, s) for b, k, s in zip(bufs, check_keys, sizes, strict=True)
    ]  # the per-page path agrees
    assert got == [
        Verdict.OK,
        Verdict.BAD_CHECKSUM,
        Verdict.OK,
        Verdict.BAD_MAGIC,
        Verdict.BAD_TRAILER,
        Verdict.OK,
        Verdict.BAD_VERSION,
        Verdict.OK,
        Verdict.BAD_CHECKSUM,
        Verdict.BAD_KEY,
        Verdict.BAD_LENGTH,
        Verdict.OK,
    ]


@settings(max_examples=100, deadline=None)
@given(
    rows=st.integers(2, 12),
    page=st.sampled_from([64, 4096, BLOCK, 2 * BLOCK + 24, 3 * BLOCK + 3]),
    victim=st.integers(0, 1 << 20),
    pos=st.integers(0, 1 << 30),
    bit=st.integers(0, 7),
)
def test_any_single_bit_flip_in_a_batch_is_caught_for_that_page(
    rows: int, page: int, victim: int, pos: int, bit: int
) -> None:
    _, bufs = pool_slots(rows, page + FRAME_OVERHEAD, seed=page + rows)
    keys = keys_for(rows)
    seal_many(bufs, keys)
    v = victim % rows
    bufs[v].view[pos % bufs[v].nbytes] ^= 1 << bit
    got = verify_many(bufs, keys)
    assert got[v] is not Verdict.OK
    assert all(g is Verdict.OK for i, g in enumerate(got) if i != v)
