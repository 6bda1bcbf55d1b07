"""``StorageIO``: the async facade over a blocking :class:`StorageBackend`.

Design
------
The event loop owns every piece of state here (the in-flight table, the slot counter, the
waiter queue).  Backend calls run on a private ``ThreadPoolExecutor`` of ``workers`` threads.
A worker only runs the blocking call and posts ``(result, exception)`` back with
``loop.call_soon_threadsafe``; the loop-side callback (:meth:`StorageIO._finish`) releases the
slot, marks the call finished, and completes the caller's future *only if it is not done yet*.
A result that arrives after the caller timed out or was cancelled is discarded (counted in
``late_results``).

Bounded work.  At most ``max_pending`` calls are submitted and unfinished at any time, and
that includes calls whose callers already gave up: a slot is released by the *worker*
finishing, never by the caller leaving.  So a stalled store cannot build an unbounded backlog;
callers beyond the limit wait for a slot within their own deadline and then get
:class:`~aiocache_kv.errors.StorageTimeoutError`.  Threads stuck in a C++ call come back on
their own because every blocking call is bounded below us: Mooncake calls to a hung master
return -901 after ``MC_RPC_TIMEOUT_MS`` (set it; the default is 30 s; measured: 1x almost
always, once 5x when the client retried on a new connection), calls to a dead master return
-900 after ~4.5 s, file I/O is bounded by the kernel.  A call's deadline covers its slot wait.

Buffers and cancellation.  When a caller times out or is cancelled, the worker may still be
writing into (``get_into``) or reading/sealing (``put``) the caller's page slots.  Those slots
must not be reused or freed until the worker is done: ``await io.wait_released(buffers)``
returns once no unfinished call holds any of them, ``io.holds(buffers)`` tells it without
waiting, ``await io.drain()`` waits for every call, and a call's ``on_release`` runs once its
worker is done (a drop's fences stand until then: ``fences.py``).

Threads.  Each worker caps torch's intra-op threads at ``intra_op_threads`` (default 1, per
thread): with two workers on two cores an OpenMP team inside each oversubscribes the cores (a
batched checksum fell from 6-19 GB/s to 0.6-5 GB/s with teams of two under load).

Timers (not ``asyncio.wait_for``) implement the deadline and the slot wait, so a grant that
races with a cancellation is handed back (``except BaseException: ... raise``).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import torch

from aiocache_kv.errors import (
    ConfigError,
    KVCacheError,
    OwnershipError,
    StorageError,
    StorageTimeoutError,
    StorageUnavailableError,
)
from aiocache_kv.logs import get_logger
from aiocache_kv.numeric import MAX_THREADS, check_int, check_real
from aiocache_kv.storage.base import ChainAwareStorage, PageBuffer, StorageBackend, StorageStats
from aiocache_kv.storage.batch_reports import Batches, BatchReports, batch_runner
from aiocache_kv.storage.io_records import IOCall, StorageIOStats, consume, init_worker, settled

__all__ = ["BatchReports", "StorageIO", "StorageIOStats"]

log = get_logger(__name__)
T = TypeVar("T")


class StorageIO:
    """Run a blocking backend's batched calls off the loop, with deadlines and bounded work.

    All methods must be called from one event loop (the first one that uses it).
    """

    def __init__(
        self,
        backend: StorageBackend,
        *,
        workers: int = 2,
        max_pending: int | None = None,
        default_timeout: float = 5.0,
        name: str = "aiocache-kv-storage",
        intra_op_threads: int | None = 1,
    ) -> None:
        """Raises:
        ConfigError: ``workers`` not in ``[1, MAX_THREADS]``, ``max_pending`` < ``workers``,
            ``intra_op_threads`` < 1 (``None`` keeps torch's default in the workers), one of
            them not an int, or ``default_timeout`` not a finite number > 0.
        """
        check_int("workers", workers, minimum=1, maximum=MAX_THREADS, error=ConfigError)
        max_pending = 4 * workers if max_pending is None else max_pending
        check_int("max_pending (at least workers)", max_pending, minimum=workers, error=ConfigError)
        check_real("default_timeout", default_timeout, exclusive=True, error=ConfigError)
        if intra_op_threads is not None:
            check_int("intra_op_threads", intra_op_threads, minimum=1, error=ConfigError)
        self.backend = backend
        #: asked once, not per put: a runtime protocol check scans the class (~9 us)
        self._chain_aware = isinstance(backend, ChainAwareStorage)
        self.workers = workers
        self.max_pending = max_pending
        self.default_timeout = default_timeout
        self.intra_op_threads = intra_op_threads
        self._pool = concurrent.futures.ThreadPoolExecutor(
            workers,
            thread_name_prefix=name,
            initializer=init_worker,
            initargs=(intra_op_threads,),
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count()
        self._inflight: dict[int, IOCall] = {}
        self._pending = 0  # slots taken (== len(_inflight) except between grant and submit)
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._closed = False
        self._submitted = self._completed = self._timeouts = self._cancelled = self._late = 0

    def __repr__(self) -> str:
        return (
            f"StorageIO(backend={type(self.backend).__name__}, workers={self.workers}, "
            f"in_flight={len(self._inflight)}, waiting={len(self._waiters)}, "
            f"max_pending={self.max_pending}, closed={self._closed})"
        )

    # -- public async API --------------------------------------------------------------------

    async def open(self, *, timeout: float | None = None) -> None:
        """Open the backend on a worker.  Raises what ``backend.open`` raises, or
        ``StorageTimeoutError``."""
        await self.call("open", self.backend.open, timeout=timeout)

    async def exists(self, keys: Sequence[str], *, timeout: float | None = None) -> list[bool]:
        """``backend.exists`` off the loop.  Raises its errors, ``StorageTimeoutError``,
        ``StorageUnavailableError`` (closed)."""
        return await self.call("exists", self.backend.exists, list(keys), timeout=timeout)

    async def leading_hits(self, keys: Sequence[str], *, timeout: float | None = None) -> int:
        """``backend.leading_hits`` off the loop (raises as :meth:`exists`)."""
        return await self.call(
            "leading_hits", self.backend.leading_hits, list(keys), timeout=timeout
        )

    async def put(
        self,
        keys: Sequence[str],
        buffers: Sequence[PageBuffer],
        *,
        timeout: float | None = None,
        on_release: Callable[[], None] | None = None,
        parents: Sequence[str | None] | None = None,
        identities: Sequence[bytes] | None = None,
    ) -> list[bool]:
        """``backend.put`` off the loop (``put_chain`` with ``parents``, the key each page
        depends on, where the backend is a :class:`ChainAwareStorage`; ``identities``, what
        each page was computed from, go to the backend as they are).  On timeout/cancel the
        slots stay in use until :meth:`wait_released` (``on_release`` runs on the loop then,
        exactly once).  Raises the backend's errors or ``StorageTimeoutError``."""
        bufs = list(buffers)
        backend = self.backend
        idents = None if identities is None else list(identities)
        if parents is not None and self._chain_aware:
            return await self.call(
                "put",
                functools.partial(cast(ChainAwareStorage, backend).put_chain, identities=idents),
                list(keys),
                bufs,
                list(parents),
                timeout=timeout,
                buffers=bufs,
                on_release=on_release,
            )
        return await self.call(
            "put",
            functools.partial(backend.put, identities=idents),
            list(keys),
            bufs,
            timeout=timeout,
            buffers=bufs,
            on_release=on_release,
        )

    async def get_into(
        self,
        keys: Sequence[str],
        buffers: Sequence[PageBuffer],
        *,
        timeout: float | None = None,
        on_release: Callable[[], None] | None = None,
        identities: Sequence[bytes] | None = None,
    ) -> list[bool]:
        """``backend.get_into`` off the loop (``identities``: what each page must have been
        computed from).  On timeout/cancel the slots stay in use until :meth:`wait_released`
        (``on_release`` runs on the loop then, exactly once).
        Raises the backend's errors or ``StorageTimeoutError``."""
        bufs = list(buffers)
        idents = None if identities is None else list(identities)
        return await self.call(
            "get_into",
            functools.partial(self.backend.get_into, identities=idents),
            list(keys),
            bufs,
            timeout=timeout,
            buffers=bufs,
            on_release=on_release,
        )

    async def get_into_batches(
        self,
        batches: Batches,
        on_batch: Callable[[int, list[bool] | BaseException], None] | BatchReports,
        *,
        timeout: float | None = None,
        on_release: Callable[[], None] | None = None,
        report_gap: float = 0.0,
    ) -> None:
        """``backend.get_into`` of each ``(keys, buffers, identities)`` batch in turn, on one
        worker: one hand-off for all, each batch one backend call of its own size.
        ``on_batch(i, flags or the exception)`` runs on the loop for each batch that ended,
        in order, before this returns; a batch's exception does not stop the next.  Batches
        not started by the deadline, or after :meth:`BatchReports.stop_after`'s, are skipped.
        Buffers stay in use until every batch ended, late ones included (``on_release`` runs
        on the loop then, exactly once).

        The worker wakes the loop for a report at most every ``report_gap`` seconds (0: after
        every batch; a wake-up costs ~40 us) and once at the end; batches that end in between
        wait in ``on_batch``'s :class:`BatchReports` (:meth:`BatchReports.drain` them
        yourself, e.g. at a deadline).  This call drains them when it ends, however it ends.

        Raises:
            StorageTimeoutError: the batches did not all end in ``timeout`` seconds (those
                that ended were reported).
            StorageUnavailableError: the executor is closed.
        """
        loop = self._bind_loop()
        limit = self.default_timeout if timeout is None else timeout
        reports = on_batch if isinstance(on_batch, BatchReports) else BatchReports(on_batch)
        run = batch_runner(
            self.backend.get_into, batches, reports, loop, time.monotonic() + limit, report_gap
        )
        try:
            await self.call(
                "get_into",
                run,
                timeout=timeout,
                buffers=[b for _, bufs, _ in batches for b in bufs],
                on_release=on_release,
            )
        finally:
            reports.drain()  # what landed and waits for a wake-up (a timeout, a cancel)

    async def remove(
        self, keys: Sequence[str], *, timeout: float | None = None, **kw: Any
    ) -> list[bool]:
        """``backend.remove`` off the loop (``kw``: ``on_release``, as for :meth:`call`)."""
        return await self.call("remove", self.backend.remove, list(keys), timeout=timeout, **kw)

    async def register_buffer(self, tensor: torch.Tensor, *, timeout: float | None = None) -> None:
        """``backend.register_buffer`` off the loop."""
        await self.call("register_buffer", self.backend.register_buffer, tensor, timeout=timeout)

    def statistics(self) -> StorageStats:
        """The backend's counters (a thread-safe snapshot; no I/O)."""
        return self.backend.statistics()

    def io_statistics(self) -> StorageIOStats:
        """Frozen snapshot of the executor's own counters."""
        return StorageIOStats(
            workers=self.workers,
            max_pending=self.max_pending,
            submitted=self._submitted,
            completed=self._completed,
            in_flight=len(self._inflight),
            waiting=sum(1 for w in self._waiters if not w.done()),
            timeouts=self._timeouts,
            cancelled=self._cancelled,
            late_results=self._late,
        )

    def holds(self, buffers: Sequence[PageBuffer]) -> bool:
        """``True`` while an unfinished worker call holds any byte of ``buffers``."""
        return bool(self._holders(buffers))

    async def wait_released(self, buffers: Sequence[PageBuffer]) -> None:
        """Wait until no unfinished worker call holds any byte of ``buffers``.

        Cancelling this wait does not affect the calls.
        """
        while holders := self._holders(buffers):
            await asyncio.wait([asyncio.shield(c.finished) for c in holders])

    async def drain(self, *, later: bool = True) -> None:
        """Wait until every call handed to a worker (``later=False``: by now) has finished."""
        last = float("inf") if later else max(self._inflight, default=-1)
        while calls := [c.finished for i, c in self._inflight.items() if i <= last]:
            await asyncio.wait([asyncio.shield(f) for f in calls])

    async def aclose(self, *, timeout: float | None = None, keep_backend: bool = False) -> None:
        """Refuse new calls, drain (up to ``timeout``), close the backend (unless
        ``keep_backend``: a start that gave up leaves it to a retry), stop the workers.

        Returns within about ``2 * timeout``: if the drain times out, the backend is closed
        anyway and the stuck threads are left to finish on their own (they hold no loop
        state); a ``backend.close`` still running after ``timeout`` (a hung store) is left to
        finish on a daemon thread.  Raises what ``backend.close`` raises in time.
        """
        if self._closed:
            return
        self._closed = True
        for w in self._waiters:
            if not w.done():
                w.set_exception(StorageUnavailableError("StorageIO closed"))
        try:
            await asyncio.wait_for(self.drain(), timeout if timeout is not None else None)
        except asyncio.TimeoutError:
            log.warning("storage.io.close_drain_timeout", in_flight=len(self._inflight))
        try:
            # Its own thread: a stuck worker must not queue the close behind it, and a close
            # that hangs (a stalled store) must not hold the loop's shutdown or process exit.
            if not keep_backend:
                await self._close_backend(timeout)
        finally:
            self._pool.shutdown(wait=False)

    async def _close_backend(self, timeout: float | None) -> None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def settle(error: BaseException | None) -> None:
            if done.done():
                return
            if error is None:
                done.set_result(None)
            else:
                done.set_exception(error)

        def run() -> None:
            error: BaseException | None = None
            try:
                self.backend.close()
            except BaseException as exc:
                error = exc
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits
                loop.call_soon_threadsafe(settle, error)

        threading.Thread(target=run, name="aiocache-kv-storage-close", daemon=True).start()
        try:
            await asyncio.wait_for(asyncio.shield(done), timeout)
        except asyncio.TimeoutError:
            done.add_done_callback(consume)
            log.warning("storage.io.close_timeout", timeout=timeout)

    # -- the mechanism -----------------------------------------------------------------------

    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise OwnershipError("StorageIO is bound to another event loop")
        return loop

    def _holders(self, buffers: Sequence[PageBuffer]) -> list[IOCall]:
        want = [(b.ptr, b.ptr + b.nbytes) for b in buffers]
        return [
            c
            for c in self._inflight.values()
            if any(s < e2 and s2 < e for s, e in c.ranges for s2, e2 in want)
        ]

    async def call(
        self,
        what: str,
        fn: Callable[..., T],
        *args: Any,
        timeout: float | None = None,
        buffers: Sequence[PageBuffer] = (),
        on_release: Callable[[], None] | None = None,
    ) -> T:
        """Run ``fn(*args)`` on a worker; return its result on the loop.

        ``buffers`` are the memory the call uses (tracked for :meth:`wait_released`).
        ``on_release`` runs on the loop exactly once, when no worker can touch ``buffers`` any
        more: when the worker finishes (however late, whatever became of the caller), or at
        once if the call never reached a worker (closed, no slot in time, cancelled).

        Raises:
            StorageTimeoutError: no result within ``timeout`` (default ``default_timeout``)
                seconds, counting the wait for a slot.
            StorageUnavailableError: the executor is closed.
            InvalidInputError: ``timeout`` is not a finite number.
            StorageError: ``fn`` raised an exception outside the ``KVCacheError`` hierarchy
                (chained); ``KVCacheError``s propagate unchanged.
        """
        try:
            loop = self._bind_loop()
            if self._closed:
                raise StorageUnavailableError(f"StorageIO is closed ({what})")
            timeout = self.default_timeout if timeout is None else timeout
            check_real("timeout", timeout, minimum=None)  # a NaN deadline breaks the loop
            deadline = loop.time() + timeout
            await self._acquire(loop, deadline, what, timeout)
        except BaseException:
            if on_release is not None:
                on_release()  # never handed to a worker
            raise
        call, timer = self._submit(loop, what, fn, args, deadline, timeout, buffers, on_release)
        try:
            return await call.result  # type: ignore[no-any-return]
        except asyncio.CancelledError:
            self._cancelled += 1
            raise
        finally:
            timer.cancel()

    def has_slots(self, n: int) -> bool:
        """Whether :meth:`start` would hand over ``n`` calls now (on the loop)."""
        return (
            not self._closed
            and self._pending + n <= self.max_pending
            and all(w.done() for w in self._waiters)
        )

    def start(
        self,
        what: str,
        fn: Callable[..., Any],
        *args: Any,
        timeout: float,
        on_done: Callable[[asyncio.Future[Any]], None],
        buffers: Sequence[PageBuffer] = (),
        on_release: Callable[[], None] | None = None,
    ) -> bool:
        """:meth:`call` without a task, when a slot is free now (on the loop): hand
        ``fn(*args)`` to a worker at once and return ``True``; ``on_done(future)`` runs on
        the loop once the future holds the result or what :meth:`call` would raise
        (``StorageTimeoutError`` after ``timeout`` seconds: the worker's result is then
        dropped as late).  ``buffers`` and ``on_release`` as in :meth:`call`.  ``False``:
        closed, every slot taken or callers waiting for one: nothing was handed over and
        ``on_release`` did not run (:meth:`call` waits for a slot, or raises).

        Raises:
            InvalidInputError: ``timeout`` is not a finite number (nothing handed over).
            OwnershipError: called from another event loop.
        """
        loop = self._bind_loop()
        check_real("timeout", timeout, minimum=None)  # a NaN deadline breaks the loop
        if (
            self._closed
            or self._pending >= self.max_pending
            or any(not w.done() for w in self._waiters)
        ):
            return False
        self._pending += 1
        deadline = loop.time() + timeout
        call, timer = self._submit(loop, what, fn, args, deadline, timeout, buffers, on_release)
        call.result.add_done_callback(functools.partial(settled, timer, on_done))
        return True

    def _submit(
        self,
        loop: asyncio.AbstractEventLoop,
        what: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        deadline: float,
        timeout: float,
        buffers: Sequence[PageBuffer],
        on_release: Callable[[], None] | None,
    ) -> tuple[IOCall, asyncio.TimerHandle]:
        """Hand ``fn(*args)`` to a worker under the slot just taken; the call and the timer
        that fails it at ``deadline``.  A failed hand-off gives the slot back, runs
        ``on_release`` and raises."""
        call = IOCall(
            id=next(self._ids),
            what=what,
            result=loop.create_future(),
            finished=loop.create_future(),
            buffers=buffers,
            on_release=on_release,
        )
        self._inflight[call.id] = call
        try:
            self._pool.submit(self._work, loop, call, fn, args)
        except BaseException:
            del self._inflight[call.id]
            self._release()
            if on_release is not None:
                on_release()
            raise
        self._submitted += 1
        return call, loop.call_at(deadline, self._expire, call.result, what, timeout)

    async def _acquire(
        self, loop: asyncio.AbstractEventLoop, deadline: float, what: str, timeout: float
    ) -> None:
        if self._pending < self.max_pending and not any(not w.done() for w in self._waiters):
            self._pending += 1
            return
        grant: asyncio.Future[None] = loop.create_future()
        self._waiters.append(grant)
        timer = loop.call_at(deadline, self._expire, grant, f"{what} (waiting for a slot)", timeout)
        try:
            await grant
        except BaseException as exc:
            if grant.done() and not grant.cancelled() and grant.exception() is None:
                self._release()  # granted, then cancelled before we resumed: hand it back
            if isinstance(exc, asyncio.CancelledError):
                self._cancelled += 1
            raise
        finally:
            timer.cancel()

    def _release(self) -> None:
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done():
                w.set_result(None)  # the slot passes to the waiter; _pending unchanged
                return
        self._pending -= 1
        assert self._pending >= 0, f"slot count went negative: {self._pending}"

    def _expire(self, fut: asyncio.Future[Any], what: str, timeout: float) -> None:
        if not fut.done():
            self._timeouts += 1
            fut.set_exception(StorageTimeoutError(f"storage {what} did not finish in {timeout} s"))

    def _work(
        self,
        loop: asyncio.AbstractEventLoop,
        call: IOCall,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
    ) -> None:
        # Worker thread: run the blocking call, touch nothing but call_soon_threadsafe.
        result: Any = None
        error: BaseException | None = None
        try:
            result = fn(*args)
        except BaseException as exc:
            error = exc
        # RuntimeError: the loop is closed and nobody is left to receive the result.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._finish, call, result, error)

    def _finish(self, call: IOCall, result: Any, error: BaseException | None) -> None:
        # Loop thread.
        self._inflight.pop(call.id, None)
        self._completed += 1
        self._release()
        if call.on_release is not None:
            call.on_release()
        if not call.finished.done():
            call.finished.set_result(None)
        if call.result.done():
            self._late += 1
            log.debug(
                "storage.io.late_result",
                call=call.what,
                error=None if error is None else type(error).__name__,
            )
            return
        if error is None:
            call.result.set_result(result)
        elif isinstance(error, KVCacheError) or not isinstance(error, Exception):
            call.result.set_exception(error)
        else:
            wrapped = StorageError(f"storage {call.what} failed: {type(error).__name__}: {error}")
            wrapped.__cause__ = error
            call.result.set_exception(wrapped)
