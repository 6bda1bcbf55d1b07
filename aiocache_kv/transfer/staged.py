"""CUDA page copies between the device layout and host *slots*, staged in device memory.

A host pool whose slots carry a storage trailer (``[payload | trailer]``, :mod:`..pools`) is
not one contiguous block of payloads, and torch copies such a strided host tensor through a
temporary in *pageable* host memory on the calling thread: a device->host copy then waits
for the copy stream (and the compute stream it waits on) and a host->device copy gathers on
the CPU, both on the event loop's thread.  So a CUDA copy moves whole slots instead, which
are contiguous rows of the pool: each run of consecutive slots is one asynchronous DMA
between pinned memory and a device staging block of ``[pages, slot_bytes]``, and the
permutation into (or out of) the device layout is a device-side copy (one gather or
scatter when the device pages are scattered).  The call only enqueues work on the current
stream.

The staging block is also where the integrity pass is cheapest: with ``sums``, each
payload's block-Fletcher checksum is computed on the device from the staging block
(:func:`~aiocache_kv.storage.presum.row_sums`, one read of device memory, three kernels)
into a small device tensor that the copy's waiter reads after the event, so no CPU pass
reads the bytes and the loop allocates no pinned memory.  A
device->host copy zeroes the staging block's bytes after the payload, so the trailer space
of a fresh host slot holds zeros, never stale device memory.

A job is staged in chunks of at most :data:`STAGE_BYTES`: the caching allocator reuses a
chunk's block for the next one in stream order, so a large job holds a bounded amount of
device memory.
"""

from __future__ import annotations

import itertools
from collections import deque

import numpy as np
import torch

from aiocache_kv.storage.integrity import FRAME_OVERHEAD
from aiocache_kv.storage.presum import row_sums

__all__ = [
    "MAX_GAP",
    "MAX_RUNS",
    "STAGE_BYTES",
    "id_runs",
    "slot_rows",
    "stage_to_device",
    "stage_to_host",
]

#: the most device memory one chunk of a staged copy holds
STAGE_BYTES = 64 << 20
#: runs of consecutive pages above which a device-side copy is one gather or scatter
MAX_RUNS = 8
#: the most bytes after a payload in a slot :func:`slot_rows` takes (a pool's trailer space:
#: ``FRAME_OVERHEAD`` rounded up to 64, :func:`~aiocache_kv.pools.kv_pool.host_slot_bytes`)
MAX_GAP = FRAME_OVERHEAD + 63


Runs = list[tuple[int, int, int]]


def slot_rows(host: torch.Tensor) -> torch.Tensor | None:
    """The slots of a host pool as uint8 rows ``[pages, slot_bytes]`` over the same memory,
    given its page-first payload view ``host`` (``raw[:, :payload].view(...)``: each page
    contiguous, the whole buffer from its start, at most a framing trailer rounded up to 64
    bytes after each payload), or None if ``host`` is laid out otherwise: the copy then goes
    page run by page run, as torch takes it.  (A device->host copy writes whole slots, so a
    view whose gaps hold other data must never pass.)"""
    if host.dim() < 2 or host.shape[0] == 0 or not host[0].is_contiguous():
        return None
    size = host.element_size()
    row = host.stride(0) * size
    if not 0 <= row - host[0].numel() * size <= MAX_GAP:
        return None
    storage = host.untyped_storage()
    if host.storage_offset() != 0 or storage.nbytes() != host.shape[0] * row:
        return None
    rows = torch.empty(0, dtype=torch.uint8, device=host.device)
    return rows.set_(storage, 0, (host.shape[0], row), (row, 1))


def _chunks(n: int, row: int) -> list[tuple[int, int]]:
    """``[start, end)`` positions of ``n`` slots of ``row`` bytes cut into chunks of at most
    STAGE_BYTES."""
    per = max(1, STAGE_BYTES // row)
    return [(a, min(n, a + per)) for a in range(0, n, per)]


def _typed(stage: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The payloads of ``stage``'s slots as pages shaped and typed like ``like``'s."""
    nbytes = like[0].numel() * like.element_size()
    return stage[:, :nbytes].view(like.dtype).view(stage.shape[0], *like.shape[1:])


def id_runs(ids: torch.Tensor) -> Runs:
    """``ids`` (1-D, CPU) as runs of consecutive ids: ``(position, first id, length)``."""
    v = ids.numpy()
    if v.size == 0:
        return []
    cuts = np.flatnonzero(np.diff(v) != 1) + 1
    starts = np.concatenate(([0], cuts))
    ends = np.concatenate((cuts, [v.size]))
    return [(int(a), int(v[a]), int(b - a)) for a, b in zip(starts, ends, strict=True)]


class PinnedIds:
    """Page ids on their way to a CUDA device, through one pinned ring buffer (a copy
    engine's; used on the loop thread only).

    A copy from pageable memory holds the calling thread until the stream reaches it (behind
    the compute stream); pinning each id tensor anew costs a pinned allocation per copy
    (~0.5 ms of the loop's time measured on an H200 machine, the allocator's blocks still
    being read by copies in flight).  A region of the ring is written again only once the
    event recorded after its copy completed; if every region is still being read, the ids
    are pinned anew.
    """

    def __init__(self, size: int = 1 << 16) -> None:
        self.size = size
        self._buf: torch.Tensor | None = None  # allocated on first use
        self._pos = 0
        self._pending: deque[tuple[int, int, torch.cuda.Event]] = deque()

    def to_device(self, ids: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``ids`` (1-D int64, CPU) copied to ``device`` on the current stream, enqueued."""
        n = ids.numel()
        while self._pending and self._pending[0][2].query():  # type: ignore[no-untyped-call]
            self._pending.popleft()
        start = self._pos if self._pos + n <= self.size else 0
        end = start + n
        if n > self.size or any(s < end and start < e for s, e, _ in self._pending):
            return ids.pin_memory().to(device, non_blocking=True)
        if self._buf is None:
            self._buf = torch.empty(self.size, dtype=torch.int64, pin_memory=True)
        region = self._buf[start:end]
        region.copy_(ids)
        out = region.to(device, non_blocking=True)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
        self._pending.append((start, end, event))
        self._pos = end
        return out

    def check_invariants(self) -> None:
        """Pending regions lie inside the ring and do not overlap.

        Raises:
            AssertionError: one does.
        """
        spans = sorted((s, e) for s, e, _ in self._pending)
        for s, e in spans:
            assert 0 <= s < e <= self.size, f"pending region [{s}, {e}) outside {self.size}"
        for (_, e1), (s2, _) in itertools.pairwise(spans):
            assert e1 <= s2, f"pending regions overlap: {spans}"


def _on_device(ids: torch.Tensor, like: torch.Tensor, ring: PinnedIds | None) -> torch.Tensor:
    """``ids`` on ``like``'s device (from pinned memory: see :class:`PinnedIds`)."""
    if like.device.type != "cuda":
        return ids
    if ring is None:
        return ids.pin_memory().to(like.device, non_blocking=True)
    return ring.to_device(ids, like.device)


def _gather(
    device: torch.Tensor, out: torch.Tensor, src: torch.Tensor, ring: PinnedIds | None
) -> None:
    """``out[i] = device[src[i]]`` on the device: a copy per run of consecutive pages, or
    one gather when the pages are scattered (a launch per page would cost the loop more
    than the copy)."""
    runs = id_runs(src)
    if len(runs) > MAX_RUNS:
        out.copy_(device.index_select(0, _on_device(src, device, ring)))
        return
    for i, s, r in runs:
        out[i : i + r].copy_(device[s : s + r])


def _scatter(
    pages: torch.Tensor, device: torch.Tensor, dst: torch.Tensor, ring: PinnedIds | None
) -> None:
    """``device[dst[i]] = pages[i]`` on the device (per run, or one scatter: as
    :func:`_gather`)."""
    runs = id_runs(dst)
    if len(runs) > MAX_RUNS:
        device.index_copy_(0, _on_device(dst, device, ring), pages)
        return
    for i, d, r in runs:
        device[d : d + r].copy_(pages[i : i + r])


def stage_to_host(
    device: torch.Tensor,
    host: torch.Tensor,
    rows: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    *,
    sums: bool = False,
    ring: PinnedIds | None = None,
) -> list[torch.Tensor]:
    """Enqueue the copy of device pages ``src`` into host slots ``dst``.

    ``device`` and ``host`` are page-first views (``device[p]`` is page ``p``, any strides;
    ``host`` as :func:`slot_rows` takes it, ``rows`` its slots).  With ``sums``, returns
    each copied payload's ``(S1, S2)`` in ``src`` order, as int64 tensors on the device (one
    per chunk; read them once the copy's event completed), else ``[]``.
    """
    nbytes = host[0].numel() * host.element_size()
    row = rows.shape[1]
    out = []
    for a, b in _chunks(src.numel(), row):
        stage = torch.empty((b - a, row), dtype=torch.uint8, device=device.device)
        if row > nbytes:
            stage[:, nbytes:].zero_()
        _gather(device, _typed(stage, host), src[a:b], ring)
        if sums:
            out.append(row_sums(stage[:, :nbytes]))
        for i, d, r in id_runs(dst[a:b]):  # one DMA per run of consecutive slots
            rows[d : d + r].copy_(stage[i : i + r], non_blocking=True)
    return out


def stage_to_device(
    host: torch.Tensor,
    rows: torch.Tensor,
    device: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    *,
    sums: bool = False,
    ring: PinnedIds | None = None,
) -> list[torch.Tensor]:
    """Enqueue the copy of host slots ``src`` into device pages ``dst`` (views as in
    :func:`stage_to_host`).  With ``sums``, returns each source payload's ``(S1, S2)`` as it
    reached the device (as :func:`stage_to_host` does)."""
    nbytes = host[0].numel() * host.element_size()
    row = rows.shape[1]
    out = []
    for a, b in _chunks(src.numel(), row):
        stage = torch.empty((b - a, row), dtype=torch.uint8, device=device.device)
        for i, s, r in id_runs(src[a:b]):
            stage[i : i + r].copy_(rows[s : s + r], non_blocking=True)
        if sums:
            out.append(row_sums(stage[:, :nbytes]))
        _scatter(_typed(stage, host), device, dst[a:b], ring)
    return out
