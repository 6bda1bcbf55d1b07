"""CUDA paths (copy stream + one event per copy, pinned host pool).  Run where a GPU exists."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
import torch

import aiocache_kv as akv
from aiocache_kv.transfer import CudaCopyEngine
from aiocache_kv.transfer.copy import device_to_host, host_to_device
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


def _kv_config() -> akv.CacheConfig:
    return small_config(
        device="cuda",
        page_size=16,
        num_layers=2,
        num_kv_heads=8,
        head_dim=128,
        dtype=torch.float16,
        device_pages=64,
        host_pages=64,
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
