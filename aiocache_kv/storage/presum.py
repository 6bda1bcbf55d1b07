"""Page checksums taken by the copy that writes a host page (the integrity pass, fused).

A page backed up to storage needs its block-Fletcher checksum (:mod:`.integrity`) in the
trailer, and computing it is a whole read of the page.  The page was just read once already:
by the device->host copy that produced the host page.  So that copy takes the checksum:

* CPU (:func:`copy_to_host`): one C pass (``_blocksum.gather_sum``) gathers each 16 KiB block
  of the host payload from the device layout and sums it at once, while it is in the L1
  cache; the copy runs at the speed of a plain copy (measured on the 2-core project machine:
  ~10.8 GB/s fused, ~11 GB/s torch's copy with two threads).
* CUDA (:func:`sum_slots`): the copy is a DMA; the engine's waiter thread sums the pinned
  destination pages right after the copy's event, before the write acknowledgement reaches
  the loop.

The sums land in the host pool's per-page table (:attr:`~aiocache_kv.pools.kv_pool.HostKVPool.sums`:
``S1, S2, bytes``), written by the copy's worker before its completion is handed to the loop
(``call_soon_threadsafe``) and read by the storage workers a backup starts after that.  A
:class:`~.base.PageBuffer` built with its page's row as ``presum`` is sealed with it: only the
72-byte trailer is written (:func:`.integrity.seal_many`).  The identity and the key binding are
bound as before; only the sum is reused.

Why this keeps the guarantee.  The sum is of the bytes the copy wrote.  If the host page's
bytes changed after that (a stray write, a bit flip in host memory), the trailer still carries
the sum of what the copy wrote, so the stored page fails verification at every read: a miss,
never data (a full seal at put time would instead have sealed the changed bytes as valid).  A
row is cleared on the loop whenever the page is handed out again (``CacheCore.alloc_host``:
every writer of a host page allocates it first), so a recycled page never carries an old sum;
a page read from storage carries none and is sealed in full if it is ever backed up again.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from aiocache_kv.errors import InvalidInputError
from aiocache_kv.extensions import optional_extension
from aiocache_kv.priority import idle_relief_ns
from aiocache_kv.storage.base import PageBuffer
from aiocache_kv.storage.integrity import BLOCK_WORDS, FRAME_OVERHEAD, py_checksum

__all__ = ["FUSED", "copy_to_host", "covers", "py_copy_to_host", "row_sums", "sum_slots"]

_EXT = optional_extension("aiocache_kv.storage._blocksum")
#: whether the C extension can take the checksum inside the copy
FUSED = _EXT is not None and hasattr(_EXT, "gather_sum")

Table = np.ndarray[Any, Any]
#: page ids: a CPU tensor or a numpy array of integers
Ids = torch.Tensor | np.ndarray[Any, Any]


def _ids(pages: Ids) -> np.ndarray[Any, Any]:
    """``pages`` as a contiguous int64 numpy array (what the C calls take)."""
    if isinstance(pages, torch.Tensor):
        pages = pages.detach().to("cpu").numpy()
    return np.ascontiguousarray(pages, dtype=np.int64)


def _fits(device: torch.Tensor, raw: torch.Tensor, page_bytes: int) -> bool:
    """Whether :func:`copy_to_host` can copy between these two layouts in C."""
    return FUSED and layout_fits(device, raw, page_bytes)


def layout_fits(device: torch.Tensor, raw: torch.Tensor, page_bytes: int) -> bool:
    """Whether a C copy between the device pool (``[pages, ...]`` on CPU, contiguous, a
    page of ``page_bytes``) and host slots ``raw`` (uint8 rows of at least that) can run."""
    return (
        device.device.type == "cpu"
        and device.dim() == 4
        and device.is_contiguous()
        and raw.dtype == torch.uint8
        and raw.dim() == 2
        and raw.is_contiguous()
        and device.shape[0] * device.shape[1] * device.shape[3] * device.element_size()
        == page_bytes
        and page_bytes <= raw.shape[1]
    )


def copy_to_host(
    device: torch.Tensor,
    raw: torch.Tensor,
    page_bytes: int,
    src: Ids,
    dst: Ids,
    table: Table | None,
) -> bool:
    """Copy device pages ``src`` (``device``: ``[layers, 2, pages, elems]`` on the CPU) into
    host slots ``dst`` (``raw``: ``[pages, slot_bytes]`` uint8; the payload is the first
    ``page_bytes`` of a slot, in the host pool's page-first layout), recording each page's
    checksum in ``table`` (rows ``(S1, S2, bytes)``) in the same pass.  ``False``: nothing was
    done (no C extension, or layouts it does not take): copy another way, record no sum.

    Raises:
        IndexError: a page id out of range (nothing was copied).
    """
    if not _fits(device, raw, page_bytes):
        return False
    assert _EXT is not None
    layers, two, pages, elems = device.shape
    seg = elems * device.element_size()
    _EXT.gather_sum(
        device.view(torch.uint8).numpy(),
        seg,
        layers * two,
        pages * seg,
        _ids(src),
        raw.numpy(),
        raw.shape[1],
        _ids(dst),
        table,
        torch.get_num_threads(),  # the copy worker's setting (``copy_threads``), as torch's copy
        idle_relief_ns(),  # and its idle helpers (aiocache_kv.priority)
    )
    return True


def sum_slots(raw: torch.Tensor, page_bytes: int, pages: Ids, table: Table) -> None:
    """Record the checksum of the first ``page_bytes`` of host slots ``pages`` in ``table``
    (a CUDA copy's pinned destination, right after its event; on the waiter thread).

    Raises:
        IndexError: a page id out of range (nothing was recorded).
    """
    ids = _ids(pages)
    if _EXT is not None and hasattr(_EXT, "slot_sums"):
        _EXT.slot_sums(raw.numpy(), raw.shape[1], page_bytes, ids, table)
        return
    for d in ids.tolist():
        s1, s2 = py_checksum(raw[d, :page_bytes])
        table[d] = (s1, s2, page_bytes)


def row_sums(payload: torch.Tensor) -> torch.Tensor:
    """Each row's block-Fletcher ``(S1, S2)`` as an int64 ``[rows, 2]`` tensor on
    ``payload``'s device, in torch ops (a CUDA copy's staging block: the sums cost one read of
    device memory and no CPU pass).  ``payload`` is uint8 ``[rows, bytes]`` with ``bytes`` a
    multiple of 8 and rows 8-byte aligned; int64 arithmetic wraps, so the bits are those of
    :func:`~.integrity.checksum` (mod 2**64).  Only enqueues work on a CUDA device.

    Raises:
        InvalidInputError: ``payload`` is not such a tensor.
    """
    nbytes = payload.shape[1] if payload.dim() == 2 else -1
    if (
        payload.dtype != torch.uint8
        or nbytes <= 0
        or nbytes % 8
        or payload.stride(-1) != 1
        or payload.stride(0) % 8
        or (payload.storage_offset() + payload.untyped_storage().data_ptr()) % 8
    ):
        raise InvalidInputError(
            f"row_sums needs uint8 [rows, 8k bytes] 8-byte-aligned rows, got "
            f"{payload.dtype} {tuple(payload.shape)} strides {payload.stride()}"
        )
    words = payload.view(torch.int64)
    full, tail = divmod(nbytes // 8, BLOCK_WORDS)
    if tail:  # a short last block: sum it apart
        parts = [words[:, full * BLOCK_WORDS :].sum(-1, keepdim=True)]
        if full:
            head = words[:, : full * BLOCK_WORDS].reshape(-1, full, BLOCK_WORDS).sum(-1)
            parts.insert(0, head)
        blocks = torch.cat(parts, 1) if full else parts[0]
    else:
        blocks = words.reshape(-1, full, BLOCK_WORDS).sum(-1)
    weights = _weights(blocks.shape[1], payload.device)  # [blocks, 2]: columns 1 and b + 1
    return (blocks.unsqueeze(-1) * weights).sum(1)


_WEIGHTS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _weights(blocks: int, device: torch.device) -> torch.Tensor:
    """``[blocks, 2]`` int64: a column of ones (S1) and one of ``1..blocks`` (S2), kept per
    device and size."""
    key = (blocks, device)
    w = _WEIGHTS.get(key)
    if w is None:  # made on the device by kernels: a host->device copy could wait on a stream
        col = torch.arange(1, blocks + 1, dtype=torch.int64, device=device)
        w = torch.stack((torch.ones_like(col), col), 1)
        if len(_WEIGHTS) < 64:
            _WEIGHTS[key] = w
    return w


def py_copy_to_host(
    device: torch.Tensor,
    raw: torch.Tensor,
    page_bytes: int,
    src: Ids,
    dst: Ids,
    table: Table | None,
) -> None:
    """:func:`copy_to_host` in torch (the reference the C path is tested against)."""
    layers, two, _, elems = device.shape
    for s, d in zip(_ids(src).tolist(), _ids(dst).tolist(), strict=True):
        payload = raw[d, :page_bytes].view(device.dtype).view(layers, two, elems)
        payload.copy_(device[:, :, s])
        if table is not None:
            s1, s2 = py_checksum(raw[d, :page_bytes])
            table[d] = (s1, s2, page_bytes)


def covers(buffer: PageBuffer) -> bool:
    """Whether ``buffer`` carries the checksum of its whole payload (its seal reads nothing)."""
    row = buffer.presum
    return row is not None and int(row[2]) == buffer.nbytes - FRAME_OVERHEAD
