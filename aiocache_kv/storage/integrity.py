"""Page framing: a trailer with magic, version, length, identity, key binding and checksum.

Slot layout (what the host pool reserves per page)::

    [ payload (nbytes - FRAME_OVERHEAD) | trailer (FRAME_OVERHEAD = 72 bytes) ]

Trailer (format version 2), little-endian ``<4sHHQQQ32sII``::

    magic  b"AKVP" | version u16 | algorithm u16 | payload_len u64 | sum1 u64 | sum2 u64 |
    identity 32 bytes | key_crc u32 (crc32 of the UTF-8 key) |
    trailer_crc u32 (crc32 of the 68 bytes before it)

The trailer sits *after* the payload so that the whole slot is stored with one zero-copy call,
and a truncated object cannot present a valid trailer.  ``key_crc`` binds a page to its key, so
a valid page stored under another key (another namespace, a mixed-up file) is rejected too.

``identity`` binds a page to what it was computed from.  The cache passes the page's chained
BLAKE2b-256 hash (:mod:`aiocache_kv.tree.hashing`: the namespace and every token up to the end
of the page), and a read is a hit only if the stored identity equals the one the reader
computed from its own tokens (``BAD_IDENTITY`` otherwise: a miss, counted and published like a
corrupt page).  So a page is never served for another prompt's tokens, whatever its key: not
after a key collision, not when a store hands back another key's object.  A caller that passes
no identity (direct backend use) binds the page to the BLAKE2b-256 of its key instead
(:func:`key_identity`).  Version 1 pages (40-byte trailer, no identity) are misses.

Checksum choice (2 vCPU, 1 MiB pages, one thread): ``zlib.crc32`` 3.6 GB/s, ``adler32`` 3.0,
blake2b 0.8, a plain torch int64 sum 17-25 (one read pass: the ceiling), the block-Fletcher
below ~16 raw, 14-17 for a whole ``seal``/``verify``: ~12-14% of a 2 GB/s store (crc32 ~55%).
The checksum detects accidents; identity against forgery comes from the identity field (a
writer with access to the store itself can write anything, and is outside this guarantee).

The block-Fletcher views the payload as int64 words, sums each 16 KiB block (``s_b``) in one
vectorised pass, and stores ``S1 = sum(s_b)`` and ``S2 = sum((b + 1) * s_b)`` (both mod 2**64;
a tail that is not a multiple of 8 bytes is folded in as one extra word).  Any change of a
single word changes ``S1`` (so every single-bit flip is caught, provably); ``S2`` catches
blocks reordered or shifted.  Words swapped *inside* one 16 KiB block are not caught: it is an
accident detector (bit flips, truncation, torn or zeroed writes, stale pages via the length and
key fields), not a cryptographic MAC.

A page that fails any check is reported as a miss by the backends (never as data), counted in
``StorageStats.corrupt``, and logged once per batch with :func:`log_failures`.

Batches.  :func:`seal_many` / :func:`verify_many` sum a whole batch with a few numpy ops
(:func:`checksums`): rows of one host pool, equally spaced, through one strided int64 view
(``rows x blocks x 2048``); other slots by runs of equally spaced rows, unaligned ones by the
per-page :func:`checksum` (one thread, 64 KiB pages: per page ~3 GB/s, batches of 16 ~11 GB/s,
of 128 ~17-25 GB/s).  numpy, not torch: torch lets go of the GIL around each of its ~10 ops per
page, and a storage worker taking it back waits behind the loop and the other worker (in the
cache path: ~560 -> ~210 us per 16-page seal).  A put checks its batch once, then seals it
chunk by chunk with :func:`seal_checked`.

C.  Where the ``_blocksum`` extension is built (``pip install -e .`` with a C compiler;
:data:`CHECKSUM_IMPL` says), :func:`checksums` and :func:`checksum` are one C pass per page
with the GIL released for the whole batch: ~23 GB/s on 64 KiB pages in batches of 16 (numpy:
~12), the same ~24 GB/s on 4 MiB pages.  The numpy/torch code above is the reference the tests
hold it to, and what runs without the extension.  With the extension :func:`seal_many` and
:func:`verify_many` are one C call per batch that also packs / parses every trailer (no Python
per page: ~0.6 us a page less, and no GIL held per page by a storage worker);
:func:`py_seal_many` / :func:`py_verify_many` are their Python reference.  Fused passes: a
buffer's ``presum`` (taken by the copy that wrote it, :mod:`.presum`) and ``verify_many(sums=)``
(taken by the read, ``_pageio``) replace the checksum pass where they cover the payload.
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import math
import struct
import zlib
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from aiocache_kv.errors import InvalidInputError
from aiocache_kv.extensions import optional_extension
from aiocache_kv.logs import get_logger
from aiocache_kv.numeric import check_int
from aiocache_kv.storage.base import PageBuffer
from aiocache_kv.storage.keys import MAX_KEY_LEN, check_keys

__all__ = [
    "CHECKSUM_IMPL",
    "FORMAT_VERSION",
    "FRAME_OVERHEAD",
    "MAGIC",
    "Verdict",
    "check_batch",
    "checksum",
    "checksums",
    "key_identity",
    "log_failures",
    "payload_nbytes",
    "py_seal_many",
    "py_verify_many",
    "seal",
    "seal_checked",
    "seal_many",
    "verify",
    "verify_many",
]

MAGIC = b"AKVP"
FORMAT_VERSION = 2
ALGO_BLOCK_FLETCHER64 = 1
#: Bytes of a page identity (a chained page hash, :data:`aiocache_kv.tree.hashing.HASH_BYTES`).
IDENTITY_BYTES = 32
_TRAILER = struct.Struct("<4sHHQQQ32sII")
_HEAD = struct.Struct("<4sHHQQQ32sI")  # the trailer without its own crc
_CRC = struct.Struct("<I")
#: Bytes the host pool must reserve at the end of every page slot.
FRAME_OVERHEAD = _TRAILER.size
assert FRAME_OVERHEAD == 72, "trailer layout changed: FRAME_OVERHEAD is part of the contract"

BLOCK_WORDS = 2048  # 16 KiB blocks (512..8192 words measured: 2048+ is fastest)
_WEIGHTS = torch.arange(1, (1 << 16) + 1, dtype=torch.int64)  # block weights, up to 1 GiB
_NP_WEIGHTS = _WEIGHTS.numpy()
_MASK64 = (1 << 64) - 1
#: batches of at least this many bytes are reduced by torch (10-50% faster from 4 MiB on, one
#: thread, measured), smaller ones by numpy (fewer ops, ~20 us less per call, no GIL round trips)
_TORCH_MIN_BYTES = 2 << 20
#: a set of rows is summed through one strided view over its span if at least this share of the
#: span's rows are wanted (else: one view per run of consecutive rows)
_DENSE = 0.5
#: keys of at most this many chars cannot exceed MAX_KEY_LEN bytes of UTF-8 (4 bytes a char)
_SHORT_KEY = MAX_KEY_LEN // 4

log = get_logger(__name__)


_EXT = optional_extension("aiocache_kv.storage._blocksum")
#: ``"c"`` where the C extension computes the checksums, else ``"python"`` (numpy/torch)
CHECKSUM_IMPL = "python" if _EXT is None else "c"


class Verdict(enum.Enum):
    """Outcome of :func:`verify`."""

    OK = "ok"
    BAD_LENGTH = "bad_length"  # object size differs from the slot (truncated / wrong page size)
    BAD_MAGIC = "bad_magic"
    BAD_TRAILER = "bad_trailer"  # trailer's own crc fails
    BAD_VERSION = "bad_version"  # written by another format version / algorithm
    BAD_KEY = "bad_key"  # a valid page of another key
    BAD_CHECKSUM = "bad_checksum"
    BAD_IDENTITY = "bad_identity"  # a valid page computed from other tokens (another prefix)


def payload_nbytes(slot_nbytes: int) -> int:
    """Payload bytes of a slot of ``slot_nbytes``.

    Raises:
        InvalidInputError: the slot has no room for a payload and the trailer.
    """
    if slot_nbytes <= FRAME_OVERHEAD:
        raise InvalidInputError(
            f"page slot of {slot_nbytes} bytes has no room for the {FRAME_OVERHEAD}-byte trailer"
        )
    return slot_nbytes - FRAME_OVERHEAD


def check_batch(keys: Sequence[str], buffers: Sequence[PageBuffer]) -> None:
    """Validate a ``put``/``get_into`` batch before any I/O.

    Raises:
        StorageKeyError: a malformed key.
        InvalidInputError: ``len(keys) != len(buffers)``, a buffer is not a ``PageBuffer``, or a
            slot is not larger than :data:`FRAME_OVERHEAD`.
    """
    # fast path: plain str keys of at most MAX_KEY_LEN / 4 chars (UTF-8 <= 4 bytes a char)
    # cannot fail check_keys; anything else gets its full check
    if not all(type(k) is str and 0 < len(k) <= _SHORT_KEY for k in keys):
        check_keys(keys)
    if len(keys) != len(buffers):
        raise InvalidInputError(f"{len(keys)} keys but {len(buffers)} buffers")
    if all(type(b) is PageBuffer and b.nbytes > FRAME_OVERHEAD for b in buffers):
        return
    for buf in buffers:
        if not isinstance(buf, PageBuffer):
            raise InvalidInputError(f"expected PageBuffer, got {type(buf).__name__}")
        payload_nbytes(buf.nbytes)


def _key_crc(key: str) -> int:
    return zlib.crc32(key.encode("utf-8", "surrogatepass"))


def key_identity(key: str) -> bytes:
    """The identity a page put without one is bound to: the BLAKE2b-256 of its UTF-8 key."""
    return hashlib.blake2b(
        key.encode("utf-8", "surrogatepass"), digest_size=IDENTITY_BYTES
    ).digest()


def identities_for(keys: Sequence[str], identities: Sequence[bytes] | None) -> list[bytes]:
    """Per key: ``identities[i]``, or :func:`key_identity` of the key where none was given.

    Raises:
        InvalidInputError: ``identities`` differs from ``keys`` in length, or an identity is
            not ``bytes`` of :data:`IDENTITY_BYTES`.
    """
    if identities is None:
        return [key_identity(k) for k in keys]
    if len(identities) != len(keys):
        raise InvalidInputError(f"{len(keys)} keys but {len(identities)} identities")
    out = list(identities)
    for i, ident in enumerate(out):
        if type(ident) is not bytes or len(ident) != IDENTITY_BYTES:
            raise InvalidInputError(
                f"identities[{i}] must be {IDENTITY_BYTES} bytes, got {ident!r:.80}"
            )
    return out


def checksum(data: torch.Tensor) -> tuple[int, int]:
    """Block-Fletcher ``(S1, S2)`` of a contiguous 1-D ``uint8`` CPU tensor (see module doc)."""
    if _EXT is not None:
        pair: tuple[int, int] = _EXT.sums([data.numpy()], data.numel())[0]
        return pair
    return py_checksum(data)


def py_checksum(data: torch.Tensor) -> tuple[int, int]:
    """:func:`checksum` in numpy/torch (the reference the C extension is tested against)."""
    n = int(data.numel())
    nwords = n // 8
    s1 = 0
    s2 = 0
    if nwords:
        raw = data[: nwords * 8]
        if raw.data_ptr() % 8:
            raw = raw.clone()  # unaligned slot: rare, pay one copy
        words = raw.view(torch.int64)
        nblocks = nwords // BLOCK_WORDS
        if nblocks:
            rows = words[: nblocks * BLOCK_WORDS].view(nblocks, BLOCK_WORDS).sum(dim=1)
            weights = (
                _WEIGHTS[:nblocks]
                if nblocks <= _WEIGHTS.numel()
                else torch.arange(1, nblocks + 1, dtype=torch.int64)
            )
            s1 = int(rows.sum())
            s2 = int(torch.dot(rows, weights))
        if nwords % BLOCK_WORDS:
            tail = int(words[nblocks * BLOCK_WORDS :].sum())
            s1 += tail
            s2 += (nblocks + 1) * tail
    if n % 8:
        extra = int.from_bytes(data[nwords * 8 :].numpy().tobytes(), "little") + 1
        s1 += extra
        s2 += (nwords // BLOCK_WORDS + 2) * extra
    return s1 & _MASK64, s2 & _MASK64


class _Words:
    """``rows x nwords`` int64 words, rows ``stride`` bytes apart from ``ptr``, as a numpy
    array (``np.asarray(words)``).  The caller checks the bounds; ``owner`` (a tensor of the
    storage) keeps the memory alive as long as the array."""

    __slots__ = ("__array_interface__", "owner")

    def __init__(self, owner: torch.Tensor, ptr: int, rows: int, nwords: int, stride: int):
        self.owner = owner
        self.__array_interface__ = {
            "data": (ptr, False),  # (address, read-only flag): writable, so torch can view it
            "shape": (rows, nwords),
            "strides": (stride, 8),
            "typestr": "<i8",
            "version": 3,
        }


def _sum_rows(words: np.ndarray[Any, Any]) -> list[list[int]]:
    """``[S1, S2]`` (signed int64) of every row of a ``rows x nwords`` int64 array.

    numpy for the small ops: one batch is one heavy reduction (the GIL is released inside it)
    plus tiny ops that keep the GIL; torch would release and re-take the GIL around each of its
    ~10 ops, and a storage worker re-taking it waits behind the loop and the other worker.  The
    heavy reduction itself runs in torch from :data:`_TORCH_MIN_BYTES` on.
    Integer overflow wraps (mod 2**64), as the format wants.
    """
    rows, nwords = words.shape
    nblocks = nwords // BLOCK_WORDS
    body = nblocks * BLOCK_WORDS
    if nblocks:
        if rows * body * 8 >= _TORCH_MIN_BYTES:  # torch's reduction is faster on big batches
            view = torch.from_numpy(words[:, :body]).view(rows, nblocks, BLOCK_WORDS)
            blocks = view.sum(dim=2).numpy()
        else:
            blocks = words[:, :body].reshape(rows, nblocks, BLOCK_WORDS).sum(axis=2)
        s1 = blocks.sum(axis=1)
        s2 = (blocks * _np_weights(nblocks)).sum(axis=1)
    else:
        s1 = s2 = np.zeros(rows, dtype=np.int64)
    if nwords > body:
        tail = words[:, body:].sum(axis=1)
        s1 = s1 + tail
        s2 = s2 + (nblocks + 1) * tail
    out: list[list[int]] = np.stack((s1, s2), axis=1).tolist()
    return out


def _np_weights(nblocks: int) -> np.ndarray[Any, Any]:
    if nblocks <= _NP_WEIGHTS.size:
        return _NP_WEIGHTS[:nblocks]
    return np.arange(1, nblocks + 1, dtype=np.int64)


def _runs(ptrs: list[int]) -> list[tuple[int, int, int]]:
    """Cover sorted distinct ``ptrs`` with ``(first, stride, rows)`` arithmetic progressions:
    one over the whole span when it is dense enough, else maximal runs of equal steps."""
    if len(ptrs) == 1:
        return [(ptrs[0], 8, 1)]
    step = 0
    for a, b in itertools.pairwise(ptrs):
        step = math.gcd(step, b - a)
    span = (ptrs[-1] - ptrs[0]) // step + 1
    if len(ptrs) >= _DENSE * span:
        return [(ptrs[0], step, span)]
    runs: list[tuple[int, int, int]] = []
    i = 0
    while i < len(ptrs):
        if i + 1 == len(ptrs):
            runs.append((ptrs[i], 8, 1))
            break
        d = ptrs[i + 1] - ptrs[i]
        j = i + 1
        while j + 1 < len(ptrs) and ptrs[j + 1] - ptrs[j] == d:
            j += 1
        runs.append((ptrs[i], d, j - i + 1))
        i = j + 1
    return runs


def checksums(buffers: Sequence[PageBuffer], nbytes: int) -> list[tuple[int, int]]:
    """:func:`checksum` of the first ``nbytes`` of every buffer, batched (see module doc).

    Equal to ``[checksum(b.tensor[:nbytes]) for b in buffers]``.

    Raises:
        InvalidInputError: a buffer is shorter than ``nbytes``.
    """
    for b in buffers:
        if b.nbytes < nbytes:
            raise InvalidInputError(f"buffer of {b.nbytes} bytes is shorter than {nbytes}")
    if _EXT is not None:  # one pass per page at memory speed, without the GIL
        pairs: list[tuple[int, int]] = _EXT.sums([b.view for b in buffers], nbytes)
        return pairs
    out: list[tuple[int, int] | None] = [None] * len(buffers)
    nwords = nbytes // 8
    if nwords and len(buffers) > 1:
        order = sorted(
            (b.ptr, i) for i, b in enumerate(buffers) if b.ptr % 8 == 0
        )  # unaligned slots: per page below
        k = 0
        while k < len(order):
            owner = buffers[order[k][1]].tensor
            storage = owner.untyped_storage()
            base = int(storage.data_ptr())
            end = base + int(storage.nbytes())
            if base % 8:
                k += 1
                continue
            members: dict[int, list[int]] = {}  # ptr -> buffer indices (duplicates share)
            while k < len(order) and base <= order[k][0] and order[k][0] + nbytes <= end:
                members.setdefault(order[k][0], []).append(order[k][1])
                k += 1
            if not members:  # a buffer outside its own storage's range: cannot happen
                k += 1
                continue
            for first, stride, rows in _runs(list(members)):
                words = _Words(owner, first, rows, nwords, stride)
                sums = _sum_rows(np.asarray(words))
                for r, (s1, s2) in enumerate(sums):
                    for i in members.get(first + r * stride, ()):
                        out[i] = (s1 & _MASK64, s2 & _MASK64)
        if nbytes % 8:
            pos = nwords // BLOCK_WORDS + 2
            for i, b in enumerate(buffers):
                got = out[i]
                if got is not None:
                    extra = int.from_bytes(b.view[nwords * 8 : nbytes], "little") + 1
                    out[i] = ((got[0] + extra) & _MASK64, (got[1] + pos * extra) & _MASK64)
    return [
        got if got is not None else checksum(b.tensor[:nbytes])
        for got, b in zip(out, buffers, strict=True)
    ]


def _trailer(n: int, s1: int, s2: int, key: str, identity: bytes) -> bytes:
    head = _HEAD.pack(
        MAGIC, FORMAT_VERSION, ALGO_BLOCK_FLETCHER64, n, s1, s2, identity, _key_crc(key)
    )
    return head + _CRC.pack(zlib.crc32(head))


def seal(buffer: PageBuffer, key: str, identity: bytes | None = None) -> None:
    """Write the trailer for ``buffer``'s payload, ``key`` and ``identity`` (default:
    :func:`key_identity`) into the slot's last bytes.

    Raises:
        InvalidInputError: the slot is not larger than :data:`FRAME_OVERHEAD`, or
            ``identity`` is not ``bytes`` of :data:`IDENTITY_BYTES`.
    """
    n = payload_nbytes(buffer.nbytes)
    (ident,) = identities_for([key], None if identity is None else [identity])
    s1, s2 = checksum(buffer.tensor[:n])
    buffer.view[n:] = _trailer(n, s1, s2, key, ident)


def _by_size(buffers: Sequence[PageBuffer], idx: Sequence[int]) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for i in idx:
        groups.setdefault(buffers[i].nbytes, []).append(i)
    return groups


def seal_many(
    buffers: Sequence[PageBuffer],
    keys: Sequence[str],
    identities: Sequence[bytes] | None = None,
) -> None:
    """:func:`seal` every ``buffers[i]`` for ``keys[i]`` and ``identities[i]`` (default:
    :func:`key_identity` of each key), the checksums batched.

    Raises:
        InvalidInputError: lengths differ, a slot is not larger than :data:`FRAME_OVERHEAD`,
            or an identity is not ``bytes`` of :data:`IDENTITY_BYTES`.
    """
    if len(buffers) != len(keys):
        raise InvalidInputError(f"{len(keys)} keys but {len(buffers)} buffers")
    idents = identities_for(keys, identities)
    for b in buffers:
        payload_nbytes(b.nbytes)
    seal_checked(buffers, keys, idents)


def seal_checked(buffers: Sequence[PageBuffer], keys: Sequence[str], ids: Sequence[bytes]) -> None:
    """:func:`seal_many` of a batch :func:`check_batch` passed (``ids``: identities_for's)."""
    assert len(buffers) == len(keys) == len(ids), "seal_checked of unequal lists"
    if _EXT is not None:  # checksums and trailers in one C call, no Python per page
        _EXT.seal([b.view for b in buffers], keys, ids, [b.presum for b in buffers])
        return
    py_seal_many(buffers, keys, ids)


def py_seal_many(
    buffers: Sequence[PageBuffer], keys: Sequence[str], identities: Sequence[bytes]
) -> None:
    """:func:`seal_many` in Python (the reference of the C path; inputs already checked).

    A buffer whose ``presum`` covers its whole payload (the copy that wrote it took the sum,
    :mod:`.presum`) is sealed with that sum: only the trailer is written."""
    todo: list[int] = []
    for i, b in enumerate(buffers):
        n = b.nbytes - FRAME_OVERHEAD
        if b.presum is not None and int(b.presum[2]) == n:
            s1, s2 = int(b.presum[0]), int(b.presum[1])
            b.view[n:] = _trailer(n, s1, s2, keys[i], identities[i])
        else:
            todo.append(i)
    for size, idx in _by_size(buffers, todo).items():
        n = size - FRAME_OVERHEAD
        sums = checksums([buffers[i] for i in idx], n)
        for i, (s1, s2) in zip(idx, sums, strict=True):
            buffers[i].view[n:] = _trailer(n, s1, s2, keys[i], identities[i])


def _check_trailer(
    buffer: PageBuffer, key: str, identity: bytes, nbytes_read: int | None
) -> Verdict | tuple[int, int]:
    """Every check but the checksum: a failing :class:`Verdict`, or the stored ``(S1, S2)``."""
    if nbytes_read is None:
        nbytes_read = buffer.nbytes
    if nbytes_read != buffer.nbytes or buffer.nbytes <= FRAME_OVERHEAD:
        return Verdict.BAD_LENGTH
    n = buffer.nbytes - FRAME_OVERHEAD
    view = buffer.view
    magic, version, algo, length, s1, s2, ident, key_crc, trailer_crc = _TRAILER.unpack_from(
        view, n
    )
    if magic != MAGIC:
        return Verdict.BAD_MAGIC
    if zlib.crc32(view[n : n + _HEAD.size]) != trailer_crc:
        return Verdict.BAD_TRAILER
    if version != FORMAT_VERSION or algo != ALGO_BLOCK_FLETCHER64:
        return Verdict.BAD_VERSION
    if length != n:
        return Verdict.BAD_LENGTH
    if key_crc != _key_crc(key):
        return Verdict.BAD_KEY
    if ident != identity:
        return Verdict.BAD_IDENTITY
    return s1, s2


#: every check but the checksum (the deferred read, ``deferred.py``): a Verdict or ``(S1, S2)``
check_trailer = _check_trailer


def verify(
    buffer: PageBuffer, key: str, nbytes_read: int | None = None, identity: bytes | None = None
) -> Verdict:
    """Check the frame in ``buffer`` (``nbytes_read`` = object size, default: the slot size)
    against ``key`` and ``identity`` (default: :func:`key_identity`).

    Raises:
        InvalidInputError: ``identity`` is not ``bytes`` of :data:`IDENTITY_BYTES`.
    """
    (ident,) = identities_for([key], None if identity is None else [identity])
    stored = _check_trailer(buffer, key, ident, nbytes_read)
    if isinstance(stored, Verdict):
        return stored
    if checksum(buffer.tensor[: buffer.nbytes - FRAME_OVERHEAD]) != stored:
        return Verdict.BAD_CHECKSUM
    return Verdict.OK


def verify_many(
    buffers: Sequence[PageBuffer],
    keys: Sequence[str],
    nbytes_read: Sequence[int | None] | None = None,
    identities: Sequence[bytes] | None = None,
    sums: Sequence[Sequence[int] | None] | None = None,
) -> list[Verdict]:
    """:func:`verify` every ``buffers[i]`` against ``keys[i]`` and ``identities[i]`` (default:
    :func:`key_identity` of each key), the checksums batched.  ``sums[i]`` (optional):
    ``(S1, S2, bytes)`` the read that filled buffer ``i`` took of its payload as it arrived
    (``_pageio``): used instead of a second pass where ``bytes`` is the payload's length.

    Raises:
        InvalidInputError: lengths differ, a size is neither ``None`` nor an ``int``, or an
            identity is not ``bytes`` of :data:`IDENTITY_BYTES`.
    """
    if nbytes_read is None:
        nbytes_read = [None] * len(buffers)
    if not len(buffers) == len(keys) == len(nbytes_read):
        raise InvalidInputError(
            f"{len(keys)} keys, {len(buffers)} buffers, {len(nbytes_read)} sizes"
        )
    odd = [i for i, size in enumerate(nbytes_read) if size is not None and type(size) is not int]
    if odd:  # the C reads ints only; the reference alone would compare any number
        check_int(f"nbytes_read[{odd[0]}]", nbytes_read[odd[0]])
    idents = identities_for(keys, identities)
    if sums is not None and len(sums) != len(buffers):
        raise InvalidInputError(f"{len(buffers)} buffers but {len(sums)} sums")
    if _EXT is not None:  # every check of every page in one C call
        codes = _EXT.verify([b.view for b in buffers], keys, idents, nbytes_read, sums)
        return [_VERDICTS[c] for c in codes]
    return py_verify_many(buffers, keys, nbytes_read, idents, sums)


#: :func:`verify_many`'s C codes, in the order of ``_blocksum.c``'s enum
_VERDICTS = tuple(Verdict)  # OK, BAD_LENGTH, ... BAD_IDENTITY: the enum's order is the C's


def py_verify_many(
    buffers: Sequence[PageBuffer],
    keys: Sequence[str],
    nbytes_read: Sequence[int | None],
    identities: Sequence[bytes],
    sums: Sequence[Sequence[int] | None] | None = None,
) -> list[Verdict]:
    """:func:`verify_many` in Python (the reference of the C path; inputs already checked)."""
    verdicts: list[Verdict] = [Verdict.OK] * len(buffers)
    stored: dict[int, tuple[int, int]] = {}
    for i, (buf, key, got) in enumerate(zip(buffers, keys, nbytes_read, strict=True)):
        res = _check_trailer(buf, key, identities[i], got)
        given = None if sums is None else sums[i]
        if isinstance(res, Verdict):
            verdicts[i] = res
        elif given is not None and given[2] == buf.nbytes - FRAME_OVERHEAD:
            if (given[0], given[1]) != res:  # summed as it was read: no second pass
                verdicts[i] = Verdict.BAD_CHECKSUM
        else:
            stored[i] = res
    for size, idx in _by_size(buffers, list(stored)).items():
        sums = checksums([buffers[i] for i in idx], size - FRAME_OVERHEAD)
        for i, sum_ in zip(idx, sums, strict=True):
            if sum_ != stored[i]:
                verdicts[i] = Verdict.BAD_CHECKSUM
    return verdicts


def log_failures(backend: str, failures: Sequence[tuple[str, Verdict]]) -> None:
    """Log one warning for a batch's integrity failures (nothing if there are none)."""
    if not failures:
        return
    reasons = Counter(v.value for _, v in failures)
    log.warning(
        "storage.corrupt_pages",
        backend=backend,
        count=len(failures),
        reasons=dict(reasons),
        sample_keys=[k for k, _ in failures[:3]],
    )
