"""Mooncake prefetches verified at load-back, in the host->device copy (deferred verification).

A Mooncake get is the store's own copy into the host page; verifying it in the get's worker is a
second whole read of every byte, competing with the store's copies for memory bandwidth.  The
bytes are read once more anyway: by the host->device copy when the page is loaded back.  So a
prefetch from Mooncake (:attr:`~.mooncake.MooncakeStorage.defer_checksum`, set by the storage
tier of a cache without tensor parallelism) checks only the trailer in the get's worker
(magic, version, length, trailer crc, key binding, identity: :func:`verify_trailers`) and
leaves the trailer's ``(S1, S2, bytes)`` in the page's checksum row
(:attr:`~aiocache_kv.pools.kv_pool.HostKVPool.sums`); the loop marks the committed pages
``unverified`` (:attr:`~aiocache_kv.pools.kv_pool.HostKVPool.unverified`).

At load-back the copy's worker sums the unverified host pages it copies and compares with the
rows: on CPU in the copy itself (:func:`copy_to_device`, C: each 16 KiB block summed and then
scattered while in L1, like the backup's ``gather_sum`` the other way; without the extension,
:func:`first_bad` before a torch copy of the pages before the failure); on CUDA the waiter
thread after the copy's event (:func:`first_bad`: the pinned pages did not change, the device
pages are not yet anyone's).  It reports the first page that fails on the job.  The loop then
applies it (``transfer/ops.py``, ``Purger.drop_corrupt`` in ``purge.py``): the nodes before
the failed page become device-resident, the rest of the load fails back (device pages freed,
never read by a caller), the failed node is split at the page and marked ``corrupt`` (no match
extends through it), and the prefix from that page on is dropped from host and storage (the
key removed, ``BlockRemoved`` for HOST and STORAGE).  A page that verified is unmarked.

What else reads an unverified host page: a backup of it seals with the row, i.e. the trailer's
sum of the original bytes, so changed bytes would be stored as a page that fails every read
(never sealed as valid); host pins and warm-up only hold or load it (load-back verifies).  The
embedding cache and FileStorage keep verifying at read time (FileStorage's read sums each piece
as it lands).  With tensor parallelism the old path stays: ranks would have to agree on which
load-back pages failed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from aiocache_kv.extensions import optional_extension
from aiocache_kv.priority import idle_relief_ns
from aiocache_kv.storage import integrity
from aiocache_kv.storage.base import PageBuffer
from aiocache_kv.storage.integrity import FRAME_OVERHEAD, Verdict
from aiocache_kv.storage.presum import layout_fits, sum_slots

__all__ = ["copy_to_device", "first_bad", "first_mismatch", "verify_trailers"]

_EXT = optional_extension("aiocache_kv.storage._blocksum")
_VERDICTS = tuple(Verdict)  # the C's codes, in the enum's order (see integrity.verify_many)


def verify_trailers(
    buffers: Sequence[PageBuffer],
    keys: Sequence[str],
    nbytes_read: Sequence[int | None],
    identities: Sequence[bytes],
) -> list[Verdict]:
    """Check every page's trailer only, and record its ``(S1, S2, bytes)`` in the page's
    checksum row (``presum``) for the load-back to compare with.  A buffer without a row is
    verified in full (:func:`.integrity.verify_many`).  Runs in the get's worker on pages it
    holds under lease (the rows are the pages' own, like the bytes).

    Raises:
        InvalidInputError: lengths differ, or an identity is not ``bytes`` of 32.
    """
    rows = [b.presum for b in buffers]
    if _EXT is not None and all(r is not None for r in rows):  # one C call, no Python a page
        codes = _EXT.verify([b.view for b in buffers], keys, identities, nbytes_read, None, rows)
        return [_VERDICTS[c] for c in codes]
    full = [i for i, b in enumerate(buffers) if b.presum is None]
    verdicts = [Verdict.OK] * len(buffers)
    if full:
        checked = integrity.verify_many(
            [buffers[i] for i in full],
            [keys[i] for i in full],
            [nbytes_read[i] for i in full],
            [identities[i] for i in full],
        )
        for i, v in zip(full, checked, strict=True):
            verdicts[i] = v
    for i, buf in enumerate(buffers):
        row = buf.presum
        if row is None:
            continue
        res = integrity.check_trailer(buf, keys[i], identities[i], nbytes_read[i])
        if isinstance(res, Verdict):
            row[2] = 0
            verdicts[i] = res
        else:
            row[0], row[1], row[2] = res[0], res[1], buf.nbytes - FRAME_OVERHEAD
    return verdicts


def _fits(device: torch.Tensor, raw: torch.Tensor, page_bytes: int) -> bool:
    """Whether :func:`copy_to_device` can copy between these two layouts in C."""
    return (
        _EXT is not None and hasattr(_EXT, "scatter_check") and layout_fits(device, raw, page_bytes)
    )


def copy_to_device(
    raw: torch.Tensor,
    page_bytes: int,
    device: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    expect: np.ndarray[Any, Any] | None,
) -> int | None:
    """Copy host slots ``src`` (``raw``: ``[pages, slot_bytes]`` uint8, the payload first) into
    device pages ``dst`` (``device``: ``[layers, 2, pages, elems]`` on the CPU), checking each
    page whose ``expect`` row (``(S1, S2, bytes)``, by position; ``bytes`` 0: not to check) is
    set, block by block in the same pass (``_blocksum.scatter_check``; ``expect`` ``None``: a
    plain copy).  Returns the position of the first page that failed (it and what follows may
    be partly copied: their device pages must be freed unread) or -1; ``None``: nothing was
    done (no C extension, or layouts it does not take).

    Raises:
        IndexError: a page id out of range (nothing was copied).
    """
    if not _fits(device, raw, page_bytes):
        return None
    assert _EXT is not None
    layers, two, pages, elems = device.shape
    seg = elems * device.element_size()
    bad: int = _EXT.scatter_check(
        raw.numpy(),
        raw.shape[1],
        np.ascontiguousarray(src.numpy(), dtype=np.int64),
        device.view(torch.uint8).numpy(),
        seg,
        layers * two,
        pages * seg,
        np.ascontiguousarray(dst.numpy(), dtype=np.int64),
        None if expect is None else np.ascontiguousarray(expect, dtype=np.uint64),
        torch.get_num_threads(),  # the copy worker's setting (``copy_threads``)
        idle_relief_ns(),  # and its idle helpers (aiocache_kv.priority)
    )
    return bad


def first_bad(
    raw: torch.Tensor,
    page_bytes: int,
    pages: np.ndarray[Any, Any],
    expect: np.ndarray[Any, Any],
) -> int:
    """The position of the first of host slots ``pages`` whose payload's sum differs from its
    row in ``expect`` (``(S1, S2, bytes)``; ``bytes`` 0: not to check), or -1 (all intact).
    On the copy's worker (or a CUDA copy's waiter thread)."""
    check = np.flatnonzero(expect[:, 2] != 0)
    if check.size == 0:
        return -1
    got = np.zeros((len(pages), 2), dtype=np.uint64)
    sub = np.ascontiguousarray(pages[check], dtype=np.int64)
    table = np.empty((int(sub.max()) + 1, 3), dtype=np.uint64)  # only its rows `sub` are read
    sum_slots(raw, page_bytes, sub, table)
    got[check] = table[sub, :2]
    return first_mismatch(got, page_bytes, expect)


def first_mismatch(got: np.ndarray[Any, Any], page_bytes: int, expect: np.ndarray[Any, Any]) -> int:
    """The first position whose ``(S1, S2)`` in ``got`` (``[pages, 2]``, 64-bit) differs from
    its checked row in ``expect`` (``bytes`` 0: not checked; any other ``bytes`` than
    ``page_bytes`` fails), or -1."""
    check = np.flatnonzero(expect[:, 2] != 0)
    sums = got.view(np.uint64)[check]
    bad = np.flatnonzero(
        (expect[check, 2] != page_bytes)
        | (sums[:, 0] != expect[check, 0])
        | (sums[:, 1] != expect[check, 1])
    )
    return -1 if bad.size == 0 else int(check[bad[0]])
