"""``aiocache-kv bench tree --peer-sglang DIR [DIR ...]``: our serving step beside SGLang's.

Each ``DIR`` is an SGLang wheel unzipped by hand (SGLang is not a dependency)::

    pip download --no-deps sglang==0.5.15 sglang==0.5.23 -d wheels
    unzip -q wheels/sglang-0.5.15-*.whl -d wheels/sglang-0.5.15   # and the same for 0.5.23

Only ``sglang.srt.mem_cache.*`` (and the Rust ``TreeCore``'s loader) is executed from it
(:mod:`aiocache_kv.bench.peer_stubs`).  The workload is ``bench tree``'s
(:func:`aiocache_kv.bench.tree.build_sequences`: 2,000 requests, a shared 1,024-token prefix +
64-1,023 random tokens), and each request is one serving step: match, lock, allocate the
uncached part, insert, unlock (and, with events on, take the KV events).  Ours is
:func:`aiocache_kv.bench.tree.step_once` through ``HiCache`` (its real allocator, the
``insert(prefix=m)`` form); a peer's allocator is a slice of a free-list tensor.  The peers:

* a wheel with ``UnifiedRadixCache`` (0.5.23): its Python ``UnifiedTreeCore`` and its Rust
  ``TreeCore`` (SGLang's default), with the ``FULL`` component only;
* an older wheel (0.5.15): its Python ``RadixCache``.

Reported per cell (events off/on, page 1/16): microseconds per request (median of repeats,
fresh cache each; the repeats take turns between the sides) and ``peer / ours``, by the
wall clock and by this thread's CPU time (steadier on a shared machine), in one process.
"""

from __future__ import annotations

import gc
import re
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from aiocache_kv.bench.peer_stubs import sglang_wheel
from aiocache_kv.bench.report import JSON, heading, median, table
from aiocache_kv.bench.tree import build_sequences, frozen_gc, step_once
from aiocache_kv.loop import run as run_loop

#: targets of issue #27, peer / ours, per arm name prefix
TARGETS = {"0.5.15 RadixCache": 2.0, "0.5.23 Rust TreeCore": 1.0}
#: requests of the untimed warm-up run of each side and cell
WARMUP = 50


@dataclass(frozen=True)
class PeerBenchOptions:
    """Knobs of the peer benchmark."""

    wheels: tuple[Path, ...]
    page_sizes: tuple[int, ...] = (1, 16)
    events: tuple[bool, ...] = (False, True)
    sequences: int = 2000
    repeats: int = 5
    seed: int = 0


class FreeListAllocator:
    """The peers' token allocator: slices of one free-list tensor (SGLang's
    ``TokenToKVPoolAllocator`` shape, without its pool)."""

    device = "cpu"

    def __init__(self, size: int, page_size: int) -> None:
        self.page_size = page_size
        self.size = self.size_full = size
        self.free_slots = torch.arange(size, dtype=torch.int64)
        self.cursor = 0

    def alloc(self, n: int) -> torch.Tensor:
        out = self.free_slots[self.cursor : self.cursor + n]
        self.cursor += n
        return out

    def free(self, indices: torch.Tensor) -> None:
        del indices  # every request's slots are distinct; a run never reuses them

    def free_segment(self, indices: torch.Tensor, start_pos: int = 0) -> None:
        del indices, start_pos

    free_full_segment = free_segment

    def available_size(self) -> int:
        return self.size - self.cursor

    full_available_size = available_size


class _NoSession:
    """``UnifiedRadixCache.session`` (a streaming-session hook, a stub here): no session."""

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None


def wheel_version(root: Path) -> str:
    """The SGLang version of an unpacked wheel (from its ``.dist-info``), or the folder name."""
    for info in root.glob("sglang-*.dist-info"):
        m = re.match(r"sglang-(.+)\.dist-info", info.name)
        if m:
            return m.group(1)
    return root.name


#: one repeat of a side: ``(wall seconds, CPU seconds of this thread)`` for all requests
Step = Callable[[], tuple[float, float]]


def _timed(steps: Callable[[], None]) -> tuple[float, float]:
    c0, t0 = time.thread_time(), time.perf_counter()
    steps()
    return time.perf_counter() - t0, time.thread_time() - c0


def _peer_cache(
    get: Callable[[str], Any], cls: str, toks: Sequence[array[int]], p: int, ev: bool, **extra: Any
) -> tuple[Any, FreeListAllocator]:
    """A fresh SGLang cache of class ``cls`` (``module:Name``) over a free-list allocator
    large enough for every request of ``toks``; ``extra``: more ``CacheInitParams`` fields."""
    params_cls = get("sglang.srt.mem_cache.cache_init_params:CacheInitParams")
    alloc = FreeListAllocator(sum(len(t) for t in toks) + p, p)
    params = params_cls(
        disable=False,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=alloc,
        page_size=p,
        enable_kv_cache_events=ev,
        **extra,
    )
    return get(cls)(params), alloc


def _radix_steps(get: Callable[[str], Any], seqs: Sequence[list[int]], p: int, ev: bool) -> Step:
    """One repeat of SGLang's Python ``RadixCache`` (0.5.15 and before)."""
    key_cls = get("sglang.srt.mem_cache.radix_cache:RadixKey")
    match_cls = get("sglang.srt.mem_cache.base_prefix_cache:MatchPrefixParams")
    insert_cls = get("sglang.srt.mem_cache.base_prefix_cache:InsertParams")
    toks = [array("q", s[: len(s) // p * p]) for s in seqs]

    def once() -> tuple[float, float]:
        cache, alloc = _peer_cache(get, "sglang.srt.mem_cache.radix_cache:RadixCache", toks, p, ev)
        cat = torch.cat

        def steps() -> None:
            for t in toks:
                m = cache.match_prefix(match_cls(key=key_cls(t)))
                node = m.last_device_node
                cache.inc_lock_ref(node)
                rows = m.device_indices
                new = alloc.alloc(len(t) - len(rows))
                cache.insert(insert_cls(key=key_cls(t), value=cat([rows, new])))
                cache.dec_lock_ref(node)
                if ev:
                    cache.take_events()

        with frozen_gc():
            return _timed(steps)

    return once


def _unified_steps(
    get: Callable[[str], Any], seqs: Sequence[list[int]], p: int, ev: bool, backend: str
) -> Step:
    """One repeat of SGLang's ``UnifiedRadixCache`` (0.5.23) on the ``backend`` core."""
    key_cls = get("sglang.srt.mem_cache.radix_cache:RadixKey")
    match_cls = get("sglang.srt.mem_cache.base_prefix_cache:MatchPrefixParams")
    insert_cls = get("sglang.srt.mem_cache.base_prefix_cache:InsertParams")
    full = get("sglang.srt.mem_cache.unified_cache.component_type:ComponentType").FULL
    toks = [array("q", s[: len(s) // p * p]) for s in seqs]

    def make() -> tuple[Any, FreeListAllocator]:
        cache, alloc = _peer_cache(
            get,
            "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache",
            toks,
            p,
            ev,
            tree_components=(full,),
            tree_core_backend=backend,
        )
        cache.session = _NoSession()
        return cache, alloc

    probe, _ = make()
    core = type(probe.tree_core).__name__
    want = "RustUnifiedTreeCore" if backend == "rust" else "UnifiedTreeCore"
    if core != want:
        raise RuntimeError(f"asked for the {backend} TreeCore, got {core}")

    def once() -> tuple[float, float]:
        cache, alloc = make()
        cat = torch.cat

        def steps() -> None:
            for t in toks:
                key = key_cls(t)
                m = cache.match_prefix(match_cls(key=key))
                lock = cache.lock(m.last_device_node)
                n0 = m.device_prefix_len
                rows = cache.path_device_indices(m.last_device_node)[:n0]
                new = alloc.alloc(len(t) - n0)
                cache.insert(insert_cls(key=key, value=cat([rows, new]), prev_prefix_len=n0))
                cache.unlock(lock)
                if ev:
                    cache.take_events()

        with frozen_gc():
            return _timed(steps)

    return once


def _arms(
    get: Callable[[str], Any], ver: str
) -> list[tuple[str, Callable[[bool, int, Sequence[list[int]]], Step]]]:
    """The peer arms of one wheel: ``(name, make(events, page_size, seqs) -> one repeat)``."""
    if get("sglang.srt.mem_cache.unified_cache.component_type:ComponentType"):
        return [
            (
                f"{ver} UnifiedRadixCache Python core",
                lambda ev, p, sq: _unified_steps(get, sq, p, ev, "python"),
            ),
            (f"{ver} Rust TreeCore", lambda ev, p, sq: _unified_steps(get, sq, p, ev, "rust")),
        ]
    return [(f"{ver} RadixCache", lambda ev, p, sq: _radix_steps(get, sq, p, ev))]


def _ours(seqs: Sequence[list[int]], p: int, ev: bool) -> tuple[float, float]:
    cpu: list[float] = []
    wall = run_loop(step_once(seqs, p, ev, cpu=cpu))
    return wall, cpu[0]


def run(opts: PeerBenchOptions) -> JSON:
    """Measure ours and every peer arm of every wheel; print the table; return the JSON.

    Raises:
        FileNotFoundError: a wheel folder is missing or not an unpacked SGLang wheel.
    """
    for root in opts.wheels:
        if not (root / "sglang" / "srt" / "mem_cache").is_dir():
            raise FileNotFoundError(
                f"--peer-sglang {root}: not an unpacked SGLang wheel (no sglang/srt/mem_cache)."
                " Get one with `pip download --no-deps sglang==0.5.23 -d WHEELS` and "
                "`unzip -q WHEELS/sglang-0.5.23-*.whl -d WHEELS/sglang-0.5.23`."
            )
    heading("bench tree --peer-sglang: one serving step per request, SGLang vs aiocache_kv")
    seqs = build_sequences(opts.sequences, opts.seed)
    n = len(seqs)
    cells = [(ev, p) for ev in opts.events for p in opts.page_sizes]
    runs: dict[str, dict[tuple[bool, int], list[tuple[float, float]]]] = {
        "aiocache_kv": {c: [] for c in cells}
    }
    steps: dict[tuple[str, bool, int], Step] = {}
    # repeats take turns (ours, then each wheel's arms), so load drifts hit every side alike
    for ev, p in cells:
        _ours(seqs[:WARMUP], p, ev)
    for _ in range(opts.repeats):
        for ev, p in cells:
            runs["aiocache_kv"][ev, p].append(_ours(seqs, p, ev))
        for root in opts.wheels:
            with sglang_wheel(root) as get:
                for name, make in _arms(get, wheel_version(root)):
                    for ev, p in cells:
                        once = steps.get((name, ev, p))
                        if once is None:  # first use: warm up (SGLang builds its C++ hash)
                            make(ev, p, seqs[:WARMUP])()
                            once = steps[name, ev, p] = make(ev, p, seqs)
                        runs.setdefault(name, {c: [] for c in cells})[ev, p].append(once())
            gc.collect()
    med = {
        name: {c: (median([w for w, _ in v]), median([u for _, u in v])) for c, v in cells_.items()}
        for name, cells_ in runs.items()
    }
    return _report(med, cells, n, opts)


def _verdict(name: str, r: float) -> tuple[str, str]:
    target = next((v for k, v in TARGETS.items() if name.startswith(k)), None)
    if target is None:
        return "-", ""
    met = r >= target if target > 1 else r > target
    return f"{'>=' if target > 1 else '>'} {target:.1f}x", "met" if met else "MISSED"


def _report(
    secs: dict[str, dict[tuple[bool, int], tuple[float, float]]],
    cells: list[tuple[bool, int]],
    n: int,
    opts: PeerBenchOptions,
) -> JSON:
    ours = secs["aiocache_kv"]
    rows: list[list[object]] = []
    out: JSON = {"sequences": n, "repeats": opts.repeats, "seed": opts.seed, "arms": {}}
    for name, by_cell in secs.items():
        res: JSON = {}
        for ev, p in cells:
            (wall, cpu), (o_wall, o_cpu) = by_cell[ev, p], ours[ev, p]
            r, rc = wall / o_wall, cpu / o_cpu
            peer = name != "aiocache_kv"
            target, verdict = _verdict(name, r) if peer else ("-", "")
            rows.append(
                [
                    name,
                    "on" if ev else "off",
                    p,
                    f"{wall / n * 1e6:.1f}",
                    f"{r:.2f}x" if peer else "-",
                    f"{cpu / n * 1e6:.1f}",
                    f"{rc:.2f}x" if peer else "-",
                    target,
                    verdict,
                ]
            )
            res[f"events_{'on' if ev else 'off'}_page_{p}"] = {
                "us_per_request": wall / n * 1e6,
                "cpu_us_per_request": cpu / n * 1e6,
                "ratio": r,
                "cpu_ratio": rc,
            }
        out["arms"][name] = res
    table(
        ["arm", "events", "page", "us/req", "peer/ours", "cpu us/req", "cpu ratio", "target", ""],
        rows,
        align="llrrrrrrl",
    )
    print(
        f"median of {opts.repeats} repeats (taking turns), fresh cache each, {n} requests; "
        "ratios > 1: ours is faster; the verdict reads the wall-clock ratio (cpu: this "
        "thread's CPU time, steadier on a busy machine)"
    )
    return out


__all__ = ["FreeListAllocator", "PeerBenchOptions", "run", "wheel_version"]
