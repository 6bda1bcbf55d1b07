"""Page framing: every damaged page is detected, nothing else is."""

from __future__ import annotations

import struct
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aiocache_kv.errors import InvalidInputError
from aiocache_kv.storage import integrity
from aiocache_kv.storage.base import PageBuffer
from aiocache_kv.storage.integrity import FRAME_OVERHEAD, Verdict, seal, verify
from aiocache_kv.testing import capture_logs

KEY = "tag/00000000000000ab/kv"


def sealed(nbytes: int, key: str = KEY, seed: int = 0) -> PageBuffer:
    g = torch.Generator().manual_seed(seed)
    buf = PageBuffer.from_tensor(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g))
    seal(buf, key)
    return buf


def test_overhead_and_layout() -> None:
    assert FRAME_OVERHEAD == 72
    buf = sealed(4096 + FRAME_OVERHEAD)
    trailer = bytes(buf.view[4096:])
    assert trailer[:4] == b"AKVP"
    assert struct.unpack_from("<H", trailer, 4)[0] == integrity.FORMAT_VERSION == 2
    assert struct.unpack_from("<Q", trailer, 8)[0] == 4096  # payload length
    assert trailer[32:64] == integrity.key_identity(KEY)  # no identity given: the key's
    ident = bytes(range(32))
    seal(buf, KEY, ident)
    assert bytes(buf.view[4096 + 32 : 4096 + 64]) == ident
    assert verify(buf, KEY, identity=ident) is Verdict.OK
    assert verify(buf, KEY, identity=bytes(32)) is Verdict.BAD_IDENTITY
    assert verify(buf, KEY) is Verdict.BAD_IDENTITY
    assert integrity.payload_nbytes(100) == 100 - FRAME_OVERHEAD
    with pytest.raises(InvalidInputError):
        integrity.payload_nbytes(FRAME_OVERHEAD)


@pytest.mark.parametrize(
    "nbytes",
    [FRAME_OVERHEAD + 1, FRAME_OVERHEAD + 8, 4128, 4129, 4096 * 7 + 5, (1 << 20) + 32],
)
def test_round_trip_sizes(nbytes: int) -> None:
    assert verify(sealed(nbytes), KEY) is Verdict.OK


def test_unaligned_slot() -> None:
    base = torch.randint(0, 256, (8192,), dtype=torch.uint8)
    buf = PageBuffer.from_tensor(base[3 : 3 + 5000])
    seal(buf, KEY)
    assert verify(buf, KEY) is Verdict.OK
    buf.view[10] ^= 0xFF
    assert verify(buf, KEY) is Verdict.BAD_CHECKSUM


def test_payload_flip_is_detected() -> None:
    buf = sealed(8192 + FRAME_OVERHEAD)
    buf.view[5000] ^= 0x01
    assert verify(buf, KEY) is Verdict.BAD_CHECKSUM


def test_block_swap_is_detected() -> None:
    block = 16384
    buf = sealed(4 * block + FRAME_OVERHEAD)
    a = bytes(buf.view[0:block])
    buf.view[0:block] = buf.view[block : 2 * block]
    buf.view[block : 2 * block] = a
    assert verify(buf, KEY) is Verdict.BAD_CHECKSUM


def test_trailer_damage_is_detected() -> None:
    n = 4096
    buf = sealed(n + FRAME_OVERHEAD)
    buf.view[n] ^= 0xFF
    assert verify(buf, KEY) is Verdict.BAD_MAGIC
    buf = sealed(n + FRAME_OVERHEAD)
    buf.view[n + 17] ^= 0x01  # inside the sum1 field
    assert verify(buf, KEY) is Verdict.BAD_TRAILER


def test_other_version_is_rejected() -> None:
    n = 4096
    buf = sealed(n + FRAME_OVERHEAD)
    trailer = bytearray(buf.view[n:])
    struct.pack_into("<H", trailer, 4, integrity.FORMAT_VERSION + 1)
    struct.pack_into("<I", trailer, 68, zlib.crc32(bytes(trailer[:68])))
    buf.view[n:] = bytes(trailer)
    assert verify(buf, KEY) is Verdict.BAD_VERSION


def test_page_of_another_key_is_rejected() -> None:
    h = "0" * 62 + "ab"
    buf = sealed(4096 + FRAME_OVERHEAD, key=f"tagA/{h}/kv")
    ident = integrity.key_identity(f"tagA/{h}/kv")
    assert verify(buf, f"tagB/{h}/kv", identity=ident) is Verdict.BAD_KEY


def test_wrong_length_is_rejected() -> None:
    buf = sealed(4096 + FRAME_OVERHEAD)
    assert verify(buf, KEY, nbytes_read=4096) is Verdict.BAD_LENGTH
    # A smaller page copied into a bigger slot: its trailer is not at the slot's end.
    big = PageBuffer.allocate(8192 + FRAME_OVERHEAD)
    big.view[: buf.nbytes] = buf.view
    assert verify(big, KEY) is not Verdict.OK


@settings(max_examples=200, deadline=None)
@given(
    nbytes=st.integers(FRAME_OVERHEAD + 1, 20000),
    pos=st.integers(0, 1 << 30),
    bit=st.integers(0, 7),
)
def test_any_single_bit_flip_is_detected(nbytes: int, pos: int, bit: int) -> None:
    buf = sealed(nbytes)
    buf.view[pos % nbytes] ^= 1 << bit
    assert verify(buf, KEY) is not Verdict.OK


def test_failures_are_logged_once_per_batch() -> None:
    with capture_logs() as logs:
        integrity.log_failures("file", [])
        integrity.log_failures(
            "file",
            [(f"k{i}", Verdict.BAD_CHECKSUM) for i in range(5)] + [("x", Verdict.BAD_LENGTH)],
        )
    assert len(logs) == 1
    assert logs[0]["event"] == "storage.corrupt_pages"
    assert logs[0]["count"] == 6
    assert logs[0]["reasons"] == {"bad_checksum": 5, "bad_length": 1}
