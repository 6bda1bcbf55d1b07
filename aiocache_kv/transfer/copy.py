"""Page copies between the device layout and the page-first host layout.

Chosen by measurement (MOONCAKE.md, raw copy): gathers and plain ``copy_`` of contiguous
ranges run near memcpy speed while scatters (``index_copy_``/``index_put_``) reach only 2-3
GB/s.  So a copy is split into runs where both the source and the destination page ids are
consecutive, and each run is one strided ``copy_`` of a ``[layers, 2, run, page]`` block -
no scatter, no staging buffer.  The allocators hand out ascending ids, so runs are long.

On the CPU, a copy runs in C instead where the extension is built and the layouts take it
(:func:`aiocache_kv.storage.presum.copy_to_host` and
:func:`aiocache_kv.storage.deferred.copy_to_device` without a checksum table: one call,
without the GIL, over the copy worker's threads, or on its idle helpers:
:mod:`aiocache_kv.priority`).  A ``copy_`` per run costs ~10 us of torch
dispatch, so scattered pages (one run each) crawled: measured with ``bench transfer`` on the
2-core project machine, random 64 KiB pages at 0.38 (device to host) and 0.44 (host to
device) of an ``index_select`` of the same pages.
"""

from __future__ import annotations

import itertools

import torch

from aiocache_kv.priority import IDLE_INLINE_BYTES, idle_helpers_ready, idle_relief_ns
from aiocache_kv.storage.deferred import copy_to_device
from aiocache_kv.storage.presum import copy_to_host

#: a copy whose runs average fewer pages than this goes the C way on the CPU (measured with
#: ``bench transfer``: long runs 1.3-1.5x an ``index_select`` either way; the whole
#: write-through path at 64 KiB pages 1.10x with runs through ``copy_``, 0.80x all in C)
SHORT_RUN = 4


def page_runs(src: torch.Tensor, dst: torch.Tensor) -> list[tuple[int, int, int]]:
    """Split paired page ids into ``(src_start, dst_start, length)`` runs of consecutive ids."""
    n = src.numel()
    if n == 0:
        return []
    if n == 1:
        return [(int(src[0]), int(dst[0]), 1)]
    brk = ((src[1:] - src[:-1]) != 1) | ((dst[1:] - dst[:-1]) != 1)
    cuts = [0, *(torch.nonzero(brk).flatten() + 1).tolist(), n]
    s = src.tolist()
    d = dst.tolist()
    return [(s[a], d[a], b - a) for a, b in itertools.pairwise(cuts)]


def device_to_host(
    device: torch.Tensor,
    host: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    *,
    non_blocking: bool = False,
) -> int:
    """Copy device pages ``src`` into host pages ``dst``; return bytes copied.

    ``device`` is ``[layers, 2, pages, elems]``, ``host`` is ``[pages, layers, 2, elems]``.

    Raises:
        IndexError: a page id out of range (on the CPU's C path nothing was copied).
    """
    nbytes, runs = _in_c(device, host, src, dst, non_blocking, to_host=True)
    for s, d, r in runs:
        host[d : d + r].copy_(
            device[:, :, s : s + r].permute(2, 0, 1, 3), non_blocking=non_blocking
        )
    return nbytes


def host_to_device(
    host: torch.Tensor,
    device: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    *,
    non_blocking: bool = False,
) -> int:
    """Copy host pages ``src`` into device pages ``dst``; return bytes copied.

    On CUDA each run is first copied as it lies in host memory (contiguous, pinned: a true
    asynchronous DMA) into a device staging block, and permuted into the device layout by a
    device-side copy.  Copying the permuted host view directly would make torch gather it
    into *pageable* host memory on the calling thread - the event loop's - and then copy
    from there synchronously.

    Raises:
        IndexError: a page id out of range (on the CPU's C path nothing was copied).
    """
    nbytes, runs = _in_c(device, host, src, dst, non_blocking, to_host=False)
    staged = device.is_cuda
    for s, d, r in runs:
        block = host[s : s + r]
        if staged:
            # allocated on the current (copy) stream; torch's caching allocator keeps it
            # until the work queued on that stream has used it
            block = block.to(device.device, non_blocking=non_blocking)
        device[:, :, d : d + r].copy_(block.permute(1, 2, 0, 3), non_blocking=non_blocking)
    return nbytes


def _in_c(
    device: torch.Tensor,
    host: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    non_blocking: bool,
    *,
    to_host: bool,
) -> tuple[int, list[tuple[int, int, int]]]:
    """Do the copy in C where it is synchronous, scattered (its runs average fewer than
    :data:`SHORT_RUN` pages: torch's strided ``copy_`` wins on long runs) or the calling worker
    copies on idle helpers (:func:`aiocache_kv.priority.copy_on_idle_helpers`), and the
    layouts take it; (bytes, the runs still to copy through ``copy_``: none when C did it)."""
    page = host[0].numel() * host.element_size()
    nbytes = src.numel() * page
    # on idle helpers every CPU copy but a small one goes to C (torch's copy_ would run on the
    # worker itself), unless the helpers starved lately: then long runs go torch's way; the
    # runs are not even looked for (a few torch calls on the worker, beside the loop)
    idle = nbytes > IDLE_INLINE_BYTES and idle_relief_ns() > 0 and idle_helpers_ready()
    runs = None if idle else page_runs(src, dst)
    raw = None
    if not non_blocking and (runs is None or len(runs) * SHORT_RUN > src.numel()):
        raw = _raw_pair(device, host)
    if raw is not None:
        if to_host:
            done = copy_to_host(device, raw, page, src, dst, None)
        else:
            done = copy_to_device(raw, page, device, src, dst, None) is not None
        if done:
            return nbytes, []
    return nbytes, page_runs(src, dst) if runs is None else runs


def _raw_pair(device: torch.Tensor, host: torch.Tensor) -> torch.Tensor | None:
    """``host`` as uint8 slots when a C copy with ``device`` (``[layers, 2, pages, elems]``)
    moves exactly what ``copy_`` would: the same dtype, a page of the same shape."""
    if device.device.type != "cpu" or device.dim() != 4 or host.dim() != 4:
        return None  # (a CUDA copy never takes the C path: no view built for it)
    if host.dtype != device.dtype:
        return None
    layers, two, _, elems = device.shape
    if tuple(host.shape[1:]) != (layers, two, elems):
        return None
    return slots_of(host)


def slots_of(host: torch.Tensor) -> torch.Tensor | None:
    """``host`` (page-first on the CPU, each page contiguous, pages ``stride(0)`` elements
    apart: a host pool's typed view of its slots, or a plain contiguous tensor) as uint8
    ``[pages, slot_bytes]`` over the same memory; ``None``: another layout."""
    if host.device.type != "cpu" or host.dim() < 2 or host.shape[0] == 0:
        return None
    if not host[0].is_contiguous() or host.stride(0) < host[0].numel():
        return None
    size = host.element_size()
    slot = host.stride(0) * size
    start = host.storage_offset() * size
    storage = host.untyped_storage()
    if start + host.shape[0] * slot > storage.nbytes():
        return None  # the last slot's tail lies past the memory: copy the torch way
    raw = torch.empty(0, dtype=torch.uint8)
    return raw.set_(storage, start, (host.shape[0], slot), (slot, 1))


def copy_page_first(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_pages: torch.Tensor,
    dst_pages: torch.Tensor,
    *,
    non_blocking: bool = False,
) -> int:
    """Copy pages between two page-first buffers (sidecars); return bytes copied."""
    for s, d, r in page_runs(src_pages, dst_pages):
        dst[d : d + r].copy_(src[s : s + r], non_blocking=non_blocking)
    return src_pages.numel() * src[0].numel() * src.element_size()
