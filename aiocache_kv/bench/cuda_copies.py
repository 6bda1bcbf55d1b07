"""Benchmark of the cache's copy jobs on a CUDA device, as ratios against the raw pinned copy.

For each page size, ``--mib`` MiB move each way in jobs of up to 32 MiB (a write-through or
load-back batch) through the real :class:`~aiocache_kv.transfer.CudaCopyEngine`, from first
submit to last completion on the event loop:

* **raw** (the baseline, same run): one contiguous ``copy_`` per job between device memory
  and pinned host memory of the same bytes: what the link moves with nothing in the way.
* **raw via engine**: the same copies as jobs through the engine (an event each, the waiter
  thread, the completion on the loop): the engine's own cost, without staging.
* **packed**: a host pool without trailer space (no storage tier).
* **slots**: a host pool with a storage trailer per slot (the layout every storage tier
  uses), staged through the device (:mod:`aiocache_kv.transfer.staged`).
* **slots+sums**: the same, device->host jobs taking each page's checksum for the backup's
  seal, host->device jobs checking the pages a Mooncake prefetch read unverified; on the
  device, from the staging block.
* **slots+sums, torch path**: as before staging: torch's own copy of the strided host view
  (through pageable memory on the calling thread) and the checksums on the waiter thread.

Device pages are scattered (random), host pages consecutive, as the allocators hand them
out.  ``loop ms`` is the event loop's time inside ``submit`` for the whole transfer: what a
copy costs the serving loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from aiocache_kv.bench.report import JSON, heading, median, ratio, table
from aiocache_kv.pools.kv_pool import HostKVPool
from aiocache_kv.storage.integrity import FRAME_OVERHEAD
from aiocache_kv.transfer.engine import CopyJob, CudaCopyEngine, Direction

MiB = 1 << 20
KiB = 1 << 10
LAYERS, HEADS, HEAD_DIM = 4, 8, 128
TOKEN_BYTES = LAYERS * 2 * HEADS * HEAD_DIM * 2  # float16
JOB_BYTES = 32 * MiB
TARGET_RATIO = 0.9

PAGE_KIB = (64, 1024, 4096)
ARMS = ("packed", "slots", "slots+sums", "slots+sums, torch path")


@dataclass(frozen=True)
class CudaBenchOptions:
    """What ``aiocache-kv bench cuda`` runs."""

    page_kib: tuple[int, ...] = PAGE_KIB
    mib: int = 1024
    repeats: int = 3
    seed: int = 0


class CopySetup:
    """One page size's pools and job lists (``scripts/gpu_profile_submit.py`` uses it too)."""

    def __init__(self, page_bytes: int, mib: int, gen: torch.Generator) -> None:
        self.page_bytes = page_bytes
        self.pages = max(1, mib * MiB // page_bytes)
        elems = page_bytes // (LAYERS * 2 * 2)
        dev_pages = 2 * self.pages
        on_gpu = torch.Generator(device="cuda").manual_seed(int(gen.initial_seed()))
        self.device = torch.randn(
            LAYERS, 2, dev_pages, elems, generator=on_gpu, dtype=torch.float16, device="cuda"
        )
        self.hosts = {
            "packed": HostKVPool(self.pages, LAYERS, elems, torch.float16, pin_memory=True),
            "slots": HostKVPool(
                self.pages,
                LAYERS,
                elems,
                torch.float16,
                extra_bytes=FRAME_OVERHEAD,
                pin_memory=True,
            ),
        }
        per = max(1, JOB_BYTES // page_bytes)
        dev = torch.randperm(dev_pages, generator=gen)[: self.pages]
        host = torch.arange(self.pages)
        self.jobs = [(dev[a : a + per], host[a : a + per]) for a in range(0, self.pages, per)]
        self.raw_dev = torch.empty(self.pages * page_bytes, dtype=torch.uint8, device="cuda")
        self.raw_host = torch.empty(self.pages * page_bytes, dtype=torch.uint8, pin_memory=True)

    def job(self, arm: str, direction: Direction, dev: torch.Tensor, host: torch.Tensor) -> CopyJob:
        pool = self.hosts["packed" if arm == "packed" else "slots"]
        sums = arm.startswith("slots+sums")
        d2h = direction is Direction.D2H
        src, dst = (dev, host) if d2h else (host, dev)
        expect = None
        if sums and not d2h:
            expect = pool.sums[host.numpy()]  # the rows the write-through recorded
        return CopyJob(
            direction,
            self.device,
            pool.pages,
            src,
            dst,
            host_raw=pool.raw if sums else None,
            sums=pool.sums if sums and d2h else None,
            expect=expect,
            staged=not arm.endswith("torch path"),
        )


async def transfer(
    engine: CudaCopyEngine, jobs: list[CopyJob] | list[_RawJob]
) -> tuple[float, float, int]:
    """Submit ``jobs``; (wall seconds to the last completion, loop seconds in submit, bad)."""
    loop = asyncio.get_running_loop()
    futs: list[asyncio.Future[BaseException | None]] = []
    in_submit = 0.0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for job in jobs:
        fut: asyncio.Future[BaseException | None] = loop.create_future()
        s = time.perf_counter()
        engine.submit(job, fut.set_result)  # type: ignore[arg-type]  # _RawJob: duck-typed
        in_submit += time.perf_counter() - s
        futs.append(fut)
    errors = await asyncio.gather(*futs)
    wall = time.perf_counter() - t0
    assert all(e is None for e in errors), errors
    return wall, in_submit, sum(len(j.bad) for j in jobs)


@dataclass(frozen=True)
class _RawJob:
    """The baseline's copy of one job's bytes, submitted through the engine (event, waiter
    thread, completion on the loop): what the engine's path costs by itself."""

    src: torch.Tensor
    dst: torch.Tensor
    bad: tuple[int, ...] = ()

    def run(self, *, non_blocking: bool = False, **_: object) -> None:
        self.dst.copy_(self.src, non_blocking=non_blocking)

    def after_event(self) -> None:
        pass


def _raw_jobs(setup: CopySetup, direction: Direction) -> list[_RawJob]:
    out, off = [], 0
    for dev, _ in setup.jobs:
        n = dev.numel() * setup.page_bytes
        d, h = setup.raw_dev[off : off + n], setup.raw_host[off : off + n]
        out.append(_RawJob(d, h) if direction is Direction.D2H else _RawJob(h, d))
        off += n
    return out


def _raw(setup: CopySetup, direction: Direction) -> float:
    """The baseline: contiguous pinned <-> device copies of the jobs' sizes, on one stream."""
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    off = 0
    with torch.cuda.stream(stream):
        for dev, _ in setup.jobs:
            n = dev.numel() * setup.page_bytes
            d, h = setup.raw_dev[off : off + n], setup.raw_host[off : off + n]
            if direction is Direction.D2H:
                h.copy_(d, non_blocking=True)
            else:
                d.copy_(h, non_blocking=True)
            off += n
    stream.synchronize()
    return time.perf_counter() - t0


async def _measure(setup: CopySetup, repeats: int) -> dict[str, dict[str, list[float]]]:
    engine = CudaCopyEngine(torch.device("cuda"))
    engine.start(asyncio.get_running_loop())
    out: dict[str, dict[str, list[float]]] = {}
    try:
        for direction in (Direction.D2H, Direction.H2D):
            for _ in range(repeats + 1):  # the first round warms up
                rnd: dict[str, tuple[float, float]] = {"raw": (_raw(setup, direction), 0.0)}
                rnd["raw via engine"] = (await transfer(engine, _raw_jobs(setup, direction)))[:2]
                for arm in ARMS:
                    jobs = [setup.job(arm, direction, d, h) for d, h in setup.jobs]
                    wall, loop_s, bad = await transfer(engine, jobs)
                    assert bad == 0, f"{arm}: {bad} pages failed their check"
                    rnd[arm] = (wall, loop_s)
                for arm, (wall, loop_s) in rnd.items():
                    cell = out.setdefault(f"{direction.value}:{arm}", {"wall": [], "loop": []})
                    cell["wall"].append(wall)
                    cell["loop"].append(loop_s)
    finally:
        await engine.aclose()
    for cell in out.values():
        cell["wall"], cell["loop"] = cell["wall"][1:], cell["loop"][1:]
    return out


def _check_sums(setup: CopySetup) -> None:
    """The device sums the slots+sums arm recorded are the reference's (a wrong sum would
    make every stored page fail its read)."""
    from aiocache_kv.storage.presum import sum_slots

    pool = setup.hosts["slots"]
    ids = np.arange(setup.pages)
    want = np.zeros_like(pool.sums)
    sum_slots(pool.raw, pool.page_bytes, ids, want)
    assert (pool.sums == want).all(), "device sums differ from the CPU reference"


def run_if_cuda(opts: CudaBenchOptions, run_loop: Callable[..., object]) -> JSON | None:
    """:func:`run` where a CUDA device exists; else say so and return None."""
    if not torch.cuda.is_available():
        print("bench cuda: skipped, no CUDA device")
        return None
    return run(opts, run_loop)


def run(opts: CudaBenchOptions, run_loop: Callable[..., object] = asyncio.run) -> JSON:
    """Run the benchmark, print its table and return the JSON-able results.

    Raises:
        RuntimeError: no CUDA device.
    """
    heading("bench cuda: copy jobs on the GPU vs the raw pinned copy (same run)")
    if not torch.cuda.is_available():
        raise RuntimeError("bench cuda needs a CUDA device")
    print(
        f"{torch.cuda.get_device_name()}; KV {LAYERS} layers x {HEADS} heads x {HEAD_DIM} "
        f"float16; {opts.mib} MiB each way in jobs of <= {JOB_BYTES // MiB} MiB; median of "
        f"{opts.repeats}; ratio = raw time / arm time."
    )
    gen = torch.Generator().manual_seed(opts.seed)
    results: JSON = {"target_ratio": TARGET_RATIO, "page_sizes": {}}
    rows = []
    for kib in opts.page_kib:
        setup = CopySetup(kib * KiB, opts.mib, gen)
        cells = run_loop(_measure(setup, opts.repeats))
        assert isinstance(cells, dict)
        _check_sums(setup)
        res: JSON = {}
        for key, cell in cells.items():
            direction, arm = key.split(":")
            raw = median(cells[f"{direction}:raw"]["wall"])
            wall = median(cell["wall"])
            gbs = setup.pages * setup.page_bytes / wall / 1e9
            r = ratio(raw, wall)
            res[key] = {"gb_s": gbs, "ratio": r, "loop_ms": median(cell["loop"]) * 1e3}
            rows.append(
                [
                    f"{kib} KiB",
                    direction,
                    arm,
                    f"{gbs:.1f}",
                    f"{r:.2f}",
                    f"{res[key]['loop_ms']:.2f}",
                ]
            )
        results["page_sizes"][str(kib)] = res
        del setup
        torch.cuda.empty_cache()
    table(["page", "direction", "arm", "GB/s", "ratio", "loop ms"], rows, align="lllrrr")
    return results
