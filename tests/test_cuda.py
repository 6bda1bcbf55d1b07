"""CUDA paths (copy stream + one event per copy, pinned host pool).  Run where a GPU exists."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import numpy as np
import pytest
import torch

import aiocache_kv as akv
from aiocache_kv.pools.kv_pool import HostKVPool
from aiocache_kv.storage import FileStorage
from aiocache_kv.storage.integrity import FRAME_OVERHEAD, checksum
from aiocache_kv.storage.presum import row_sums, sum_slots
from aiocache_kv.storage.tier import PrefetchStatus
from aiocache_kv.transfer import CudaCopyEngine
from aiocache_kv.transfer.copy import device_to_host, host_to_device
from aiocache_kv.transfer.engine import CopyJob, Direction
from aiocache_kv.transfer.staged import PinnedIds
from tests.conftest import small_config

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


async def test_cuda_write_through_and_load_back_are_bit_identical() -> None:
    cfg = small_config(device="cuda", page_size=4, device_pages=8)
    async with akv.HiCache(cfg) as cache:
        assert isinstance(cache._engine, CudaCopyEngine)
        assert cache.host_pool is not None and cache.host_pool.raw.is_pinned()
        tokens = list(range(16))
        slots = cache.alloc(16)
        written = []
        for layer in range(cfg.num_layers):
            for buf in cache.device_kv(layer):
                vals = torch.randn((16, *buf.shape[1:]), device="cuda")
                buf[slots.cuda()] = vals
                written.append(vals)
        r = cache.insert(tokens, slots)
        assert r.write_through is not None
        await r.write_through
        cache.release(r)
        cache.evict(100)
        cache.device_pool.buffer.zero_()  # type: ignore[union-attr]
        m = cache.match_prefix(tokens)
        await cache.load_back(m)  # the event was synchronized before the ack: data is there
        idx = m.device_indices.cuda()
        got = [buf[idx] for layer in range(cfg.num_layers) for buf in cache.device_kv(layer)]
        for a, b in zip(got, written, strict=True):
            assert torch.equal(a, b)
        cache.release(m)
        cache.check_invariants()


def _kv_config(**kw: object) -> akv.CacheConfig:
    return small_config(
        device="cuda",
        page_size=16,
        num_layers=2,
        num_kv_heads=8,
        head_dim=128,
        dtype=torch.float16,
        device_pages=64,
        host_pages=64,
        **kw,
    )


def _sleep_cycles(seconds: float) -> int:
    """GPU clock cycles that ``torch.cuda._sleep`` spins for about ``seconds``."""
    n = 50_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(n)
    end.record()
    end.synchronize()
    return int(n * seconds / (start.elapsed_time(end) / 1e3))


def _write_kv(cache: akv.HiCache, slots: torch.Tensor) -> list[torch.Tensor]:
    """Write random K/V at ``slots`` on the current (compute) stream."""
    idx = slots.to("cuda", non_blocking=True)
    written = []
    for layer in range(cache.config.num_layers):
        for buf in cache.device_kv(layer):
            vals = torch.randn((slots.numel(), *buf.shape[1:]), device="cuda", dtype=buf.dtype)
            buf[idx] = vals
            written.append(vals)
    return written


def _read_kv(cache: akv.HiCache, m: akv.MatchResult) -> list[torch.Tensor]:
    idx = m.device_indices.to("cuda", non_blocking=True)
    return [buf[idx] for layer in range(cache.config.num_layers) for buf in cache.device_kv(layer)]


async def test_write_through_waits_for_the_kernel_writing_the_kv() -> None:
    """The copy stream waits for the compute stream: a write-through started while the
    model's kernels are still writing the KV copies what they wrote, not what was there."""
    async with akv.HiCache(_kv_config()) as cache:
        tokens = list(range(256))
        slots = cache.alloc(256)
        cycles = await asyncio.to_thread(_sleep_cycles, 0.3)
        torch.cuda._sleep(cycles)  # the compute stream is busy before the writes
        written = _write_kv(cache, slots)
        r = cache.insert(tokens, slots)  # queued now, while the writes have not run yet
        assert r.write_through is not None
        await r.write_through
        cache.release(r)
        cache.evict(1 << 20)
        cache.device_pool.buffer.zero_()  # type: ignore[union-attr]
        m = cache.match_prefix(tokens)
        assert m.device_len == 0 and m.host_len == 256
        await cache.load_back(m)
        for got, want in zip(_read_kv(cache, m), written, strict=True):
            assert torch.equal(got, want)
        cache.release(m)
        cache.check_invariants()


async def test_load_back_resolves_once_the_kv_is_visible_to_the_compute_stream() -> None:
    """The copy stream is held up before the host->device copy; the awaited load must still
    hand the compute stream the loaded KV (the ack waits for the copy's event)."""
    async with akv.HiCache(_kv_config()) as cache:
        tokens = list(range(256))
        slots = cache.alloc(256)
        written = _write_kv(cache, slots)
        r = cache.insert(tokens, slots)
        await r.write_through  # type: ignore[misc]
        cache.release(r)
        cache.evict(1 << 20)
        cache.device_pool.buffer.zero_()  # type: ignore[union-attr]
        m = cache.match_prefix(tokens)
        cycles = await asyncio.to_thread(_sleep_cycles, 0.3)
        with torch.cuda.stream(cache._engine._stream):  # type: ignore[attr-defined]
            torch.cuda._sleep(cycles)
        await cache.load_back(m)
        got = _read_kv(cache, m)  # on the compute stream, with no synchronization of ours
        for a, b in zip(got, written, strict=True):
            assert torch.equal(a, b)
        cache.release(m)


def _queued_not_done(copy: Callable[[], object], stream: torch.cuda.Stream) -> float:
    """Run ``copy`` on ``stream`` behind ~1 s of GPU work; return how long the call took,
    asserting the stream is still busy when it returns."""
    cycles = _sleep_cycles(1.0)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(cycles)
        t0 = time.perf_counter()
        copy()
        took = time.perf_counter() - t0
        assert not stream.query(), "the copy call waited for the stream"
    stream.synchronize()
    return took


def _pools(pages: int) -> tuple[torch.Tensor, torch.Tensor]:
    layers, elems = 2, 16 * 8 * 128  # 512 KiB pages in float32
    host = torch.randn(pages, layers, 2, elems).pin_memory()
    dev = torch.randn(layers, 2, pages, elems, device="cuda")
    return host, dev


def test_host_to_device_copy_is_queued_not_done_by_the_call() -> None:
    """512 MiB of pages host->device: the call only queues work.  (From the permuted pinned
    view torch gathered into pageable memory on the calling thread - the event loop's -
    first: ~90 ms of loop time per 256 MiB on an H100 machine.)"""
    pages = 1024
    host, dev = _pools(pages)
    ids = torch.arange(pages)
    took = _queued_not_done(
        lambda: host_to_device(host, dev, ids, ids, non_blocking=True), torch.cuda.Stream()
    )  # type: ignore[no-untyped-call]
    assert took < 0.05, f"host_to_device of 512 MiB kept the calling thread {took:.3f} s"
    assert torch.equal(dev.permute(2, 0, 1, 3).cpu(), host)


def test_device_to_host_copy_is_queued_not_done_by_the_call() -> None:
    pages = 1024
    host, dev = _pools(pages)
    host.zero_()
    ids = torch.arange(pages)
    took = _queued_not_done(
        lambda: device_to_host(dev, host, ids, ids, non_blocking=True), torch.cuda.Stream()
    )  # type: ignore[no-untyped-call]
    assert took < 0.05, f"device_to_host of 512 MiB kept the calling thread {took:.3f} s"
    assert torch.equal(host, dev.permute(2, 0, 1, 3).cpu())


def test_row_sums_on_the_device_are_the_checksum() -> None:
    """int64 sums on the GPU wrap as the C code's do: random bytes overflow every block."""
    gen = torch.Generator().manual_seed(11)
    for nbytes in (16384, 3 * 16384 + 808, 1 << 20):
        rows = torch.randint(0, 256, (33, nbytes + 128), dtype=torch.uint8, generator=gen)
        got = row_sums(rows.cuda()[:, :nbytes]).cpu().tolist()
        mask = (1 << 64) - 1
        assert [(a & mask, b & mask) for a, b in got] == [
            checksum(rows[i, :nbytes]) for i in range(rows.shape[0])
        ]


class _Lag:
    """The longest the event loop went without running a 1 ms ticker."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            self.worst = max(self.worst, now - last)
            last = now

    async def __aenter__(self) -> _Lag:
        self._task = asyncio.get_running_loop().create_task(self._tick())
        await asyncio.sleep(0.002)  # ticking before the code under test runs
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


def _storage_config(tmp_path: object) -> akv.CacheConfig:
    return _kv_config(
        storage=FileStorage(tmp_path),  # type: ignore[arg-type]
        prefetch_threshold_tokens=0,
        prefetch_policy="wait_complete",
    )


async def test_storage_slots_are_copied_without_blocking_the_loop(tmp_path: object) -> None:
    """A host pool with trailer space (any storage tier) is strided: torch would copy it
    through pageable memory, waiting on the loop for the busy stream.  The staged copies only
    queue, take the sums on the device, and round-trip through storage bit for bit."""
    tokens = list(range(512))
    async with akv.HiCache(_storage_config(tmp_path)) as cache:
        host = cache.host_pool
        assert host is not None and not host.pages.is_contiguous() and host.raw.is_pinned()
        slots = cache.alloc(512)
        cycles = await asyncio.to_thread(_sleep_cycles, 0.5)
        written = _write_kv(cache, slots)
        torch.cuda._sleep(cycles)  # the compute stream is busy behind the writes
        async with _Lag() as lag:
            t0 = time.perf_counter()
            r = cache.insert(tokens, slots)
            took = time.perf_counter() - t0
            assert r.write_through is not None
            await r.write_through
        assert took < 0.1 and lag.worst < 0.1, (took, lag.worst)
        cache.release(r)
        await cache.flush()
        pages = [
            p for n in cache._tree.walk() if n.host_pages is not None for p in n.host_pages.tolist()
        ]
        assert len(pages) == 32
        want = np.zeros_like(host.sums)
        sum_slots(host.raw, host.page_bytes, np.array(pages), want)
        assert (host.sums[pages] == want[pages]).all()
        assert cache.statistics().backup_pages_ok == 32
    async with akv.HiCache(_storage_config(tmp_path)) as cache:
        res = await cache.prefetch(tokens)
        assert res.status is PrefetchStatus.COMPLETE
        m = cache.match_prefix(tokens)
        assert m.device_len == 0 and m.host_len == 512
        cycles = await asyncio.to_thread(_sleep_cycles, 0.5)
        with torch.cuda.stream(cache._engine._stream):  # type: ignore[attr-defined]
            torch.cuda._sleep(cycles)
        async with _Lag() as lag:
            await cache.load_back(m)
        assert lag.worst < 0.1, lag.worst
        for a, b in zip(_read_kv(cache, m), written, strict=True):
            assert torch.equal(a, b)
        cache.release(m)
        cache.check_invariants()


async def test_cuda_jobs_sum_and_check_pages_on_the_device() -> None:
    """Through the real engine: a device->host job records the sums taken on the device; a
    host->device job of pages read unverified finds the flipped one."""
    engine = CudaCopyEngine(torch.device("cuda"))
    loop = asyncio.get_running_loop()
    engine.start(loop)
    host = HostKVPool(8, 2, 4096, torch.float16, extra_bytes=FRAME_OVERHEAD, pin_memory=True)
    device = torch.randn(2, 2, 10, 4096, device="cuda", dtype=torch.float16)

    async def run(job: CopyJob) -> None:
        fut: asyncio.Future[BaseException | None] = loop.create_future()
        engine.submit(job, fut.set_result)
        assert await fut is None

    src, dst = torch.tensor([9, 2, 3, 4, 0]), torch.tensor([1, 2, 3, 4, 7])
    await run(
        CopyJob(Direction.D2H, device, host.pages, src, dst, host_raw=host.raw, sums=host.sums)
    )
    copied = await asyncio.to_thread(lambda: device[:, :, src].permute(2, 0, 1, 3).cpu())
    assert torch.equal(host.pages[dst], copied)
    want = np.zeros_like(host.sums)
    sum_slots(host.raw, host.page_bytes, dst, want)
    assert (host.sums[dst.numpy()] == want[dst.numpy()]).all()
    assert not host.raw[dst, host.page_bytes :].any()
    expect = want[dst.numpy()].copy()
    host.raw[int(dst[3]), 100] ^= 0x08
    back = torch.zeros_like(device)
    job = CopyJob(Direction.H2D, back, host.pages, dst, src, host_raw=host.raw, expect=expect)
    await run(job)
    assert job.device_sums and job.bad == [3]
    same = await asyncio.to_thread(lambda: torch.equal(back[:, :, src[:3]], device[:, :, src[:3]]))
    assert same
    await engine.aclose()


def test_pinned_ids_ring_never_overwrites_ids_still_being_copied() -> None:
    """Twenty id tensors through a ring of 64 while the stream is held up: a region is
    reused only after its copy ran, else the ids are pinned anew; every copy is right."""
    ring = PinnedIds(size=64)
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    cycles = _sleep_cycles(0.2)
    outs = []
    with torch.cuda.stream(stream):
        torch.cuda._sleep(cycles)  # the copies queue behind 0.2 s of work
        for i in range(20):
            ids = torch.arange(i, i + 24 + i % 3)
            outs.append((ids, ring.to_device(ids, torch.device("cuda"))))
            ring.check_invariants()
    stream.synchronize()
    for ids, out in outs:
        assert torch.equal(out.cpu(), ids)
    with torch.cuda.stream(stream):  # all copies done: the ring is reused
        ids = torch.arange(100, 130)
        out = ring.to_device(ids, torch.device("cuda"))
    stream.synchronize()
    assert torch.equal(out.cpu(), ids)
    ring.check_invariants()


async def test_a_job_failing_midway_reports_after_what_it_enqueued_on_the_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rule 2 on a real GPU (``test_copy.py`` checks the control flow with stand-ins): a
    device->host job of four staging chunks whose second staging block cannot be allocated
    (injected) enqueued the first chunk's copies already.  Its error reaches the loop (which
    then frees the pages) only after those copies ran: not while the copy stream is held up
    behind the compute stream, and by then the first chunk's slots hold the device pages."""
    from aiocache_kv.transfer import staged

    engine = CudaCopyEngine(torch.device("cuda"))
    loop = asyncio.get_running_loop()
    engine.start(loop)
    pages = 16
    host = HostKVPool(pages, 2, 4096, torch.float16, extra_bytes=FRAME_OVERHEAD, pin_memory=True)
    host.raw.zero_()
    device = torch.randn(2, 2, pages, 4096, device="cuda", dtype=torch.float16)
    cycles = await asyncio.to_thread(_sleep_cycles, 0.5)
    torch.cuda.synchronize()
    real_empty = torch.empty
    staging = [0]

    def empty(*args: object, **kwargs: object) -> torch.Tensor:
        dev = kwargs.get("device")
        if (
            kwargs.get("dtype") is torch.uint8
            and isinstance(dev, torch.device)
            and dev.type == "cuda"
        ):
            staging[0] += 1
            if staging[0] == 2:
                raise RuntimeError("injected: CUDA out of memory (second staging block)")
        return real_empty(*args, **kwargs)  # type: ignore[call-overload,no-any-return]

    monkeypatch.setattr(staged, "STAGE_BYTES", 4 * host.slot_bytes)  # four pages a chunk
    ids = torch.arange(pages)
    job = CopyJob(Direction.D2H, device, host.pages, ids, ids)
    fut: asyncio.Future[BaseException | None] = loop.create_future()
    torch.cuda._sleep(cycles)  # the compute stream is busy: the copy stream waits for it
    monkeypatch.setattr(torch, "empty", empty)
    try:
        engine.submit(job, fut.set_result)
    finally:
        monkeypatch.setattr(torch, "empty", real_empty)
    assert staging[0] == 2, f"the job made {staging[0]} staging allocations, not 2"
    await asyncio.sleep(0.1)
    assert not fut.done(), "the error was reported while the copies it enqueued were queued"
    err = await asyncio.wait_for(fut, 10)
    assert isinstance(err, RuntimeError) and "injected" in str(err), err
    want = await asyncio.to_thread(lambda: device[:, :, :4].permute(2, 0, 1, 3).cpu())
    assert torch.equal(host.pages[:4], want), "the first chunk had not landed when reported"
    assert not host.pages[4:].any(), "a chunk after the failure was copied"
    await engine.aclose()
