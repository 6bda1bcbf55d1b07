"""Byte layout of one embedding entry, in the pool and in the global store.

An entry is one contiguous slot::

    [ header (64 B) | data (num_tokens * dim * itemsize) | trailer (FRAME_OVERHEAD = 72 B) ]

The *payload* the storage backend checksums is ``header + data``; the trailer is the
:mod:`aiocache_kv.storage.integrity` frame written by the backend's ``put``.  The header makes an
object self-describing: a node that knows only the hash learns the object's size from the
store (one metadata RPC), reads it with one zero-copy get, and recovers ``(num_tokens, dim,
dtype)`` from the header, which the trailer's checksum covers.  64 bytes keep the data aligned
for every dtype (the pool allocator hands out 64-byte aligned extents).

Header, little-endian ``<4sHHQQQ`` then zero padding to 64 bytes::

    magic b"AKVE" | version u16 | dtype code u16 | num_tokens u64 | dim u64 | data_nbytes u64
"""

from __future__ import annotations

import dataclasses
import struct

import torch

from aiocache_kv.storage.integrity import FRAME_OVERHEAD

__all__ = [
    "DTYPE_CODES",
    "HEADER_BYTES",
    "MAGIC",
    "EntryShape",
    "pack_header",
    "slot_nbytes",
    "unpack_header",
]

MAGIC = b"AKVE"
VERSION = 1
HEADER_BYTES = 64
_HEADER = struct.Struct("<4sHHQQQ")
assert _HEADER.size <= HEADER_BYTES

#: stable codes (never reuse a number): the header must mean the same in every process
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
    torch.int8: 5,
    torch.uint8: 6,
    torch.int32: 7,
    torch.int64: 8,
}
_CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


@dataclasses.dataclass(frozen=True)
class EntryShape:
    """What an entry holds: ``num_tokens x dim`` elements of ``dtype``."""

    num_tokens: int
    dim: int
    dtype: torch.dtype

    @property
    def data_nbytes(self) -> int:
        """Bytes of the tensor data."""
        return self.num_tokens * self.dim * self.dtype.itemsize

    @property
    def payload_nbytes(self) -> int:
        """Header + data: what the integrity checksum covers."""
        return HEADER_BYTES + self.data_nbytes

    @property
    def slot_nbytes(self) -> int:
        """The whole stored object: header + data + integrity trailer."""
        return self.payload_nbytes + FRAME_OVERHEAD


def slot_nbytes(num_tokens: int, dim: int, dtype: torch.dtype) -> int:
    """Stored object size of a ``num_tokens x dim`` entry of ``dtype``."""
    return EntryShape(num_tokens, dim, dtype).slot_nbytes


def pack_header(shape: EntryShape) -> bytes:
    """The 64 header bytes of ``shape`` (``KeyError`` for a dtype without a code)."""
    head = _HEADER.pack(
        MAGIC, VERSION, DTYPE_CODES[shape.dtype], shape.num_tokens, shape.dim, shape.data_nbytes
    )
    return head + bytes(HEADER_BYTES - len(head))


def unpack_header(raw: bytes, object_nbytes: int) -> EntryShape | None:
    """Parse a header read back from the store; ``None`` unless it is well-formed and agrees
    with ``object_nbytes`` (the stored object's size)."""
    if len(raw) < HEADER_BYTES:
        return None
    magic, version, code, num_tokens, dim, data_nbytes = _HEADER.unpack_from(raw)
    dtype = _CODE_DTYPES.get(code)
    if magic != MAGIC or version != VERSION or dtype is None or num_tokens < 1 or dim < 1:
        return None
    shape = EntryShape(num_tokens, dim, dtype)
    if shape.data_nbytes != data_nbytes or shape.slot_nbytes != object_nbytes:
        return None
    return shape
