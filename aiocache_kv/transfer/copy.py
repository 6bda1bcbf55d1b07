"""Page copies between the device layout and the page-first host layout.

Chosen by measurement (MOONCAKE.md, raw copy): gathers and plain ``copy_`` of contiguous
ranges run near memcpy speed while scatters (``index_copy_``/``index_put_``) reach only 2-3
GB/s.  So a copy is split into runs where both the source and the destination page ids are
consecutive, and each run is one strided ``copy_`` of a ``[layers, 2, run, page]`` block -
no scatter, no staging buffer.  The allocators hand out ascending ids, so runs are long.
"""

from __future__ import annotations

import itertools

import torch


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
    """
    for s, d, r in page_runs(src, dst):
        host[d : d + r].copy_(
            device[:, :, s : s + r].permute(2, 0, 1, 3), non_blocking=non_blocking
        )
    return src.numel() * host[0].numel() * host.element_size()


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
    """
    staged = device.is_cuda
    for s, d, r in page_runs(src, dst):
        block = host[s : s + r]
        if staged:
            # allocated on the current (copy) stream; torch's caching allocator keeps it
            # until the work queued on that stream has used it
            block = block.to(device.device, non_blocking=non_blocking)
        device[:, :, d : d + r].copy_(block.permute(1, 2, 0, 3), non_blocking=non_blocking)
    return src.numel() * host[0].numel() * host.element_size()


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
