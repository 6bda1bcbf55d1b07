"""``Engine``: a batched, asyncio serving loop over the cache (many requests per forward pass).

::

    async with HiCache(cache_config_for(model, ...)) as cache:
        async with Engine(model, cache, max_batch_tokens=256, max_running=16) as engine:
            result = await engine.generate(prompt, max_new_tokens=32)
            async for token in engine.stream(prompt, max_new_tokens=32):
                ...

One task (the step loop, in the engine's anyio task group) owns the batch.  Each step it plans
a token budget over the running requests (:mod:`.scheduler`: decodes and prefill chunks in one
pass), makes sure every request has rows for its tokens (allocating pages, preempting the
newest request when the pool is short), runs one forward pass for all of them on the model
thread (:mod:`.runner`), hands each new token to its caller (an anyio memory object stream),
and inserts every page a request completed, so write-through starts while the request still
runs and concurrent requests reuse the pages at once.

Admission runs beside the step loop, one task per request, so a storage read or a load-back
never stalls the batch: prefetch on arrival (the read overlaps the queue), then, when the
engine has room, prefetch again, match, load back, and allocate the prompt's rows; the request
joins the batch at the next step.  An admission that finds the pool short releases what it
holds and waits for room (bounded by the caller's timeout), so waiting never deadlocks the
requests that could free it.  A request whose prompt shares pages another running request is
computing waits for those pages instead of computing them again.

Cancelling a caller aborts its request: the step loop frees its rows and pins after the
forward pass in progress returns (rule 2: rows handed to the model thread stay its own until it
says so).

A request whose prefix left the cache while it ran (an operator's ``drop``, a page that failed
its verification at load-back) cannot insert its next pages onto it
(:class:`~aiocache_kv.errors.PrefixDroppedError`): it is restarted, not failed.  Its rows and
pins go back, its prompt and generated tokens stay, and it waits first in line to match again
and recompute what is gone; after ``max_restarts`` restarts it fails with that error.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import sys
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio
import torch
from anyio.abc import TaskGroup

from aiocache_kv.cache import HiCache
from aiocache_kv.errors import (
    CapacityError,
    ConfigError,
    EngineClosedError,
    InvalidInputError,
    InvalidTypeError,
    KVCacheError,
    OwnershipError,
    PrefixDroppedError,
)
from aiocache_kv.handles import InsertResult, MatchResult
from aiocache_kv.logs import get_logger
from aiocache_kv.models.arch import check_layout, check_request, is_hybrid
from aiocache_kv.models.batched import PagedBatch, SeqChunk
from aiocache_kv.numeric import MAX_THREADS, check_int, check_real
from aiocache_kv.serving.admission import ROOM_POLL, Admissions, ModelView
from aiocache_kv.serving.queues import Queues
from aiocache_kv.serving.request import ENDED, GenerationResult, Request, RequestState
from aiocache_kv.serving.runner import ModelRunner
from aiocache_kv.serving.scheduler import Slot, plan_step
from aiocache_kv.serving.stats import EngineCounters, EngineStatistics
from aiocache_kv.serving.stream import TokenStream
from aiocache_kv.tree.retention import check_priority
from aiocache_kv.validate import check_names

log = get_logger(__name__)

__all__ = ["STEP_SLICE", "Engine"]

#: seconds of a step's bookkeeping (tokens to callers, inserts of the pages requests
#: completed) after which the step loop yields to the event loop before the next request:
#: with a full batch every request may insert pages (~0.1 ms each on CPU, write-through
#: included), and one callback doing all of them delays every other task on the loop
STEP_SLICE = 0.0002


def _cores() -> int:
    """Cores this process may run on."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


class Engine:
    """Serves greedy generation for ``model`` over ``cache`` with continuous batching.

    ``max_batch_tokens``: tokens one forward pass runs at most (decodes and prefill chunks
    together); ``max_running``: requests in the batch at once.  ``switch_interval``: while
    the engine runs, the interpreter's thread switch interval (``sys.setswitchinterval``, in
    seconds; ``None`` leaves it).  The model thread holds the GIL between torch operations,
    and the loop thread waits for it up to that interval (5 ms by default) whenever it wakes
    during a forward pass: a shorter one bounds the loop's lag.  It is process-wide; the
    previous value comes back when the engine closes.  ``pad_decodes``: how decodes attend
    (:class:`~aiocache_kv.models.batched.PagedBatch`; ``None``: its default for the device).
    ``model_threads``: torch intra-op threads of the model thread, at most ``MAX_THREADS``
    (1024) (default: the cores this process may use, less one, at least one), so the loop
    keeps a core.  ``max_restarts``: times a request is restarted when a prefix it extends
    leaves the cache under it (then it fails with
    :class:`~aiocache_kv.errors.PrefixDroppedError`).  ``storage_wait``: seconds a running
    request short of rows waits for the pins of storage reads of requests not in the batch
    yet; then those reads are cancelled (their requests are admitted without one and
    compute what the store held), so a slow store delays a reply by at most that much a
    shortage, not by the reads' own deadlines.  Use as an async context
    manager on the loop that runs ``cache``; :meth:`generate` and :meth:`stream` may be called
    from any task on that loop.

    Raises:
        ConfigError: the cache's KV layout does not match the model, an unsupported model, a
            limit that is not a positive int, ``model_threads`` not an int in
            ``[1, MAX_THREADS]`` (1024), ``pad_decodes`` neither a bool nor ``None``, or
            ``storage_wait`` not a finite number in ``[0, 3600]``.
        InvalidTypeError: ``cache`` is not a :class:`~aiocache_kv.HiCache`.
    """

    def __init__(
        self,
        model: Any,
        cache: HiCache,
        *,
        max_batch_tokens: int = 256,
        max_running: int = 16,
        switch_interval: float | None = None,
        pad_decodes: bool | None = None,
        model_threads: int | None = None,
        max_restarts: int = 3,
        storage_wait: float = 1.0,
    ) -> None:
        for name, value in (("max_batch_tokens", max_batch_tokens), ("max_running", max_running)):
            if type(value) is not int or value < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
        if type(max_restarts) is not int or not 0 <= max_restarts <= 1000:
            raise ConfigError(f"max_restarts must be an int in [0, 1000], got {max_restarts!r}")
        self.max_restarts = max_restarts
        self.storage_wait = check_real(
            "storage_wait", storage_wait, minimum=0.0, maximum=3600.0, error=ConfigError
        )
        if switch_interval is not None:
            switch_interval = check_real(
                "switch_interval", switch_interval, minimum=1e-6, maximum=1.0, error=ConfigError
            )
        self.switch_interval = switch_interval
        if pad_decodes is not None and type(pad_decodes) is not bool:
            raise ConfigError(f"pad_decodes must be a bool or None, got {pad_decodes!r}")
        self.pad_decodes = pad_decodes
        if model_threads is None:
            model_threads = max(1, _cores() - 1)
        else:
            model_threads = check_int(
                "model_threads", model_threads, minimum=1, maximum=MAX_THREADS, error=ConfigError
            )
        self.model_threads = model_threads
        if not isinstance(cache, HiCache):
            raise InvalidTypeError(
                f"cache must be a HiCache, got {type(cache).__name__} {cache!r:.80}"
            )
        self._saved_switch: float | None = None
        if not is_hybrid(model):  # PagedBatch checks a hybrid's pool and sidecar itself
            check_layout(model, cache.config)
        self.model = model
        self.cache = cache
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.page_size = cache.config.page_size
        self.hybrid = is_hybrid(model)
        self.counters = EngineCounters()
        self.queues = Queues(cache, self.counters)
        self._ids = 0
        self._tg: TaskGroup | None = None
        self._entered_by: asyncio.Task[Any] | None = None  #: the task that entered it
        self._closing = False
        self._runner: ModelRunner | None = None
        self._short = False  #: a request waits for copies in flight to make room
        self._short_since: float | None = None  #: when the running batch got short of rows
        self._admissions: Admissions | None = None

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Engine:
        if self._tg is not None or self._closing:
            raise EngineClosedError("an Engine runs once: build a new one")
        cache = self.cache
        views = [cache.device_kv(layer) for layer in range(cache.config.num_layers)]
        swa = cache.sidecar("swa") if self.hybrid else None
        batch = PagedBatch(self.model, views, swa=swa, pad_decodes=self.pad_decodes)
        self._runner = ModelRunner(batch, self.model_threads)
        self._admissions = Admissions(self.queues, self.model_view())
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        self._entered_by = asyncio.current_task()  # its task group exits in that task
        if self.switch_interval is not None:  # set only once nothing above can fail
            self._saved_switch = sys.getswitchinterval()
            sys.setswitchinterval(self.switch_interval)
        self._tg.start_soon(self._step_loop, name="aiocache_kv.engine.steps")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop: every request not finished fails with ``EngineClosedError``; the forward pass
        in progress ends first, then every row and pin is given back.  Idempotent.

        Raises:
            OwnershipError: called from another task than the one that entered the engine
                (its task group can only exit there); nothing changed.
        """
        if self._tg is None or self._closing:
            return
        here, entered = asyncio.current_task(), self._entered_by
        if here is not entered:
            raise OwnershipError(
                "Engine.aclose must run in the task that entered the engine "
                f"({entered.get_name() if entered else None!r}), not "
                f"{here.get_name() if here else None!r}: its task group exits there (close "
                "it where it was entered, e.g. the app's lifespan task)"
            )
        self._closing = True
        q = self.queues
        for r in [*q.waiting, *q.admitting, *q.running]:
            q.fail(r, EngineClosedError("engine closed"), RequestState.ABORTED)
        tg = self._tg
        tg.cancel_scope.cancel()  # the step loop ends after the forward pass in progress
        await tg.__aexit__(None, None, None)
        assert self._admissions is not None
        await self._admissions.aclose()
        q.settle()
        self._tg = None
        if self._saved_switch is not None and sys.getswitchinterval() == self.switch_interval:
            sys.setswitchinterval(self._saved_switch)
        self._saved_switch = None

    # ------------------------------------------------------------------ public API

    def _submit(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        tenant: str | None,
        lora: str | None,
        sends: Any,
        keep_logits: bool = False,
        priority: int | None = None,
        retention: float | None = None,
    ) -> Request:
        if self._tg is None or self._closing:
            raise EngineClosedError("engine is not running (use it as `async with Engine(...)`)")
        toks = check_request(self.model, prompt, max_new_tokens)
        check_names(tenant, lora)
        check_priority(priority, retention)
        if type(keep_logits) is not bool:
            raise InvalidTypeError(f"keep_logits must be a bool, got {keep_logits!r}")
        if len(toks) + max_new_tokens > self._max_tokens():
            raise InvalidInputError(
                f"prompt ({len(toks)}) + max_new_tokens ({max_new_tokens}) need "
                f"{len(toks) + max_new_tokens} KV rows, the device pool has {self._max_tokens()}"
            )
        self._ids += 1
        loop = asyncio.get_running_loop()
        req = Request(self._ids, toks, max_new_tokens, tenant, lora, loop.create_future(), sends)
        req.keep_logits = keep_logits
        req.priority, req.retention = priority, retention
        self.queues.add(req)
        self.counters.submitted += 1
        assert self._admissions is not None
        self._admissions.on_arrival(req)
        return req

    def _max_tokens(self) -> int:
        return self.cache.config.device_pages * self.page_size

    async def generate(
        self,
        prompt: Sequence[int],
        *,
        max_new_tokens: int,
        tenant: str | None = None,
        lora: str | None = None,
        keep_logits: bool = False,
        priority: int | None = None,
        retention: float | None = None,
    ) -> GenerationResult:
        """Greedy-generate ``max_new_tokens`` after ``prompt``; returns its tokens, timings
        and where its prompt's KV came from (with ``keep_logits``, each token's logits too).
        Cancelling the call (e.g. under ``anyio.fail_after``) aborts the request.
        ``priority``/``retention`` go with every insert of the request's pages
        (:meth:`HiCache.insert`: kept longer than lower priorities, for ``retention`` s).

        Raises:
            InvalidTypeError: the prompt is not a sequence of ints (a ``bool`` is not a
                token), tenant/lora not str, priority not an int, or ``keep_logits`` not a
                bool.
            InvalidInputError: an empty prompt, a token outside the vocabulary, bad
                ``max_new_tokens``, a priority outside [0, 1000] or a bad retention, or a
                request longer than the model's positions or the device pool.
            EngineClosedError: the engine is not running or closed before the request ended.
            CapacityError: the device pool cannot hold the request even alone.
        """
        req = self._submit(
            prompt, max_new_tokens, tenant, lora, None, keep_logits, priority, retention
        )
        try:
            return await asyncio.shield(req.future)
        finally:
            if req.state not in ENDED:
                self._abort(req)

    def open_stream(
        self,
        prompt: Sequence[int],
        *,
        max_new_tokens: int,
        tenant: str | None = None,
        lora: str | None = None,
        priority: int | None = None,
        retention: float | None = None,
    ) -> TokenStream:
        """Submit a request whose tokens are read as they are made
        (:meth:`TokenStream.tokens`), then its :class:`GenerationResult`
        (:meth:`TokenStream.result`); :meth:`TokenStream.close` aborts it if it has not ended.

        Raises:
            As :meth:`generate`, at once.
        """
        sends, receives = anyio.create_memory_object_stream[int](max_buffer_size=math.inf)
        req = self._submit(prompt, max_new_tokens, tenant, lora, sends, False, priority, retention)
        return TokenStream(req, receives, self._abort)

    async def stream(
        self,
        prompt: Sequence[int],
        *,
        max_new_tokens: int,
        tenant: str | None = None,
        lora: str | None = None,
        priority: int | None = None,
        retention: float | None = None,
    ) -> AsyncIterator[int]:
        """Greedy-generate as :meth:`generate`, yielding each token as it is made.  Leaving
        the iteration early (``break``, cancellation) aborts the request.

        Raises:
            As :meth:`generate` (at the first iteration for bad input).
        """
        ts = self.open_stream(
            prompt,
            max_new_tokens=max_new_tokens,
            tenant=tenant,
            lora=lora,
            priority=priority,
            retention=retention,
        )
        try:
            async for token in ts.tokens():
                yield token
            await ts.result()  # raises what failed the request, if anything
        finally:
            ts.close()

    def statistics(self) -> EngineStatistics:
        """A snapshot of the engine's counters and latency histograms."""
        q = self.queues
        return self.counters.snapshot(
            waiting=len(q.waiting), admitting=len(q.admitting), running=len(q.running)
        )

    def check_invariants(self) -> None:
        """Assert the engine's request bookkeeping (:meth:`Queues.check_invariants`) and the
        cache's own (``HiCache.check_invariants``)."""
        self.queues.check_invariants()
        self.cache.check_invariants()

    def model_view(self) -> ModelView:
        """What admission needs to know of the model and the limits."""
        return ModelView(page_size=self.page_size, hybrid=self.hybrid, max_running=self.max_running)

    # ------------------------------------------------------------------ the step loop

    async def _step_loop(self) -> None:
        q = self.queues
        assert self._admissions is not None
        try:
            while True:
                q.settle()
                self._admissions.admit_waiting()
                slots = plan_step(q.running, self.max_batch_tokens)
                self._short = self._admissions.yield_to_running = False
                slots = self._with_rows(slots)
                self._short_since = self._short_since if self._short else None
                if not slots:
                    q.wake.clear()
                    if self._short:  # copies in flight will make room: look again soon
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(q.wake.wait(), ROOM_POLL)
                    else:
                        await q.wake.wait()
                    continue
                await self._run(slots)
        except Exception as exc:  # a bug: no caller may wait forever for it
            log.exception("engine.step_loop_failed")
            self._closing = True
            for r in [*q.waiting, *q.admitting, *q.running]:
                q.fail(r, EngineClosedError(f"the engine's step loop failed: {exc!r}"))
            q.settle()
            raise

    async def _run(self, slots: list[Slot]) -> None:
        chunks = [
            SeqChunk(
                tokens=s.request.tokens(s.request.filled, s.request.filled + s.tokens),
                rows=s.request.rows,
                start=s.request.filled,
            )
            for s in slots
        ]
        produce = [s.produces for s in slots]
        keep = [s.request.keep_logits for s in slots]
        t0 = time.perf_counter()
        assert self._runner is not None
        try:
            picked = await self._runner.step(chunks, produce, keep)
        except KVCacheError as exc:  # a request-level failure: fail the step's requests
            for s in slots:
                self.queues.fail(s.request, exc)
            return
        except Exception as exc:  # the model broke: fail them, keep serving the others
            log.exception("engine.step_failed", requests=len(slots))
            for s in slots:
                self.queues.fail(s.request, exc)
            return
        now = time.perf_counter()
        self.counters.observe_step(len(slots), sum(s.tokens for s in slots), now - t0)
        mark = now
        for s, (tok, logits) in zip(slots, picked, strict=True):
            if time.perf_counter() - mark > STEP_SLICE:  # between requests: let the loop run
                await asyncio.sleep(0)
                mark = time.perf_counter()
            r = s.request
            if r.state is not RequestState.RUNNING:
                continue  # aborted during the pass (or the yield): settle() gives its rows back
            r.filled += s.tokens
            if logits is not None:
                r.logits.append(logits)
            if tok is not None:
                self._emit(r, tok, now)
            try:
                self._insert_pages(r)
            except PrefixDroppedError as exc:  # its prefix left the cache: not its fault
                self._restart(r, exc)
                continue
            except KVCacheError as exc:  # the cache refused: this request alone fails
                self.queues.fail(r, exc)
                continue
            if r.done:
                self.queues.finish(r)

    def _restart(self, r: Request, exc: PrefixDroppedError) -> None:
        """``r`` could not insert onto its prefix, which left the cache (nothing changed):
        re-admit it to recompute what is gone, at most ``max_restarts`` times.  One that has
        every token already finishes (only the caching of its last pages is lost)."""
        q = self.queues
        if r.done:
            q.finish(r)
        elif r.restarts >= self.max_restarts:
            q.fail(r, exc)
        else:
            q.restart(r, exc)

    def _emit(self, r: Request, tok: int, now: float) -> None:
        if r.token_times:
            self.counters.itl.observe(now - r.token_times[-1])
        else:
            self.counters.ttft.observe(now - r.arrival)
        r.generated.append(tok)
        r.token_times.append(now)
        self.counters.generated_tokens += 1
        if r.sends is not None:
            try:
                r.sends.send_nowait(tok)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                # the reader stopped reading (``break``): its request goes on to its result
                r.sends.close()
                r.sends = None

    def _insert_pages(self, r: Request) -> None:
        """Put every page ``r`` completed into the tree (pinned by the new handle)."""
        p = self.page_size
        aligned = r.filled // p * p
        if aligned <= r.inserted:
            return
        cache = self.cache
        # incremental: only the new pages' rows, after the pages the handle pins already
        start = r.inserted
        h = r.handle
        if isinstance(h, InsertResult) and h.inserted_len < start:
            # the last insert stopped below a node still loading back: the rows after it are
            # retained by ``h`` (not the tree's yet), and are passed again
            start = h.inserted_len
        mine, dup = None, 0
        if isinstance(h, MatchResult):  # the first insert: the match may pin pages past what
            # admission reused (a prompt of whole pages, all cached: its last page is
            # recomputed for the logits).  Read the tree's copy from now on and give the
            # duplicate back once the insert took it, or the request would hold that page
            # twice to its end
            dup = min(h.device_len, aligned) - start
            if dup > 0:
                mine = r.rows[start : start + dup].clone()
                r.rows[start : start + dup] = h.device_indices[start : start + dup]
        try:
            res = self._insert_rows(r, start, aligned)
        except BaseException as exc:
            if mine is None:
                raise
            r.rows[start : start + dup] = mine  # its own rows again, as when nothing was
            mine = None  # switched (they are its to give back, whatever happens next)
            if not isinstance(exc, KVCacheError):
                raise
            res = self._insert_rows(r, start, aligned)  # (the tree's copy was dropped)
        if mine is not None:
            cache.free(mine)
        old, r.handle = r.handle, res
        if old is not None:
            cache.release(old)
        self.counters.inserted_pages += (aligned - r.inserted) // p
        r.inserted = aligned

    def _insert_rows(self, r: Request, start: int, aligned: int) -> InsertResult:
        """``insert`` of ``r``'s first ``aligned`` tokens, its rows from ``start`` on, onto
        its handle."""
        return self.cache.insert(
            r.tokens(0, aligned),
            r.rows[start:aligned],
            prefix=r.handle,
            tenant=r.tenant,
            lora=r.lora,
            priority=r.priority,
            retention=r.retention,
        )

    # ------------------------------------------------------------------ rows and room

    def _with_rows(self, slots: list[Slot]) -> list[Slot]:
        """``slots`` whose requests have rows for their tokens (pages allocated here; the
        newest running request is preempted when the pool is short and that helps)."""
        out: list[Slot] = []
        for s in slots:
            r = s.request
            if r.state is not RequestState.RUNNING:
                continue  # preempted for an earlier slot of this step, or aborted
            need = r.filled + s.tokens - r.rows.numel()
            if need > 0 and not self._grow(r, need):
                continue
            out.append(s)
        return out

    def _grow(self, r: Request, need: int) -> bool:
        """Give ``r`` rows for ``need`` more tokens; ``False`` if it must wait a step."""
        cache = self.cache
        q = self.queues
        while True:
            try:
                pages = cache.alloc(need)
            except CapacityError:
                adm = self._admissions
                assert adm is not None
                if cache.copies_in_flight() or cache.device_pages_returning() or adm.holding():
                    # copies land soon (pages evictable), zeroing ends (free), storage reads
                    # end and give back their pins; admissions wait meanwhile (no new pins)
                    self._short = adm.yield_to_running = True
                    now = time.monotonic()  # a store slower than storage_wait: reads give way
                    if now - (self._short_since or now) >= self.storage_wait:
                        self.counters.storage_reads_cancelled += adm.cancel_reads()
                    self._short_since = self._short_since or now
                    return False
                victim = q.running[-1]  # the newest request yields (vLLM's order)
                if victim is r and len(q.running) == 1:
                    q.fail(r, CapacityError(f"the device pool cannot hold {r} alone"))
                    return False
                q.preempt(victim)
                if victim is r:
                    return False
                continue
            r.rows = torch.cat([r.rows, pages])
            return True

    def _abort(self, r: Request) -> None:
        """The caller went away: end ``r`` (its rows go back after the pass in progress)."""
        self.queues.fail(r, EngineClosedError(f"request {r.id} aborted"), RequestState.ABORTED)
