"""Copy kernels between the device layout and the page-first host layout."""

from __future__ import annotations

import asyncio
import os
import sys
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import aiocache_kv as akv
from aiocache_kv import CacheConfig
from aiocache_kv.errors import ConfigError
from aiocache_kv.priority import RELIEF_S, idle_relief_ns
from aiocache_kv.transfer import CopyJob, Direction, ThreadCopyEngine, page_runs
from aiocache_kv.transfer.copy import device_to_host, host_to_device
from tests.conftest import small_config


def test_page_runs_coalesce_consecutive_pairs() -> None:
    src = torch.tensor([4, 5, 6, 9, 10, 2])
    dst = torch.tensor([0, 1, 2, 3, 7, 8])
    assert page_runs(src, dst) == [(4, 0, 3), (9, 3, 1), (10, 7, 1), (2, 8, 1)]
    assert page_runs(torch.tensor([3]), torch.tensor([1])) == [(3, 1, 1)]
    assert page_runs(torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64)) == []


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_round_trip_is_bit_identical(data: st.DataObject) -> None:
    layers, pages, elems = 2, 12, 6
    dev = torch.randn(layers, 2, pages, elems)
    host = torch.zeros(pages, layers, 2, elems)
    n = data.draw(st.integers(1, pages))
    src = torch.tensor(data.draw(st.permutations(range(pages)))[:n])
    dst = torch.tensor(data.draw(st.permutations(range(pages)))[:n])
    device_to_host(dev, host, src, dst)
    for s, d in zip(src.tolist(), dst.tolist(), strict=True):
        assert torch.equal(host[d], dev[:, :, s])
    back = torch.zeros_like(dev)
    host_to_device(host, back, dst, src)
    assert torch.equal(back[:, :, src], dev[:, :, src])


async def test_thread_engine_delivers_on_the_loop() -> None:
    dev = torch.randn(1, 2, 8, 4)
    host = torch.zeros(8, 1, 2, 4)
    engine = ThreadCopyEngine()
    loop = asyncio.get_running_loop()
    engine.start(loop)
    fut: asyncio.Future[tuple[BaseException | None, bool]] = loop.create_future()
    owner = threading.get_ident()

    def done(err: BaseException | None) -> None:
        fut.set_result((err, threading.get_ident() == owner))

    engine.submit(CopyJob(Direction.D2H, dev, host, torch.arange(8), torch.arange(8)), done)
    err, on_loop = await asyncio.wait_for(fut, 10)
    assert err is None and on_loop
    assert torch.equal(host.permute(1, 2, 0, 3), dev)
    bad = CopyJob(Direction.D2H, dev, host, torch.tensor([99]), torch.tensor([0]))
    fut2: asyncio.Future[BaseException | None] = loop.create_future()
    engine.submit(bad, fut2.set_result)
    assert isinstance(await asyncio.wait_for(fut2, 10), IndexError | RuntimeError)
    await engine.aclose()


class _NiceProbe:
    """A copy job that records the worker thread's nice value and that of a thread it starts
    (as OpenMP would), instead of copying."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def run(self, *, non_blocking: bool = False) -> None:
        self.seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        child = threading.Thread(
            target=lambda: self.seen.append(
                os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            )
        )
        child.start()
        child.join()


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice is Linux's")
@pytest.mark.parametrize("nice", [0, 7])
async def test_copy_worker_runs_below_the_loop(nice: int) -> None:
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    engine = ThreadCopyEngine(nice=nice)
    loop = asyncio.get_running_loop()
    engine.start(loop)
    probe = _NiceProbe()
    fut: asyncio.Future[BaseException | None] = loop.create_future()
    engine.submit(probe, fut.set_result)
    assert await asyncio.wait_for(fut, 10) is None
    await engine.aclose()
    want = min(19, base + nice)
    assert probe.seen == [want, want], (base, nice, probe.seen)
    # the loop's own thread is untouched
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base


class _PolicyProbe:
    """A copy job that records the worker thread's scheduling policy, nice value and idle
    helper setting, instead of copying."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int, int]] = []

    def run(self, *, non_blocking: bool = False) -> None:
        tid = threading.get_native_id()
        self.seen.append(
            (os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid), idle_relief_ns())
        )


@pytest.mark.skipif(sys.platform != "linux", reason="SCHED_IDLE is Linux's")
@pytest.mark.parametrize("idle", [False, True])
async def test_copy_worker_copies_on_idle_helpers_only_when_asked(idle: bool) -> None:
    """``CacheConfig.worker_idle`` (the default): the copy worker stays under the loop's policy
    at nice +10 (never ``SCHED_IDLE`` itself: preempted while holding the GIL it would stall
    the loop) and hands its copies to idle helpers; without it, it copies itself."""
    me = threading.get_native_id()
    base = os.sched_getscheduler(me), os.getpriority(os.PRIO_PROCESS, me)
    assert CacheConfig().worker_idle
    async with akv.HiCache(small_config(worker_idle=idle)) as cache:
        engine = cache._engine  # the engine the config chose
        assert isinstance(engine, ThreadCopyEngine)
        loop = asyncio.get_running_loop()
        probe = _PolicyProbe()
        fut: asyncio.Future[BaseException | None] = loop.create_future()
        engine.submit(probe, fut.set_result)
        assert await asyncio.wait_for(fut, 10) is None
    relief = round(RELIEF_S * 1e9) if idle else 0
    assert probe.seen == [(base[0], min(19, base[1] + 10), relief)], (idle, probe.seen)
    assert (os.sched_getscheduler(me), os.getpriority(os.PRIO_PROCESS, me)) == base
    assert idle_relief_ns() == 0  # the loop's thread copies itself


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_worker_idle_is_validated(bad: object) -> None:
    with pytest.raises(ConfigError, match="worker_idle"):
        CacheConfig(worker_idle=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-1, 20, 1.5, True, "10"])
def test_worker_nice_is_validated(bad: object) -> None:
    with pytest.raises(ConfigError, match="worker_nice"):
        CacheConfig(worker_nice=bad)  # type: ignore[arg-type]


async def test_the_bench_engine_never_parks_a_copy_that_lands_after_release() -> None:
    """The storage bench's ``HeldAckEngine``: released while a held copy is still running,
    that copy's ack is delivered when it lands (parked, it would make ``flush`` wait forever)."""
    from aiocache_kv.bench.storage_paths import HeldAckEngine

    dev = torch.randn(1, 2, 8, 4)
    host = torch.zeros(8, 1, 2, 4)
    engine = HeldAckEngine()
    loop = asyncio.get_running_loop()
    engine.start(loop)
    gate = threading.Event()
    first: asyncio.Future[BaseException | None] = loop.create_future()
    one = CopyJob(Direction.D2H, dev, host, torch.arange(1), torch.arange(1))
    engine.submit(one, first.set_result)
    assert await asyncio.wait_for(first, 10) is None  # not holding: delivered as usual
    engine.hold(1)
    late: asyncio.Future[BaseException | None] = loop.create_future()

    class Slow(CopyJob):
        def run(self, *, non_blocking: bool = False) -> None:
            gate.wait(10)
            super().run(non_blocking=non_blocking)

    engine.submit(Slow(Direction.D2H, dev, host, torch.arange(8), torch.arange(8)), late.set_result)
    engine.release()  # before the copy landed
    gate.set()
    assert await asyncio.wait_for(late, 10) is None
    assert torch.equal(host.permute(1, 2, 0, 3), dev)
    await engine.aclose()


class _FakeCudaEvent:
    """A CUDA event whose copies finish when the test says so (``gate``)."""

    gate = threading.Event()

    def record(self, stream: object = None) -> None:
        pass

    def synchronize(self) -> None:
        assert self.gate.wait(10), "the copies never finished"


class _FakeStream:
    def __init__(self, device: object = None) -> None:
        pass

    def wait_stream(self, other: object) -> None:
        pass


class _FailsMidway:
    """A job that enqueued some copies, then failed (a staging allocation, say)."""

    def run(self, *, non_blocking: bool = False, ids: object = None) -> None:
        raise RuntimeError("CUDA out of memory (after two chunks were enqueued)")

    def after_event(self) -> None:
        raise AssertionError("a failed job records nothing")


async def test_a_cuda_job_failing_midway_reports_only_after_what_it_enqueued(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rule 2: what a job enqueued before it failed still reads or writes its pages, so its
    error reaches the loop (which frees the pages) only after the event recorded behind
    that work, never at once.  (Control flow with stand-ins for torch.cuda: no GPU here.)"""
    import contextlib

    from aiocache_kv.transfer.engine import CudaCopyEngine

    _FakeCudaEvent.gate.clear()
    monkeypatch.setattr(torch.cuda, "Event", _FakeCudaEvent)
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index=None: _FakeStream())
    engine = CudaCopyEngine(torch.device("cuda", 0))
    loop = asyncio.get_running_loop()
    engine.start(loop)
    fut: asyncio.Future[BaseException | None] = loop.create_future()
    engine.submit(_FailsMidway(), fut.set_result)  # type: ignore[arg-type]
    await asyncio.sleep(0.1)
    assert not fut.done(), "the error was reported while the enqueued copies ran"
    _FakeCudaEvent.gate.set()
    err = await asyncio.wait_for(fut, 5)
    assert isinstance(err, RuntimeError) and "out of memory" in str(err)
    await engine.aclose()


def _slotted(pages: int, layers: int, elems: int, tail: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A host pool's shape: uint8 slots of a page plus ``tail`` trailer bytes, and the typed
    page-first view of their payloads."""
    page = layers * 2 * elems * 4
    raw = torch.full((pages, page + tail), 0xA5, dtype=torch.uint8)
    return raw, raw[:, :page].view(torch.float32).view(pages, layers, 2, elems)


@pytest.mark.parametrize("seed", range(4))
def test_scattered_pages_take_the_c_copy_and_match_torch(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pages in runs of about one go through the C copy on the CPU (one call, no GIL); its
    result equals torch's run-by-run copy byte for byte, slot trailers untouched."""
    from aiocache_kv.transfer import copy as copy_mod

    taken: list[str] = []
    for name in ("copy_to_host", "copy_to_device"):
        real = getattr(copy_mod, name)
        monkeypatch.setattr(copy_mod, name, lambda *a, _r=real, _n=name: taken.append(_n) or _r(*a))
    g = torch.Generator().manual_seed(seed)
    layers, pages, elems = 3, 40, 24
    dev = torch.randn(layers, 2, pages, elems, generator=g)
    raw, host = _slotted(48, layers, elems, tail=72)
    want_raw, want = _slotted(48, layers, elems, tail=72)
    n = 17
    src = torch.randperm(pages, generator=g)[:n]
    dst = torch.randperm(48, generator=g)[:n]
    for s, d, r in page_runs(src, dst):  # the reference: torch, run by run
        want[d : d + r].copy_(dev[:, :, s : s + r].permute(2, 0, 1, 3))
    assert device_to_host(dev, host, src, dst) == n * layers * 2 * elems * 4
    assert torch.equal(raw, want_raw)  # payloads equal, every trailer byte still 0xA5
    back = torch.zeros_like(dev)
    assert host_to_device(host, back, dst, src) == n * layers * 2 * elems * 4
    assert torch.equal(back[:, :, src], dev[:, :, src])
    untouched = torch.ones(pages, dtype=torch.bool)
    untouched[src] = False
    assert not back[:, :, untouched].any()
    assert taken == ["copy_to_host", "copy_to_device"]


def test_c_copy_refuses_an_out_of_range_page_and_copies_nothing() -> None:
    from aiocache_kv.storage.presum import FUSED

    assert FUSED, "the C extension (aiocache_kv.storage._blocksum) is not built"
    layers, elems = 2, 8
    dev = torch.randn(layers, 2, 10, elems)
    raw, host = _slotted(10, layers, elems, tail=8)
    before = raw.clone()
    for src, dst in (([3, 0, 7], [1, 5, 10]), ([3, 10, 7], [1, 5, 2]), ([-1, 0, 4], [2, 6, 8])):
        with pytest.raises(IndexError, match="out of range"):
            device_to_host(dev, host, torch.tensor(src), torch.tensor(dst))
        assert torch.equal(raw, before)
        back = dev.clone()
        with pytest.raises(IndexError, match="out of range"):
            host_to_device(host, back, torch.tensor(dst), torch.tensor(src))
        assert torch.equal(back, dev)


def test_copies_the_c_path_does_not_take_go_the_torch_way() -> None:
    """Another dtype (copy_ converts), a non-page-first host and long runs: torch's copy."""
    layers, pages, elems = 2, 12, 4
    dev = torch.randn(layers, 2, pages, elems)
    src, dst = torch.tensor([5, 1, 9, 3]), torch.tensor([0, 7, 2, 11])
    half = torch.zeros(pages, layers, 2, elems, dtype=torch.float64)
    device_to_host(dev, half, src, dst)
    assert torch.equal(half[dst], dev[:, :, src].permute(2, 0, 1, 3).double())
    strided = torch.zeros(pages, layers, 2, elems * 2)[..., ::2]  # pages not contiguous
    device_to_host(dev, strided, src, dst)
    assert torch.equal(strided[dst], dev[:, :, src].permute(2, 0, 1, 3))
    runs_host = torch.zeros(pages, layers, 2, elems)
    device_to_host(dev, runs_host, torch.arange(2, 10), torch.arange(4, 12))
    assert torch.equal(runs_host[4:12], dev[:, :, 2:10].permute(2, 0, 1, 3))
