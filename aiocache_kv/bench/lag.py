"""``aiocache-kv bench lag``: event-loop lag while 1 GiB is written through and the batched
engine serves a full batch (issue #27: p99 <= 1 ms).

One :class:`~aiocache_kv.cache.HiCache` (write-through, device and host pools) and one
:class:`~aiocache_kv.serving.Engine` over it, a random-weight GPT-2 on CPU, all on one loop.
The same ticker (:class:`~aiocache_kv.bench.engine_sides.LagProbe`: a task sleeping 1 ms in a
loop, recording how late it wakes) runs in each arm:

* ``idle`` - nothing else runs (the engine is open and idle);
* ``write`` - ``--lag-mib`` (default 1 GiB) written through that cache alone: fresh sequences
  of :attr:`LagBenchOptions.write_pages` pages inserted under their own tenant, at most
  :attr:`LagBenchOptions.writes_in_flight` inserts whose ack has not landed, each released
  when it lands (the device pool demotes them when it needs room, the host pool drops them);
* ``engine+write`` - the same bytes through the same cache while the engine serves a full
  batch: ``max_running + 2`` clients each send a fresh random prompt
  (:attr:`LagBenchOptions.prompt_tokens`, long enough that prefill chunks and decodes share
  steps) and send the next one when the reply arrives, so the batch stays full and the
  engine's own inserts write through too; the arm ends when the writer's pages and the pages
  the engine inserted meanwhile reach the target (the cache's device->host bytes are
  reported);
* ``engine`` - the full batch alone, for as long as the ``engine+write`` arm took, at least
  :attr:`LagBenchOptions.engine_s`.

``engine+write`` and ``engine`` run a second time without the ticker (each pair alternates
which goes first, round by round): the engine's throughput (generated and computed tokens per
second) with and without it shows whether the ticker slows the engine (the ``engine`` pair,
seconds long, is the steadier comparison; an ``engine+write`` arm lasts as long as its bytes
take to write, a few steps).  Every arm runs ``rounds`` times; the
lag is over every round's samples, the other numbers are medians.  Only samples taken while
the batch was full and (in the write arms) the writer was running count; they are all in
the JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import torch

from aiocache_kv.bench.engine_sides import LagProbe
from aiocache_kv.bench.report import JSON, fmt_bytes, heading, median, percentile, table
from aiocache_kv.cache import HiCache
from aiocache_kv.errors import CapacityError, EngineClosedError, InvalidInputError
from aiocache_kv.handles import InsertResult
from aiocache_kv.logs import get_logger
from aiocache_kv.loop import run as run_loop
from aiocache_kv.models import GPT2Spec, build_gpt2, cache_config_for
from aiocache_kv.pools import available_host_bytes
from aiocache_kv.priority import IdleCopies, idle_copies
from aiocache_kv.serving import Engine
from aiocache_kv.serving.request import RequestState

__all__ = ["ARMS", "NO_TICKER", "SPECS", "TARGET_LAG_P99_MS", "LagBenchOptions", "run"]

log = get_logger(__name__)

MiB = 1 << 20
TARGET_LAG_P99_MS = 1.0
#: the ticker arms, in the order they run, with what each is
ARMS = {
    "idle": "idle loop (engine open, no requests)",
    "write": "write-through alone",
    "engine+write": "write-through + engine, full batch",
    "engine": "engine, full batch alone",
}
#: ``small`` is the demo's GPT-2 (6 layers x 4 heads x 64, float32: 192 KiB per 16-token
#: page); ``tiny`` is for tests
SPECS = {
    "small": GPT2Spec(n_layer=6, n_head=4, n_embd=256, vocab_size=50257, n_positions=1024),
    "tiny": GPT2Spec(n_layer=2, n_head=2, n_embd=64, vocab_size=512, n_positions=256),
}
#: the arms run again without the ticker, for the engine's throughput
NO_TICKER = ("engine+write_no_ticker", "engine_no_ticker")
WRITER_TENANT = "bench-lag-writer"
#: the loop an arm runs on, by ``LagBenchOptions.stdlib_loop``
LOOPS = {
    False: "precise loop (aiocache_kv.loop)",
    True: "asyncio's default loop (waits rounded up to 1 ms)",
}
#: seconds between looks at whether the batch is full (a bench driver, not a test)
POLL = 0.005
#: seconds the aborted requests of an arm may take to leave the engine (a step or two)
DRAIN_S = 60.0
#: keep this much memory free beyond the pools
HEADROOM = 2 << 30


@dataclass(frozen=True)
class LagBenchOptions:
    """Knobs of ``bench lag``."""

    lag_mib: int = 1024
    max_running: int = 12
    max_batch_tokens: int = 256
    prompt_tokens: tuple[int, int] = (96, 256)  #: each prompt: uniform in [lo, hi]
    reply_tokens: int = 32
    page_size: int = 16
    device_pages: int = 1024
    host_pages: int = 2048
    write_pages: int = 16  #: pages per writer insert
    writes_in_flight: int = 4
    idle_s: float = 0.5
    rounds: int = 3  #: every arm this many times
    engine_s: float = 3.0  #: seconds of each ``engine`` arm, at least
    #: the engine's ``switch_interval`` (seconds; ``None``: the interpreter's, 5 ms)
    switch_interval: float | None = None
    #: the copy worker's copies on idle helpers (``CacheConfig.worker_idle``); ``False``: it
    #: copies itself at nice +10
    worker_idle: bool = True
    #: asyncio's default loop (``epoll_wait``: waits rounded up to whole milliseconds)
    #: instead of :func:`aiocache_kv.loop.new_event_loop`'s precise one
    stdlib_loop: bool = False
    size: str = "small"
    seed: int = 0


class _Writer:
    """Extra write-through traffic: fresh sequences under :data:`WRITER_TENANT`."""

    def __init__(self, cache: HiCache, pages: int, depth: int, first: int) -> None:
        self.cache = cache
        self.tokens = pages * cache.config.page_size
        self.depth = depth
        self.next = first  #: never-repeating token ids: every insert writes new pages
        self.pages_written = 0

    def _fresh(self) -> list[int]:
        start, self.next = self.next, self.next + self.tokens
        return list(range(start, start + self.tokens))

    async def _land(self, h: InsertResult) -> None:
        if h.write_through is not None:
            await h.write_through
        self.cache.release(h)

    async def write(self, done: Callable[[], bool]) -> None:
        """Insert until ``done()``, yielding to the loop after each insert; every insert has
        landed and been released when it returns."""
        cache = self.cache
        pending: deque[InsertResult] = deque()
        try:
            while not done():
                try:
                    rows = cache.alloc(self.tokens)
                except CapacityError:  # the pool waits for acks: land ours first
                    if pending:
                        await self._land(pending.popleft())
                        continue
                    rows = await cache.alloc_wait(self.tokens)
                pending.append(cache.insert(self._fresh(), rows, tenant=WRITER_TENANT))
                self.pages_written += self.tokens // cache.config.page_size
                if len(pending) >= self.depth:
                    await self._land(pending.popleft())
                await asyncio.sleep(0)  # let the loop's other tasks run between inserts
        finally:
            while pending:
                await self._land(pending.popleft())


class _Load:
    """Keeps ``engine``'s batch full: ``clients`` tasks each send a fresh random prompt and
    the next one when its reply arrived."""

    def __init__(self, engine: Engine, opts: LagBenchOptions, vocab: int, rng: random.Random):
        self.engine = engine
        self.opts = opts
        self.vocab = vocab
        self.rng = rng
        self.tasks: list[asyncio.Task[None]] = []

    def full(self) -> bool:
        """Whether the batch holds ``max_running`` running requests."""
        running = sum(r.state is RequestState.RUNNING for r in self.engine.queues.running)
        return running >= self.engine.max_running

    def drained(self) -> bool:
        """Whether the engine holds no request (the aborted ones settled)."""
        q = self.engine.queues
        return not (q.running or q.waiting or q.admitting)

    async def _client(self) -> None:
        lo, hi = self.opts.prompt_tokens
        while True:
            prompt = [self.rng.randrange(self.vocab - 1) for _ in range(self.rng.randint(lo, hi))]
            await self.engine.generate(prompt, max_new_tokens=self.opts.reply_tokens)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[_Load]:
        """Clients run in the block, which starts once the batch is full."""
        self.tasks = [
            asyncio.create_task(self._client()) for _ in range(self.engine.max_running + 2)
        ]
        try:
            while not self.full():
                for t in self.tasks:
                    if t.done():
                        t.result()  # a client failed: raise it here
                await asyncio.sleep(POLL)
            yield self
        finally:
            for t in self.tasks:
                t.cancel()
            for t in self.tasks:
                with contextlib.suppress(asyncio.CancelledError, EngineClosedError):
                    await t
            deadline = time.perf_counter() + DRAIN_S
            while not self.drained():  # the next arm starts from an empty engine
                if time.perf_counter() > deadline:
                    raise RuntimeError(f"the engine still holds requests after {DRAIN_S} s")
                await asyncio.sleep(POLL)


def _lag_stats(ticker: bool, busy: list[float], every: list[float]) -> JSON:
    if not ticker:
        return {"samples": 0, "counted": 0}
    return {
        "samples": len(every),
        "counted": len(busy),  # taken while the arm's load was on (batch full / writer on)
        "p50_ms": percentile(busy, 50) * 1e3,
        "p99_ms": percentile(busy, 99) * 1e3,
        "max_ms": max(busy, default=0.0) * 1e3,
        "all_p99_ms": percentile(every, 99) * 1e3,
        "samples_ms": [round(x * 1e3, 4) for x in busy],
    }


def _merge(runs: list[JSON]) -> JSON:
    """One arm over its rounds: the lag of every round's samples pooled, the other numbers
    the median over rounds (each round's throughput listed too)."""
    out: JSON = {"ticker": runs[0]["ticker"], "rounds": len(runs)}
    for key, value in runs[0].items():
        if key not in ("ticker", "_busy", "_all") and isinstance(value, (int, float)):
            out[key] = median([r[key] for r in runs])
    if "computed_tok_s" in out:
        out["computed_tok_s_rounds"] = [r["computed_tok_s"] for r in runs]
    busy = [x for r in runs for x in r["_busy"]]
    out["lag"] = _lag_stats(out["ticker"], busy, [x for r in runs for x in r["_all"]])
    return out


class _Bench:
    """The arms, over one cache and one engine."""

    def __init__(self, opts: LagBenchOptions, cache: HiCache, engine: Engine, vocab: int):
        self.opts = opts
        self.cache = cache
        self.engine = engine
        self.vocab = vocab
        self.rng = random.Random(opts.seed)
        self.target = opts.lag_mib * MiB
        self.next_token = 0  #: the writers' token ids continue from here

    def _d2h(self) -> int:
        return self.cache.statistics().bytes_device_to_host

    async def write_bytes(self, nbytes: int) -> tuple[float, int, int]:
        """Write ``nbytes`` through (counting the pages the engine inserts meanwhile: its
        prompts are random, so each is new and written through); (seconds, bytes the cache
        wrote through, writer bytes)."""
        writer = _Writer(
            self.cache, self.opts.write_pages, self.opts.writes_in_flight, self.next_token
        )
        counters = self.engine.counters  # a plain counter read: statistics() costs ~100 us
        pages = nbytes // self.cache.config.page_bytes
        e0, b0, t0 = counters.inserted_pages, self._d2h(), time.perf_counter()
        try:
            await writer.write(lambda: writer.pages_written + counters.inserted_pages - e0 >= pages)
        finally:
            self.next_token = writer.next
        return (
            time.perf_counter() - t0,
            self._d2h() - b0,
            writer.pages_written * self.cache.config.page_bytes,
        )

    async def arm(self, name: str, ticker: bool, seconds: float = 0.0) -> JSON:
        """Run one arm; its lag and, with the engine, its throughput."""
        engine = "engine" in name
        load = _Load(self.engine, self.opts, self.vocab, self.rng)
        writing = [False]

        def busy() -> bool:
            return (not engine or load.full()) and (writing[0] or "write" not in name)

        probe = LagProbe(busy) if ticker else None
        out: JSON = {"ticker": ticker}
        async with contextlib.AsyncExitStack() as stack:
            if engine:
                await stack.enter_async_context(load.running())
            s0 = self.engine.statistics()
            if probe is not None:
                await stack.enter_async_context(probe.running())
            t0 = time.perf_counter()
            if "write" in name:
                writing[0] = True
                secs, nbytes, own = await self.write_bytes(self.target)
                writing[0] = False
                out.update(write_s=secs, bytes=nbytes, writer_bytes=own, gbs=nbytes / secs / 1e9)
            else:
                await asyncio.sleep(seconds)
            wall = time.perf_counter() - t0
            s1 = self.engine.statistics()
        out["wall_s"] = wall
        if engine:
            gen, comp = s1.generated_tokens - s0.generated_tokens, s1.step_tokens - s0.step_tokens
            out.update(
                steps=s1.steps - s0.steps,
                generated_tokens=gen,
                computed_tokens=comp,
                generated_tok_s=gen / wall,
                computed_tok_s=comp / wall,
                engine_bytes_inserted=(s1.inserted_pages - s0.inserted_pages)
                * self.cache.config.page_bytes,
            )
        out["_busy"] = probe.lags(busy_only=True) if probe is not None else []
        out["_all"] = probe.lags() if probe is not None else []
        return out


def _check(opts: LagBenchOptions) -> None:
    lo, hi = opts.prompt_tokens
    spec = SPECS.get(opts.size)
    if spec is None or not 1 <= lo <= hi or opts.lag_mib < 1 or opts.rounds < 1:
        raise InvalidInputError(
            f"size must be one of {tuple(SPECS)}, prompt_tokens 1 <= lo <= hi, lag_mib and "
            f"rounds >= 1; got size={opts.size!r}, prompt_tokens={opts.prompt_tokens}, "
            f"lag_mib={opts.lag_mib}, rounds={opts.rounds}"
        )
    need = hi + opts.reply_tokens
    if need > spec.n_positions:
        raise InvalidInputError(f"prompt + reply ({need}) exceed the model's {spec.n_positions}")


async def measure(opts: LagBenchOptions, model: Any) -> JSON:
    """Every arm on one cache and one engine over ``model`` (built off the loop: see
    :func:`run`); the JSON of :func:`run` less the printing."""
    _check(opts)
    spec = SPECS[opts.size]
    cfg = cache_config_for(
        model,
        page_size=opts.page_size,
        device_pages=opts.device_pages,
        host_pages=opts.host_pages,
        write_policy="write_through",
        host_memory_reserve_bytes=0,
        worker_idle=opts.worker_idle,
        namespace="bench-lag",
        enable_kv_events=False,
    )
    kw: dict[str, Any] = dict(
        max_batch_tokens=opts.max_batch_tokens,
        max_running=opts.max_running,
        switch_interval=opts.switch_interval,
    )
    load0 = os.getloadavg()
    idle0 = idle_copies()
    async with HiCache(cfg) as cache, Engine(model, cache, **kw) as engine:
        bench = _Bench(opts, cache, engine, spec.vocab_size)
        # warm-up, untimed: every host page touched once, one engine request served
        await bench.write_bytes(opts.host_pages * cfg.page_bytes)
        await engine.generate(list(range(opts.prompt_tokens[0])), max_new_tokens=2)
        runs: dict[str, list[JSON]] = {key: [] for key in [*ARMS, *NO_TICKER]}
        for i in range(opts.rounds):
            runs["idle"].append(await bench.arm("idle", True, opts.idle_s))
            runs["write"].append(await bench.arm("write", True))
            first = i % 2 == 0  # the arms with and without the ticker alternate who goes first
            for ticker in (True, False) if first else (False, True):
                key = "engine+write" if ticker else "engine+write_no_ticker"
                runs[key].append(await bench.arm("engine+write", ticker))
            wall = max(opts.engine_s, runs["engine+write"][-1]["wall_s"])
            for ticker in (True, False) if first else (False, True):
                key = "engine" if ticker else "engine_no_ticker"
                runs[key].append(await bench.arm("engine", ticker, wall))
        arms = {key: _merge(r) for key, r in runs.items()}
        engine.check_invariants()
        st = cache.statistics()
        assert st.write_through_failed == 0, f"{st.write_through_failed} write-throughs failed"
        failed = engine.statistics().failed
        assert failed == 0, f"{failed} engine requests failed"
    return {
        "model": {"n_layer": spec.n_layer, "n_head": spec.n_head, "n_embd": spec.n_embd},
        "page_bytes": cfg.page_bytes,
        "target_bytes": opts.lag_mib * MiB,
        "max_running": opts.max_running,
        "max_batch_tokens": opts.max_batch_tokens,
        "prompt_tokens": list(opts.prompt_tokens),
        "reply_tokens": opts.reply_tokens,
        "model_threads": engine.model_threads,
        "torch_threads": torch.get_num_threads(),
        "copy_worker": f"nice +{cfg.worker_nice}, copies on idle helpers"
        if opts.worker_idle
        else f"nice +{cfg.worker_nice}",
        "idle_copies": {
            name: b - a for name, a, b in zip(IdleCopies._fields, idle0, idle_copies(), strict=True)
        },
        "arms": arms,
        "rounds": opts.rounds,
        "load_average": {"start": load0[0], "end": os.getloadavg()[0], "cpus": os.cpu_count()},
        "target_p99_ms": TARGET_LAG_P99_MS,
    }


def _fit(opts: LagBenchOptions) -> tuple[LagBenchOptions, str | None]:
    """Fewer pool pages if the pools would not fit in available memory (with headroom)."""
    spec = SPECS.get(opts.size, SPECS["small"])
    per_page = spec.n_layer * 2 * spec.n_embd * 4 * opts.page_size  # float32 K and V
    avail = available_host_bytes()
    dev, host = opts.device_pages, opts.host_pages
    while host > dev and (dev + host) * per_page + HEADROOM > avail:
        host //= 2
    if (dev, host) == (opts.device_pages, opts.host_pages):
        return opts, None
    note = f"only {fmt_bytes(avail)} available: host pool scaled down to {host} pages"
    return LagBenchOptions(**{**opts.__dict__, "host_pages": max(host, dev)}), note


def run(opts: LagBenchOptions) -> JSON:
    """Run ``bench lag``, print its table and return the JSON-able results."""
    opts, note = _fit(opts)
    heading(
        f"bench lag: event-loop lag, {opts.lag_mib} MiB written through with and without a full "
        "engine batch (same cache, same loop)"
    )
    if note:
        print(note)
    _check(opts)
    t_start = time.perf_counter()
    model = build_gpt2(SPECS[opts.size])  # before the loop: building reads files
    res = (asyncio.run if opts.stdlib_loop else run_loop)(measure(opts, model))
    res["loop"] = LOOPS[opts.stdlib_loop]
    arms = res["arms"]
    print(
        f"GPT-2 {opts.size} on CPU ({res['model_threads']} model thread(s), copy worker at "
        f"{res['copy_worker']}; {res['loop']}), "
        f"max_running {opts.max_running} (+2 queued), prompts {opts.prompt_tokens[0]}-"
        f"{opts.prompt_tokens[1]} tokens, replies {opts.reply_tokens}, "
        f"{fmt_bytes(res['page_bytes'])} pages; ticker sleeps 1 ms; counted samples: "
        f"batch full and writer running; {opts.rounds} rounds (lag pooled, throughput and GB/s "
        f"medians); load average {res['load_average']['start']:.1f} -> "
        f"{res['load_average']['end']:.1f} on {res['load_average']['cpus']} CPUs."
    )
    rows = []
    for key, label in ARMS.items():
        a = arms[key]
        lag = a["lag"]
        moved = f"{fmt_bytes(a['bytes'])} @ {a['gbs']:.2f} GB/s" if "bytes" in a else ""
        verdict = "met" if lag["p99_ms"] <= TARGET_LAG_P99_MS else "MISSED"
        rows.append(
            [
                label,
                lag["counted"],
                f"{lag['p50_ms']:.2f} ms",
                f"{lag['p99_ms']:.2f} ms",
                f"{lag['max_ms']:.2f} ms",
                moved,
                f"{a['generated_tok_s']:.0f} / {a['computed_tok_s']:.0f}"
                if "generated_tok_s" in a
                else "",
                f"<= {TARGET_LAG_P99_MS:g} ms {verdict}" if key != "idle" else "",
            ]
        )
    table(
        ["arm", "samples", "p50", "p99", "max", "written through", "tok/s gen / run", "target"],
        rows,
        align="lrrrrrrl",
    )
    ratios = {"engine": "ticker_throughput_ratio", "engine+write": "ticker_throughput_ratio_write"}
    for key, label in ratios.items():
        on, off = arms[key], arms[f"{key}_no_ticker"]
        ratio = on["computed_tok_s"] / off["computed_tok_s"] if off["computed_tok_s"] else 0.0
        res[label] = ratio
        print(
            f"{key}: engine throughput with the ticker {on['generated_tok_s']:.0f} generated / "
            f"{on['computed_tok_s']:.0f} computed tok/s, without {off['generated_tok_s']:.0f} / "
            f"{off['computed_tok_s']:.0f} (ratio {ratio:.2f}, {on['wall_s']:.1f} s arms)"
        )
    ew = arms["engine+write"]
    print(
        f"the engine's own inserts: {fmt_bytes(ew['engine_bytes_inserted'])} of the "
        f"{fmt_bytes(ew['bytes'])} written through"
    )
    if opts.worker_idle:
        idle = res["idle_copies"]
        print(
            f"idle helpers: {idle['copies']} copies, {idle['relieved']} relieved by the worker "
            f"({idle['relieved_chunks']} chunks)"
        )
    res["elapsed_s"] = time.perf_counter() - t_start
    print(f"(lag bench took {res['elapsed_s']:.1f} s)")
    return res
