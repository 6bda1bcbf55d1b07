"""Benchmark of device<->host page copies, as a ratio against a raw gather measured in the run.

For each page size (64 KiB, 256 KiB, 1 MiB of KV per page, all layers) the suite moves the
same number of bytes (``--mib``, default 256 MiB) several ways and reports GB/s and the ratio
against the **baseline**: ``torch.index_select`` of the same number of random pages of the
same size into a preallocated buffer (a memcpy-speed gather; MOONCAKE.md "raw copy").

* ``kernel d2h/h2d random`` - the cache's copy kernels (``device_to_host`` /
  ``host_to_device``) on random source pages into ascending destination pages: the worst case,
  one ``copy_`` per page.
* ``kernel d2h/h2d runs`` - the same kernels on consecutive pages, as the allocator hands them
  out: one strided ``copy_`` per run.
* ``cache write-through`` / ``cache load-back`` - the whole path through ``HiCache``: insert
  (write-through policy) until every ack landed, and ``load_back`` of the demoted pages, with
  the copies on the ``ThreadCopyEngine`` worker thread and the acks applied on the loop.

Then the event-loop lag: a ticker coroutine sleeps 1 ms in a loop and records how late it
wakes while ``--lag-mib`` (default 1 GiB) moves through write-through; p99 against the same
ticker on an idle loop (target <= 2 ms).

The KV geometry is 4 layers x 8 KV heads x head_dim 128 in float16 (16 KiB per token), so a
64 KiB page is 4 tokens and a 1 MiB page is 64 tokens.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from aiocache_kv.bench.report import (
    JSON,
    fmt_bytes,
    fmt_ms,
    heading,
    median,
    percentile,
    ratio,
    table,
)
from aiocache_kv.cache import HiCache
from aiocache_kv.config import CacheConfig
from aiocache_kv.errors import InvalidInputError
from aiocache_kv.handles import InsertResult, MatchResult
from aiocache_kv.logs import get_logger
from aiocache_kv.loop import run as run_loop
from aiocache_kv.pools import available_host_bytes
from aiocache_kv.transfer import device_to_host, host_to_device

log = get_logger(__name__)

MiB = 1 << 20
KiB = 1 << 10
LAYERS = 4
HEADS = 8
HEAD_DIM = 128
DTYPE = torch.float16
TOKEN_BYTES = LAYERS * 2 * HEADS * HEAD_DIM * 2  # 16 KiB
TARGET_RATIO = 0.8
TARGET_LAG_P99_MS = 2.0
TICK_S = 0.001
SEQS_PER_ROUND = 16  # inserts per write-through round (each its own copy job)
#: keep this much memory free beyond what the suite allocates
HEADROOM = 2 << 30


@dataclass(frozen=True)
class TransferBenchOptions:
    """Knobs of the transfer benchmark."""

    page_kib: tuple[int, ...] = (64, 256, 1024)
    mib: int = 256
    lag_mib: int = 1024
    repeats: int = 5
    seed: int = 0


def _config(page_bytes: int, pages: int) -> CacheConfig:
    return CacheConfig(
        page_size=page_bytes // TOKEN_BYTES,
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_dim=HEAD_DIM,
        dtype=DTYPE,
        device="cpu",
        device_pages=pages,
        host_pages=pages,
        write_policy="write_through",
        enable_kv_events=False,
        host_memory_reserve_bytes=0,  # the suite checks free memory itself
    )


def _clock(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ---------------------------------------------------------------------- baseline and kernels


class _Kernels:
    """Baseline gather and the copy kernels on buffers of one page size; one timing per call.

    The baseline gathers ``pages`` random rows of a pool twice that size with
    ``torch.index_select`` into a preallocated buffer.  The kernels run on the cache's real
    layouts; their device pool is also twice as big, so random sources spread the same way.
    """

    def __init__(self, page_bytes: int, pages: int, gen: torch.Generator) -> None:
        elems = _config(page_bytes, pages).page_elems
        self.pool = torch.randn(2 * pages, page_bytes // 2, generator=gen).to(DTYPE)
        self.idx = torch.randperm(2 * pages, generator=gen)[:pages]
        self.out = torch.empty(pages, page_bytes // 2, dtype=DTYPE)
        self.device = torch.randn(LAYERS, 2, 2 * pages, elems, generator=gen).to(DTYPE)
        self.host = torch.zeros(pages, LAYERS, 2, elems, dtype=DTYPE)
        self.rand_dev = torch.randperm(2 * pages, generator=gen)[:pages]
        self.rand_host = torch.randperm(pages, generator=gen)
        self.seq = torch.arange(pages, dtype=torch.int64)
        for fn in self.ops().values():  # warm-up: every buffer touched once
            fn()
        self.check()

    def ops(self) -> dict[str, Callable[[], object]]:
        """The measured operations by result key."""
        seq = self.seq
        return {
            "baseline_gather": lambda: torch.index_select(self.pool, 0, self.idx, out=self.out),
            "kernel_d2h_random": lambda: device_to_host(self.device, self.host, self.rand_dev, seq),
            "kernel_d2h_runs": lambda: device_to_host(self.device, self.host, seq, seq),
            "kernel_h2d_random": lambda: host_to_device(
                self.host, self.device, self.rand_host, seq
            ),
            "kernel_h2d_runs": lambda: host_to_device(self.host, self.device, seq, seq),
        }

    def check(self) -> None:
        """The kernels moved the right pages."""
        device_to_host(self.device, self.host, self.rand_dev, self.seq)
        assert torch.equal(self.host[5], self.device[:, :, int(self.rand_dev[5])]), "d2h wrong"
        host_to_device(self.host, self.device, self.rand_host, self.seq)
        assert torch.equal(self.device[:, :, 7], self.host[int(self.rand_host[7])]), "h2d wrong"


# ---------------------------------------------------------------------- through HiCache


class _Tokens:
    """Fresh, never-repeating token ids so every round inserts new sequences."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> list[int]:
        start = self.next
        self.next += n
        return list(range(start, start + n))


async def _write_round(
    cache: HiCache, toks: _Tokens, pages: int, nseq: int, tick: Callable[[], object] | None = None
) -> tuple[float, list[list[int]]]:
    """Insert ``nseq`` new sequences totalling ``pages`` pages; time until every ack landed."""
    p = cache.config.page_size
    per = max(1, pages // nseq)
    seqs = [toks.take(per * p) for _ in range(pages // per)]
    slots = [cache.alloc(len(s)) for s in seqs]
    t0 = time.perf_counter()
    handles: list[InsertResult] = []
    for s, sl in zip(seqs, slots, strict=True):
        handles.append(cache.insert(s, sl))
        if tick is not None:
            await asyncio.sleep(0)  # let the ticker run between inserts, as a server would
    await cache.flush()
    elapsed = time.perf_counter() - t0
    for h in handles:
        cache.release(h)
    return elapsed, seqs


async def _load_round(cache: HiCache, seqs: Sequence[list[int]]) -> float:
    """Demote ``seqs`` to host, then time ``load_back`` of all of them, concurrently."""
    cache.evict(1 << 62)
    matches: list[MatchResult] = [cache.match_prefix(s) for s in seqs]
    assert all(
        m.device_len == 0 and m.host_len == len(s) for m, s in zip(matches, seqs, strict=True)
    ), "pages did not move to host"
    t0 = time.perf_counter()
    await asyncio.gather(*(cache.load_back(m) for m in matches))
    elapsed = time.perf_counter() - t0
    assert all(m.device_len == len(s) for m, s in zip(matches, seqs, strict=True)), (
        "load-back short"
    )
    for m in matches:
        cache.release(m)
    return elapsed


def _reset(cache: HiCache) -> None:
    cache.evict(1 << 62)
    cache.evict(1 << 62, "host")


async def measure_page_size(
    page_bytes: int, pages: int, repeats: int, gen: torch.Generator
) -> dict[str, list[float]]:
    """Every path of one page size, interleaved: each round times the baseline, the kernels
    and the cache path once, so machine noise hits them alike.  Seconds per round."""
    kernels = _Kernels(page_bytes, pages, gen)
    ops = kernels.ops()
    secs: dict[str, list[float]] = {k: [] for k in [*ops, "cache_write_through", "cache_load_back"]}
    toks = _Tokens()
    async with HiCache(_config(page_bytes, pages)) as cache:
        # warm-up round: touches every page of both pools, then empties the cache
        _, seqs = await _write_round(cache, toks, pages, SEQS_PER_ROUND)
        await _load_round(cache, seqs)
        _reset(cache)
        for _ in range(repeats):
            for key, fn in ops.items():
                secs[key].append(_clock(fn))
            t, seqs = await _write_round(cache, toks, pages, SEQS_PER_ROUND)
            secs["cache_write_through"].append(t)
            secs["cache_load_back"].append(await _load_round(cache, seqs))
            _reset(cache)
        st = cache.statistics()
        assert st.write_through_failed == 0 and st.load_back_failed == 0, "a copy failed"
    kernels.check()
    return secs


# ---------------------------------------------------------------------- event-loop lag


async def _ticker(stop: asyncio.Event, lateness: list[float]) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        t0 = loop.time()
        await asyncio.sleep(TICK_S)
        lateness.append(loop.time() - t0 - TICK_S)


async def measure_lag(lag_bytes: int, page_bytes: int, rounds: int = 5) -> JSON:
    """Loop lag while ``lag_bytes`` move through write-through, against an idle loop."""
    pages = max(1, lag_bytes // page_bytes)
    toks = _Tokens()
    idle: list[float] = []
    busy: list[float] = []
    cold: list[float] = []
    async with HiCache(_config(page_bytes, pages)) as cache:
        stop = asyncio.Event()
        task = asyncio.create_task(_ticker(stop, idle))
        await asyncio.sleep(0.3)
        stop.set()
        await task
        elapsed: list[float] = []
        for i in range(rounds + 1):  # round 0 first-touches the host pool: reported apart
            samples = cold if i == 0 else busy
            stop = asyncio.Event()
            task = asyncio.create_task(_ticker(stop, samples))
            await asyncio.sleep(0)
            t, _ = await _write_round(cache, toks, pages, 64, tick=lambda: None)
            if i:
                elapsed.append(t)
            stop.set()
            await task
            _reset(cache)
    return {
        "bytes": pages * page_bytes,
        "page_bytes": page_bytes,
        "rounds": rounds,
        "write_through_s": elapsed,
        "samples": len(busy),
        "p50_ms": percentile(busy, 50) * 1e3,
        "p99_ms": percentile(busy, 99) * 1e3,
        "max_ms": max(busy, default=0.0) * 1e3,
        "cold_samples": len(cold),
        "cold_p99_ms": percentile(cold, 99) * 1e3,
        "idle_samples": len(idle),
        "idle_p99_ms": percentile(idle, 99) * 1e3,
        "target_p99_ms": TARGET_LAG_P99_MS,
    }


# ---------------------------------------------------------------------- driver


_ROWS = (
    ("baseline_gather", "baseline: index_select random pages"),
    ("kernel_d2h_random", "kernel device_to_host, random pages"),
    ("kernel_h2d_random", "kernel host_to_device, random pages"),
    ("kernel_d2h_runs", "kernel device_to_host, page runs"),
    ("kernel_h2d_runs", "kernel host_to_device, page runs"),
    ("cache_write_through", "HiCache write-through (engine + acks)"),
    ("cache_load_back", "HiCache load_back (engine + acks)"),
)


def _fit(opts: TransferBenchOptions) -> tuple[int, int, str | None]:
    """Scale the byte counts down until they fit in available memory (with headroom)."""
    mib, lag = opts.mib, opts.lag_mib
    avail = available_host_bytes()
    note = None
    # baseline pool 2x + out 1x, kernels device 2x + host 1x, cache 2x; lag: device + host
    while mib > 1 and 8 * mib * MiB + HEADROOM > avail:
        mib //= 2
    while lag > 1 and 2 * lag * MiB + HEADROOM > avail:
        lag //= 2
    if (mib, lag) != (opts.mib, opts.lag_mib):
        note = (
            f"only {fmt_bytes(avail)} available: scaled down to {mib} MiB per measurement "
            f"and {lag} MiB for the lag test"
        )
    return mib, lag, note


def run(opts: TransferBenchOptions) -> JSON:
    """Run the transfer benchmark, print its tables and return the JSON-able results."""
    heading("bench transfer: L1 <-> L2 page copies vs raw gather (same run)")
    t_start = time.perf_counter()
    mib, lag_mib, note = _fit(opts)
    if note:
        print(note)
        log.warning("transfer_bench_scaled_down", mib=mib, lag_mib=lag_mib)
    print(
        f"KV geometry {LAYERS} layers x {HEADS} heads x {HEAD_DIM} dims, float16 "
        f"({fmt_bytes(TOKEN_BYTES)}/token); {mib} MiB moved per measurement; median of "
        f"{opts.repeats} (and best); torch threads {torch.get_num_threads()}. "
        "Ratio = GB/s / baseline GB/s of the same round (paths interleaved), median over rounds."
    )
    gen = torch.Generator().manual_seed(opts.seed)
    results: JSON = {
        "geometry": {"layers": LAYERS, "kv_heads": HEADS, "head_dim": HEAD_DIM, "dtype": "float16"},
        "bytes_per_measurement": mib * MiB,
        "repeats": opts.repeats,
        "target_ratio": TARGET_RATIO,
        "baseline": "torch.index_select of the same number of random pages of the same size",
        "page_sizes": {},
    }
    for kib in opts.page_kib:
        page_bytes = kib * KiB
        if page_bytes % TOKEN_BYTES:
            raise InvalidInputError(
                f"page size {kib} KiB is not a multiple of {TOKEN_BYTES // KiB} KiB"
            )
        pages = max(1, mib * MiB // page_bytes)
        nbytes = pages * page_bytes
        secs = run_loop(measure_page_size(page_bytes, pages, opts.repeats, gen))
        gc.collect()
        gbs = {k: nbytes / median(v) for k, v in secs.items()}
        best = {k: nbytes / min(v) for k, v in secs.items()}
        base_secs = secs["baseline_gather"]
        # per round: path GB/s over the baseline GB/s of the same round; median over rounds
        per_round = {
            k: median([b / t for b, t in zip(base_secs, v, strict=True)]) for k, v in secs.items()
        }
        results["page_sizes"][f"{kib}KiB"] = {
            "page_bytes": page_bytes,
            "page_tokens": page_bytes // TOKEN_BYTES,
            "pages": pages,
            "bytes": nbytes,
            "gbs": gbs,
            "ratio": per_round,
            "gbs_best": best,
            "ratio_best": {k: ratio(v, best["baseline_gather"]) for k, v in best.items()},
            "seconds": secs,
        }
        heading(f"{kib} KiB pages: {pages} pages, {fmt_bytes(nbytes)}")
        rows = []
        for key, label in _ROWS:
            r = per_round[key]
            verdict = "" if key == "baseline_gather" else ("met" if r >= TARGET_RATIO else "below")
            rb = ratio(best[key], best["baseline_gather"])
            rows.append(
                [
                    label,
                    f"{gbs[key] / 1e9:.2f}",
                    fmt_ms(median(secs[key])),
                    f"{r:.2f}",
                    verdict,
                    f"{best[key] / 1e9:.2f}",
                    f"{rb:.2f}",
                ]
            )
        table(
            ["path", "GB/s", "median", "ratio", f">= {TARGET_RATIO}", "best GB/s", "best ratio"],
            rows,
            align="lrrrlrr",
        )
    heading(f"event-loop lag while {lag_mib} MiB moves through write-through")
    lag = run_loop(measure_lag(lag_mib * MiB, 256 * KiB))
    results["loop_lag"] = lag
    verdict = "met" if lag["p99_ms"] <= TARGET_LAG_P99_MS else "MISSED"
    table(
        ["ticker (1 ms sleep)", "samples", "p50", "p99", "max", "target p99"],
        [
            [
                "idle loop (baseline)",
                lag["idle_samples"],
                "",
                f"{lag['idle_p99_ms']:.2f} ms",
                "",
                "",
            ],
            [
                "first write-through (cold pool)",
                lag["cold_samples"],
                "",
                f"{lag['cold_p99_ms']:.2f} ms",
                "",
                "",
            ],
            [
                f"during write-through x{lag['rounds']} (warm)",
                lag["samples"],
                f"{lag['p50_ms']:.2f} ms",
                f"{lag['p99_ms']:.2f} ms",
                f"{lag['max_ms']:.2f} ms",
                f"<= {TARGET_LAG_P99_MS:.0f} ms {verdict}",
            ],
        ],
    )
    wt = median(lag["write_through_s"])
    rate = lag["bytes"] / wt / 1e9
    print(f"write-through of {fmt_bytes(lag['bytes'])}: {fmt_ms(wt)} ({rate:.2f} GB/s)")
    results["elapsed_s"] = time.perf_counter() - t_start
    print(f"(transfer bench took {results['elapsed_s']:.1f} s)")
    return results
