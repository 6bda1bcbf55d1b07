"""Staged slot copies (``transfer/staged.py``) and device-side checksums (``presum.row_sums``).

On CUDA a copy job moves whole host slots through a device staging block, so a host pool with
trailer space never makes torch copy through pageable memory on the loop's thread, and the
checksums are taken on the device.  The same code runs on CPU tensors: here it is held to the
CPU path (the C copy and the reference checksum); ``test_cuda.py`` runs it on a GPU.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from aiocache_kv.errors import InvalidInputError
from aiocache_kv.pools.kv_pool import HostKVPool
from aiocache_kv.storage.deferred import first_mismatch
from aiocache_kv.storage.integrity import FRAME_OVERHEAD, checksum
from aiocache_kv.storage.presum import row_sums, sum_slots
from aiocache_kv.transfer import staged
from aiocache_kv.transfer.engine import CopyJob, Direction
from aiocache_kv.transfer.staged import slot_rows

MASK = (1 << 64) - 1


def _want(rows: torch.Tensor) -> list[tuple[int, int]]:
    return [checksum(rows[i]) for i in range(rows.shape[0])]


def _got(sums: torch.Tensor) -> list[tuple[int, int]]:
    return [(a & MASK, b & MASK) for a, b in sums.tolist()]


@pytest.mark.parametrize("nbytes", [8, 16384, 16392, 3 * 16384 + 800, 5 << 16])
def test_row_sums_are_the_checksum(nbytes: int) -> None:
    seed = random.randrange(1 << 30)
    gen = torch.Generator().manual_seed(seed)
    # random bytes: every word is large, the sums overflow and must wrap as the C code's do
    slots = torch.randint(0, 256, (5, nbytes + 128), dtype=torch.uint8, generator=gen)
    payload = slots[:, :nbytes]
    assert _got(row_sums(payload)) == _want(payload), f"seed {seed}"
    slots[3, nbytes // 2] ^= 0x20
    sums = _got(row_sums(payload))
    assert sums[3] != _want(slots[:3, :nbytes])[0] and sums == _want(payload), f"seed {seed}"


def test_row_sums_refuse_what_they_cannot_sum() -> None:
    rows = torch.zeros((2, 64), dtype=torch.uint8)
    for bad in (
        rows[:, :60],  # not whole words
        rows.view(torch.int8),  # not bytes
        rows[0],  # not rows
        rows[:, 1:9],  # misaligned
        rows.t(),  # not byte-contiguous
        rows[:, :0],
    ):
        with pytest.raises(InvalidInputError, match="row_sums"):
            row_sums(bad)


def test_slot_rows_take_only_a_pools_slots() -> None:
    pool = HostKVPool(6, 2, 40, torch.float16, extra_bytes=FRAME_OVERHEAD)
    rows = slot_rows(pool.pages)
    assert rows is not None and rows.shape == pool.raw.shape
    assert rows.data_ptr() == pool.raw.data_ptr() and rows.stride() == pool.raw.stride()
    packed = HostKVPool(6, 2, 40, torch.float16)
    assert slot_rows(packed.pages) is not None
    # views whose gaps hold other pages or other data: a whole-slot write would clobber them
    assert slot_rows(pool.pages[::2]) is None
    assert slot_rows(pool.pages[1:]) is None
    assert slot_rows(pool.pages[:, :1]) is None  # a gap of one layer
    assert slot_rows(pool.pages.transpose(1, 2)) is None
    wide = torch.empty((6, 320 + staged.MAX_GAP + 9), dtype=torch.uint8)
    assert slot_rows(wide[:, :320].view(torch.float16).view(6, 2, 2, 40)) is None
    assert slot_rows(pool.pages[:0]) is None


def _pools(seed: int) -> tuple[torch.Tensor, HostKVPool, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    host = HostKVPool(12, 2, 2100, torch.float32, extra_bytes=FRAME_OVERHEAD)
    host.raw.copy_(torch.randint(0, 256, host.raw.shape, dtype=torch.uint8, generator=gen))
    device = torch.randn(2, 2, 14, 2100, generator=gen)
    side_dev = torch.randn(14, 3, 5, generator=gen)
    side_raw = torch.randint(0, 256, (12, 64 + 64), dtype=torch.uint8, generator=gen)
    return device, host, side_dev, side_raw


def _side_host(raw: torch.Tensor) -> torch.Tensor:
    return raw[:, :60].view(torch.float32).view(raw.shape[0], 3, 5)


@pytest.mark.parametrize("max_runs", [0, 8])  # one gather; a copy per run
@pytest.mark.parametrize("stage_bytes", [1 << 30, 20_000])  # one chunk; a page or two a chunk
def test_a_staged_device_to_host_job_is_the_cpu_job(
    stage_bytes: int, max_runs: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(staged, "STAGE_BYTES", stage_bytes)
    monkeypatch.setattr(staged, "MAX_RUNS", max_runs)
    seed = random.randrange(1 << 30)
    device, host, side_dev, side_raw = _pools(seed)
    ref = HostKVPool(12, 2, 2100, torch.float32, extra_bytes=FRAME_OVERHEAD)
    ref_side = side_raw.clone()
    src = torch.tensor([3, 4, 5, 13, 0, 1, 9], dtype=torch.int64)
    dst = torch.tensor([0, 1, 2, 3, 7, 8, 11], dtype=torch.int64)
    cpu = CopyJob(
        Direction.D2H,
        device,
        ref.pages,
        src,
        dst,
        ((side_dev, _side_host(ref_side)),),
        host_raw=ref.raw,
        sums=ref.sums,
    )
    cpu.run()
    job = CopyJob(
        Direction.D2H,
        device,
        host.pages,
        src,
        dst,
        ((side_dev, _side_host(side_raw)),),
        host_raw=host.raw,
        sums=host.sums,
    )
    before = host.raw.clone()
    before_pages = host.pages[dst].clone()
    job.run(non_blocking=True)
    assert job.device_sums  # taken from the staging blocks, one tensor per chunk
    assert (host.sums[:, 2] == 0).all()  # recorded only after the event
    job.after_event()
    d = dst.numpy()
    assert torch.equal(host.pages[dst], ref.pages[dst]), f"seed {seed}"
    assert torch.equal(_side_host(side_raw)[dst], side_dev[src]), f"seed {seed}"
    assert not torch.equal(host.pages[dst].view(torch.int32), before_pages.view(torch.int32))
    want = np.zeros_like(host.sums)
    sum_slots(host.raw, host.page_bytes, dst, want)
    assert (host.sums[d] == want[d]).all(), f"seed {seed}"
    others = np.setdiff1d(np.arange(12), d)
    assert (host.sums[others] == 0).all()
    assert torch.equal(host.raw[others], before[others])  # other slots untouched
    assert not host.raw[d, host.page_bytes :].any()  # trailer space zeroed, never stale
    assert not side_raw[d, 60:].any() and torch.equal(side_raw[others], ref_side[others])


@pytest.mark.parametrize("bad_at", [None, 0, 4])
@pytest.mark.parametrize("max_runs", [0, 8])
@pytest.mark.parametrize("stage_bytes", [1 << 30, 20_000])
def test_a_staged_host_to_device_job_checks_what_reached_the_device(
    bad_at: int | None, stage_bytes: int, max_runs: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(staged, "STAGE_BYTES", stage_bytes)
    monkeypatch.setattr(staged, "MAX_RUNS", max_runs)
    seed = random.randrange(1 << 30)
    device, host, side_dev, side_raw = _pools(seed)
    src = torch.tensor([6, 1, 2, 3, 7, 0], dtype=torch.int64)
    dst = torch.tensor([0, 1, 2, 3, 9, 10], dtype=torch.int64)
    table = np.zeros_like(host.sums)
    sum_slots(host.raw, host.page_bytes, src, table)
    expect = table[src.numpy()].copy()
    expect[1, 2] = 0  # verified already: not checked
    if bad_at is not None:
        host.raw[int(src[bad_at]), 11] ^= 0x01
    job = CopyJob(
        Direction.H2D,
        device,
        host.pages,
        src,
        dst,
        ((side_dev, _side_host(side_raw)),),
        host_raw=host.raw,
        expect=expect,
    )
    job.run(non_blocking=True)
    job.after_event()
    assert job.bad == ([] if bad_at is None else [bad_at]), f"seed {seed}"
    # every page was copied (on CUDA the device pages of a failed node are freed unread)
    got = device[:, :, dst].permute(2, 0, 1, 3).contiguous()
    assert torch.equal(got.view(torch.int32), host.pages[src].view(torch.int32)), f"seed {seed}"
    want = _side_host(side_raw)[src].view(torch.int32)  # random bytes: compared as bits
    assert torch.equal(side_dev[dst].view(torch.int32), want)


def test_id_runs() -> None:
    ids = torch.tensor([4, 5, 6, 0, 9, 10, 3], dtype=torch.int64)
    assert staged.id_runs(ids) == [(0, 4, 3), (3, 0, 1), (4, 9, 2), (6, 3, 1)]
    assert staged.id_runs(ids[:0]) == []
    assert staged.id_runs(ids[3:4]) == [(0, 0, 1)]


def test_first_mismatch_reads_only_checked_rows() -> None:
    got = np.array([[1, 2], [3, 4], [5, 6]], dtype=np.int64)
    rows = np.array([[1, 2, 8], [9, 9, 0], [5, 6, 8]], dtype=np.uint64)
    assert first_mismatch(got, 8, rows) == -1
    rows[2, 1] = 7
    assert first_mismatch(got, 8, rows) == 2
    assert first_mismatch(got, 16, rows) == 0  # another length fails
    got[0, 0] = -1  # the bits of a wrapped int64 sum: compared as unsigned
    rows[0, 0] = np.uint64((1 << 64) - 1)
    rows[2, 1] = 6
    assert first_mismatch(got, 8, rows) == -1
