"""Paged KV buffers of the device (L1) and host (L2) tiers.

Device layout ``[num_layers, 2, num_pages, page_size * heads * head_dim]``: per layer, K and V
are contiguous so the model reads and writes ``device_kv(layer)`` views of shape
``[num_pages * page_size, heads, head_dim]``.  Host layout is page-first: page ``i`` is one
contiguous byte slot ``[payload | extra]`` of all layers' K and V, so a page moves to storage
in one zero-copy call; ``extra`` bytes are reserved for the storage tier's framing.

The host pool also keeps one checksum row per page (:attr:`HostKVPool.sums`): the copy that
writes a page from the device records its block-Fletcher sums there in the same pass
(:mod:`aiocache_kv.storage.presum`), so the storage backup's seal writes only the trailer.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

_ALIGN = 64


class DeviceKVPool:
    """The L1 buffer: per-layer K/V pages on the compute device."""

    def __init__(
        self,
        num_pages: int,
        num_layers: int,
        page_size: int,
        heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.page_size = page_size
        self.heads = heads
        self.head_dim = head_dim
        self.page_elems = page_size * heads * head_dim
        self.buffer = torch.zeros(
            (num_layers, 2, num_pages, self.page_elems), dtype=dtype, device=device
        )
        self.num_pages = num_pages

    @property
    def nbytes(self) -> int:
        """Bytes of the whole buffer."""
        return self.buffer.numel() * self.buffer.element_size()

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V views of ``layer``: ``[num_pages * page_size, heads, head_dim]``."""
        shape = (self.num_pages * self.page_size, self.heads, self.head_dim)
        return self.buffer[layer, 0].view(shape), self.buffer[layer, 1].view(shape)


def host_slot_bytes(page_bytes: int, extra: int) -> int:
    """Bytes per host page slot: payload plus ``extra``, rounded up to 64."""
    return -(-(page_bytes + extra) // _ALIGN) * _ALIGN


class HostKVPool:
    """The L2 buffer: page-first slots in (pinned, where CUDA exists) host memory."""

    def __init__(
        self,
        num_pages: int,
        num_layers: int,
        page_elems: int,
        dtype: torch.dtype,
        *,
        extra_bytes: int = 0,
        pin_memory: bool = False,
    ) -> None:
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.page_bytes = num_layers * 2 * page_elems * itemsize
        self.slot_bytes = host_slot_bytes(self.page_bytes, extra_bytes)
        self.num_pages = num_pages
        self.raw = torch.empty(
            (num_pages, self.slot_bytes), dtype=torch.uint8, pin_memory=pin_memory
        )
        #: typed payload view ``[num_pages, num_layers, 2, page_elems]``
        self.pages = (
            self.raw[:, : self.page_bytes].view(dtype).view(num_pages, num_layers, 2, page_elems)
        )
        #: per page ``(S1, S2, bytes)``: the payload checksum the copy that wrote the page took
        #: (``bytes`` 0: none).  Written by the copy's worker before its completion reaches the
        #: loop, read by storage workers after; cleared on the loop whenever a page is handed
        #: out again (:meth:`forget_sums`), so a recycled page never carries an old sum.
        self.sums: np.ndarray[Any, Any] = np.zeros((num_pages, 3), dtype=np.uint64)
        #: per page: its bytes came from storage unverified (a deferred read: only the
        #: trailer was checked, and its ``sums`` row is the *trailer's* sum, to compare with
        #: at load-back, which verifies it in the host->device copy; see
        #: ``storage/deferred.py``).  Set and cleared on the loop only.
        self.unverified: np.ndarray[Any, Any] = np.zeros(num_pages, dtype=np.bool_)

    def forget_sums(self, pages: torch.Tensor) -> None:
        """Drop the recorded checksums of ``pages`` (ids): their bytes are about to change."""
        ids = pages.numpy()
        self.sums[ids, 2] = 0
        self.unverified[ids] = False

    @property
    def nbytes(self) -> int:
        """Bytes of the whole buffer."""
        return self.raw.numel()
