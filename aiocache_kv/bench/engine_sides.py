"""The sides of ``aiocache-kv bench engine``: one multi-turn chat workload served three ways.

* :func:`serve_engine` - :class:`~aiocache_kv.serving.Engine` over a fresh ``HiCache``, every
  conversation concurrent (continuous batching, chunked prefill, shared prefixes);
* :func:`serve_sequential` - :meth:`CachedLM.generate <aiocache_kv.models.CachedLM.generate>`
  over a fresh ``HiCache`` of the same layout, one request at a time behind a lock (a single
  serving loop: the conversations still send concurrently, their requests queue);
* :func:`serve_transformers` - ``transformers``' own continuous batching
  (``model.init_continuous_batching``: a ``ContinuousBatchingManager`` running its background
  thread) with its prefix sharing on, driven from asyncio (``register_result_handler``).

Every side runs :func:`drive`: each conversation sends its next turn (the conversation so far
plus a new user message) only once its previous reply arrived.  Each side returns a
:class:`SideRun` of per-request :class:`Turn` records; :mod:`aiocache_kv.bench.engine` turns
them into the report.

The engine side also measures the engine's own CPU time on the loop thread
(:class:`TaskCpu`: the CPU time of every step of the step-loop task and of the admission
tasks, read with ``time.thread_time``) and the event loop's lag (:class:`LagProbe`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Generator, Iterator
from typing import Any, TypeVar

import anyio

from aiocache_kv.cache import HiCache
from aiocache_kv.config import CacheConfig
from aiocache_kv.models import CachedLM
from aiocache_kv.serving import Engine

T = TypeVar("T")

__all__ = [
    "ENGINE_TASKS",
    "LagProbe",
    "Served",
    "SideRun",
    "TaskCpu",
    "Turn",
    "Workload",
    "drive",
    "serve_engine",
    "serve_sequential",
    "serve_transformers",
]

#: the engine's loop-side tasks whose CPU time is the engine's own work: task-name prefix ->
#: account (the names the engine gives its tasks; the step loop runs serially with the forward
#: passes, admission overlaps them)
ENGINE_TASKS = {
    "aiocache_kv.engine.steps": "step_loop",
    "aiocache_kv.engine.admit-": "admission",
    "aiocache_kv.engine.prefetch-": "admission",
}
#: seconds the lag probe sleeps between samples
LAG_INTERVAL = 0.001
#: seconds a ``transformers`` request may take before the side gives up on it
TRANSFORMERS_TIMEOUT = 600.0


@dataclasses.dataclass(frozen=True)
class Workload:
    """A seeded multi-turn chat: ``users[c][t]`` is conversation ``c``'s ``t``-th message."""

    system: list[int]
    users: list[list[list[int]]]
    reply_tokens: int
    warmup: list[int]  #: an unrelated prompt each side serves once, untimed

    @property
    def requests(self) -> int:
        """Requests in the workload."""
        return sum(len(turns) for turns in self.users)

    def longest(self) -> int:
        """KV rows of the longest request (its prompt and reply)."""
        r = self.reply_tokens
        return max(
            len(self.system) + sum(len(u) for u in turns) + len(turns) * r for turns in self.users
        )


@dataclasses.dataclass(frozen=True)
class Served:
    """What a side reports for one request (seconds from its submission)."""

    tokens: list[int]
    ttft: float
    itl: list[float]
    latency: float  #: submission to the reply in the caller's hands
    reused: int  #: prompt tokens whose KV was not computed for this request
    computed: int  #: prompt tokens the model ran for it


@dataclasses.dataclass(frozen=True)
class Turn:
    """One request of the workload as a side served it."""

    conversation: int
    turn: int
    prompt_len: int
    served: Served


@dataclasses.dataclass
class SideRun:
    """One side's run: its requests, wall time, side-specific numbers, or its error."""

    turns: list[Turn] = dataclasses.field(default_factory=list)
    wall: float = 0.0
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: str | None = None


Serve = Callable[[list[int]], Awaitable[Served]]


async def drive(wl: Workload, serve: Serve) -> list[Turn]:
    """Run every conversation of ``wl`` concurrently through ``serve``; each sends its next
    turn once its previous reply arrived.  Returns the turns in (conversation, turn) order."""
    done: list[list[Turn]] = [[] for _ in wl.users]

    async def conversation(c: int) -> None:
        history = list(wl.system)
        for t, user in enumerate(wl.users[c]):
            prompt = history + user
            s = await serve(prompt)
            done[c].append(Turn(c, t, len(prompt), s))
            history = prompt + s.tokens

    async with anyio.create_task_group() as tg:
        for c in range(len(wl.users)):
            tg.start_soon(conversation, c)
    return [t for turns in done for t in turns]


# ---------------------------------------------------------------------- loop instrumentation


class _Account:
    __slots__ = ("cpu", "steps", "wall")

    def __init__(self) -> None:
        self.cpu = 0.0
        self.wall = 0.0
        self.steps = 0


class _TimedCoro(Coroutine[Any, Any, Any]):
    """A task's coroutine whose every step (``send`` / ``throw``) is timed into its task's
    account while the owner is on; otherwise the coroutine it wraps, unchanged.  The account
    is found by the task's name at the first timed step (names are set after creation)."""

    __slots__ = ("_account", "_coro", "_owner", "_resolved")

    def __init__(self, coro: Coroutine[Any, Any, Any], owner: TaskCpu) -> None:
        self._coro = coro
        self._owner = owner
        self._account: _Account | None = None
        self._resolved = False

    def _timed(self, step: Callable[[], T]) -> T:
        if not self._owner.on:
            return step()
        if not self._resolved:
            self._resolved = True
            self._account = self._owner.account_of(asyncio.current_task())
        acc = self._account
        if acc is None:
            return step()
        c0, w0 = time.thread_time(), time.perf_counter()
        try:
            return step()
        finally:
            acc.cpu += time.thread_time() - c0
            acc.wall += time.perf_counter() - w0
            acc.steps += 1

    def send(self, value: Any) -> Any:
        return self._timed(lambda: self._coro.send(value))

    def throw(self, *args: Any) -> Any:
        return self._timed(lambda: self._coro.throw(*args))

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Generator[Any, None, Any]:
        return self._coro.__await__()

    def __getattr__(self, name: str) -> Any:  # cr_frame, cr_running, ... (anyio reads them)
        return getattr(self._coro, name)


class TaskCpu:
    """Loop-thread CPU time spent in the steps of chosen tasks, by account.

    Installed as the loop's task factory (:meth:`installed`), it wraps the coroutine of every
    task created in the block; while :attr:`on` is set, each step of a task whose name starts
    with a key of ``tasks`` counts its thread CPU time (``time.thread_time``) and wall time
    under that key's account.
    """

    def __init__(self, tasks: dict[str, str]) -> None:
        self.tasks = tasks
        self.accounts = {name: _Account() for name in set(tasks.values())}
        self.on = False
        self.timed: dict[str, int] = dict.fromkeys(self.accounts, 0)  #: tasks timed, by account

    def account_of(self, task: asyncio.Task[Any] | None) -> _Account | None:
        """The account of ``task`` (by its name), if any."""
        name = task.get_name() if task is not None else ""
        for prefix, account in self.tasks.items():
            if name.startswith(prefix):
                self.timed[account] += 1
                return self.accounts[account]
        return None

    def _factory(self, loop: asyncio.AbstractEventLoop, coro: Any, **kw: Any) -> asyncio.Task[Any]:
        return asyncio.Task(_TimedCoro(coro, self), loop=loop, **kw)

    @contextlib.contextmanager
    def installed(self, loop: asyncio.AbstractEventLoop) -> Iterator[TaskCpu]:
        """The loop creates its tasks through :meth:`_factory` inside the block."""
        previous = loop.get_task_factory()
        loop.set_task_factory(self._factory)
        try:
            yield self
        finally:
            loop.set_task_factory(previous)

    def cpu(self, name: str) -> float:
        """CPU seconds counted under ``name``."""
        return self.accounts[name].cpu

    def wall(self, name: str) -> float:
        """Wall seconds of the counted steps under ``name``."""
        return self.accounts[name].wall


class LagProbe:
    """How late the loop wakes a task that sleeps :data:`LAG_INTERVAL` in a loop.

    Each sample is (lateness in seconds, ``busy()`` at the wake); :meth:`running` runs the
    probe for the duration of a block.
    """

    def __init__(self, busy: Callable[[], bool] | None = None) -> None:
        self.busy = busy
        self.samples: list[tuple[float, bool]] = []

    async def _run(self) -> None:
        busy = self.busy
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(LAG_INTERVAL)
            late = time.perf_counter() - t0 - LAG_INTERVAL
            self.samples.append((max(0.0, late), busy() if busy is not None else True))

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[LagProbe]:
        """Sample for the duration of the block."""
        task = asyncio.ensure_future(self._run())
        try:
            yield self
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def lags(self, *, busy_only: bool = False) -> list[float]:
        """The samples' lateness (only those taken while busy, with ``busy_only``)."""
        return [late for late, busy in self.samples if busy or not busy_only]


# ---------------------------------------------------------------------- the sides


async def serve_engine(
    model: Any,
    wl: Workload,
    cfg: CacheConfig,
    *,
    max_batch_tokens: int,
    max_running: int,
    busy_at: int,
    lag_pass: bool = True,
) -> SideRun:
    """The workload through :class:`Engine` (every conversation concurrent).

    The timed run measures the engine's step counters and its loop-side CPU time
    (:class:`TaskCpu`) in ``extra``.  With ``lag_pass`` the workload is then served again on
    a fresh cache with a :class:`LagProbe` running (its 1 ms wakes take the loop thread and
    the GIL a thousand times a second, which would slow the timed run): the loop's lag, all
    samples and "busy" ones (taken with at least ``busy_at`` requests in the batch), plus an
    idle-loop baseline.
    """
    kw: dict[str, Any] = dict(max_batch_tokens=max_batch_tokens, max_running=max_running)
    loop = asyncio.get_running_loop()
    cpu = TaskCpu(ENGINE_TASKS)
    with cpu.installed(loop):
        async with HiCache(cfg) as cache, Engine(model, cache, **kw) as engine:
            await engine.generate(wl.warmup, max_new_tokens=wl.reply_tokens)
            before = engine.statistics()
            cpu.on = True
            c0, t0 = time.thread_time(), time.perf_counter()
            turns = await drive(wl, _engine_serve(engine, wl.reply_tokens))
            wall = time.perf_counter() - t0
            loop_cpu = time.thread_time() - c0
            cpu.on = False
            after = engine.statistics()
    steps = after.steps - before.steps
    batch = after.batch_size.sum - before.batch_size.sum
    extra: dict[str, Any] = {
        "steps": steps,
        "step_seconds": after.step_seconds_total - before.step_seconds_total,
        "step_tokens": after.step_tokens - before.step_tokens,
        "mean_batch": batch / steps if steps else 0.0,
        "preemptions": after.preemptions - before.preemptions,
        "shared_in_flight_tokens": after.shared_in_flight_tokens - before.shared_in_flight_tokens,
        "failed": after.failed - before.failed,
        "step_loop_cpu_s": cpu.cpu("step_loop"),
        "step_loop_wall_s": cpu.wall("step_loop"),
        "admission_cpu_s": cpu.cpu("admission"),
        "admission_wall_s": cpu.wall("admission"),
        "loop_thread_cpu_s": loop_cpu,
        "tasks_timed": dict(cpu.timed),
    }
    if lag_pass:
        async with HiCache(cfg) as cache, Engine(model, cache, **kw) as engine:
            await engine.generate(wl.warmup, max_new_tokens=wl.reply_tokens)
            idle = LagProbe()
            async with idle.running():
                await asyncio.sleep(0.2)
            probe = LagProbe(lambda: len(engine.queues.running) >= busy_at)
            async with probe.running():
                t0 = time.perf_counter()
                await drive(wl, _engine_serve(engine, wl.reply_tokens))
                extra["lag_pass_wall_s"] = time.perf_counter() - t0
        extra.update(lag=probe.lags(), lag_busy=probe.lags(busy_only=True), lag_idle=idle.lags())
    return SideRun(turns=turns, wall=wall, extra=extra)


def _engine_serve(engine: Engine, reply_tokens: int) -> Serve:
    async def serve(prompt: list[int]) -> Served:
        r = await engine.generate(prompt, max_new_tokens=reply_tokens)
        a = r.attribution
        return Served(r.tokens, r.ttft, r.itl, r.total, a.cached, a.computed)

    return serve


async def serve_sequential(model: Any, wl: Workload, cfg: CacheConfig) -> SideRun:
    """The workload through :meth:`CachedLM.generate`, one request at a time.

    Forward passes run inline (nothing else on the loop needs it while a request runs); the
    runner stamps each pass, so the reply's first stamp is its first token.  The write-through
    acknowledgement is not awaited (a server would not hold the reply for it).
    """
    lock = asyncio.Lock()
    stamps: list[float] = []

    async def runner(fn: Callable[[], Any]) -> Any:
        out = fn()
        stamps.append(time.perf_counter())
        return out

    async with HiCache(cfg) as cache:
        lm = CachedLM(model, cache, runner=runner, await_backup=False)
        await lm.generate(wl.warmup, wl.reply_tokens)

        async def serve(prompt: list[int]) -> Served:
            t0 = time.perf_counter()
            async with lock:
                stamps.clear()
                gen = await lm.generate(prompt, wl.reply_tokens)
                times = list(stamps)
            end = time.perf_counter()
            itl = [b - a for a, b in itertools.pairwise(times)]
            return Served(gen.tokens, times[0] - t0, itl, end - t0, gen.reused, gen.computed)

        t0 = time.perf_counter()
        turns = await drive(wl, serve)
        wall = time.perf_counter() - t0
    return SideRun(turns=turns, wall=wall)


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    """Silence the ``name`` logger (transformers' CB logs psutil hints as errors on CPU)."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


async def serve_transformers(
    model: Any,
    wl: Workload,
    *,
    page_size: int,
    num_blocks: int,
    max_batch_tokens: int,
    max_requests: int,
    attn_implementation: str,
    driver: Callable[[Workload, Serve], Awaitable[list[Turn]]] = drive,
) -> SideRun:
    """The workload through ``transformers``' continuous batching with prefix sharing on.

    The manager runs its own thread; each request registers a result handler (called on the
    loop) before it is added, and its tokens carry the thread's timestamps.  Prompt reuse is
    counted by wrapping the paged cache's ``search_prefix_match`` (the first match of each
    request).  Any failure is returned as ``SideRun.error``, never raised.
    """
    run = SideRun()
    matched: dict[str, int] = {}
    with _quiet("ContinuousBatchingLogger"):
        try:  # building the manager reads files and runs the model: off the loop
            manager = await asyncio.to_thread(
                _start_manager,
                model,
                run,
                matched,
                attn_implementation=attn_implementation,
                reply_tokens=wl.reply_tokens,
                page_size=page_size,
                num_blocks=num_blocks,
                max_batch_tokens=max_batch_tokens,
                max_requests=max_requests,
            )
        except Exception as exc:
            run.error = f"init_continuous_batching: {exc!r}"
            return run
        try:
            await _drive_manager(manager, wl, run, matched, driver)
        except Exception as exc:
            run.error = f"{type(exc).__name__}: {exc}"
        finally:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(_stop_manager, manager)
    return run


def _start_manager(
    model: Any,
    run: SideRun,
    matched: dict[str, int],
    *,
    attn_implementation: str,
    reply_tokens: int,
    page_size: int,
    num_blocks: int,
    max_batch_tokens: int,
    max_requests: int,
) -> Any:
    """A started ``ContinuousBatchingManager`` whose paged cache records, in ``matched``, the
    prompt tokens its first prefix match gave each request."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model.set_attn_implementation(attn_implementation)  # the engine's PagedBatch changed it
    gen_cfg = GenerationConfig(  # type: ignore[no-untyped-call]
        do_sample=False, max_new_tokens=reply_tokens, eos_token_id=-1, pad_token_id=0
    )
    cb_cfg = ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=num_blocks,
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_requests,
        allow_block_sharing=True,
        auto_switch_to_flash=False,
        use_cuda_graph=False,
        use_async_batching=False,
    )
    manager = model.init_continuous_batching(
        generation_config=gen_cfg, continuous_batching_config=cb_cfg
    )
    manager.warmup()  # builds the batch processor and its paged cache (no graphs on CPU)
    cache = manager.batch_processor.cache
    run.extra["prefix_sharing"] = bool(cache.use_prefix_sharing)
    run.extra["num_blocks"] = int(cache.num_blocks)
    search = cache.search_prefix_match

    def counting_search(request_id: str, prompt_ids: list[int]) -> int:
        n: int = search(request_id, prompt_ids)
        matched.setdefault(request_id, n)
        return n

    cache.search_prefix_match = counting_search
    manager.start()
    return manager


def _stop_manager(manager: Any) -> None:
    try:
        manager.stop(block=True, timeout=30)
    finally:
        manager.destroy()


async def _drive_manager(
    manager: Any,
    wl: Workload,
    run: SideRun,
    matched: dict[str, int],
    driver: Callable[[Workload, Serve], Awaitable[list[Turn]]] = drive,
) -> None:
    loop = asyncio.get_running_loop()
    ids = iter(range(1 << 62))

    async def request(prompt: list[int]) -> Any:
        rid = f"bench-{next(ids)}"
        fut: asyncio.Future[Any] = loop.create_future()

        def deliver(out: Any) -> None:
            if out.is_finished() and not fut.done():
                fut.set_result(out)

        manager.register_result_handler(rid, deliver)
        t0 = time.perf_counter()
        manager.add_request(
            prompt,
            request_id=rid,
            max_new_tokens=wl.reply_tokens,
            record_timestamps=True,
            eos_token_id=-1,
        )
        deadline = t0 + TRANSFORMERS_TIMEOUT
        while not fut.done():
            await asyncio.wait({fut}, timeout=0.5)
            if not fut.done() and (not manager.is_running() or time.perf_counter() > deadline):
                raise RuntimeError(f"continuous batching stopped serving request {rid}")
        out = fut.result()
        if out.error is not None:
            raise RuntimeError(f"request {rid} failed: {out.error}")
        end = time.perf_counter()
        stamps = list(out.timestamps or [])
        first = stamps[0] if stamps else end
        reused = min(matched.get(rid, 0), len(prompt))
        itl = [b - a for a, b in itertools.pairwise(stamps)]
        return Served(list(out.generated_tokens), first - t0, itl, end - t0, reused,
                      len(prompt) - reused)  # fmt: skip

    await request(wl.warmup)
    t0 = time.perf_counter()
    run.turns = await driver(wl, request)
    run.wall = time.perf_counter() - t0
