"""Bounded waits for device pages: ``alloc_wait(n, timeout=)`` and ``load_back(m, timeout=)``.

A request that finds the device pool full may wait for pages to come back instead of failing
at once.  :class:`CapacityWaiters` keeps the waiters in one FIFO line, on the loop.  A waiter
is an *attempt* (a synchronous step that takes the pages or raises ``CapacityError`` having
changed nothing) and a future.  Whenever pages may have come back (the core's
``capacity_changed``: pages returned to the free list, a node left without a pin, a copy that
landed), one pass is scheduled on the loop (``call_soon``, never run inside the mutation that
caused it).  It runs the attempts in line order and stops at the first that still cannot
have its pages, so a later, smaller request never overtakes an earlier one (a plain ``alloc``
does not queue: it takes what is there).  Nothing polls: with no waiter the hook is one test.

A waiter leaves nothing behind.  When its deadline passes (a timer on the loop) or its task is
cancelled, it leaves the line; if its attempt had already succeeded when the cancellation
arrived, what it took is given back (``undo``).  Rule 1 holds: attempts, results and timers
all run on the loop thread.  With tensor parallelism a clock-bounded wait is refused: a
deadline that passes on one rank and not on another would make their trees differ.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch

from aiocache_kv.core import CacheCore
from aiocache_kv.errors import CacheClosedError, CapacityError, InvalidInputError
from aiocache_kv.numeric import check_real
from aiocache_kv.pools import PageState
from aiocache_kv.transfer.ops import Acquire

T = TypeVar("T")

__all__ = ["CapacityWaiters"]


class _Waiter(Generic[T]):
    __slots__ = ("attempt", "future")

    def __init__(self, attempt: Callable[[], T], future: asyncio.Future[T]) -> None:
        self.attempt = attempt
        self.future = future


class CapacityWaiters:
    """The line of requests waiting for device pages (loop thread only)."""

    def __init__(self, core: CacheCore) -> None:
        self._core = core
        self._line: deque[_Waiter[Any]] = deque()
        self._scheduled = False
        self._closed = False

    def __len__(self) -> int:
        return len(self._line)

    def check_invariants(self) -> None:
        """The core hears of capacity changes for the line while anybody is in it (a pass
        that emptied it leaves the hook until the last waiter it served runs again).

        Raises:
            AssertionError: somebody is in line and the core would not tell the line.
        """
        assert not self._line or self._core.on_capacity == self.notify, (
            f"no capacity hook with {len(self._line)} in line"
        )

    def _listen(self) -> None:
        """Hear of capacity changes exactly while someone is in line (``relisten``): after
        each change of the line but the passes' (each waiter they serve leaves ``acquire``
        through its ``finally``, which listens again)."""
        want = self.notify if self._line else None
        if self._core.on_capacity != want:
            self._core.listen_capacity(want)

    def notify(self) -> None:
        """Pages may have come back: serve the line in a pass of its own (soon, on the loop)."""
        if self._line and not self._scheduled and not self._closed:
            loop = self._core.loop
            assert loop is not None
            self._scheduled = True
            loop.call_soon(self._serve)

    def _serve(self) -> None:
        self._scheduled = False
        line = self._line
        while line and not self._closed:
            w = line[0]
            if w.future.done():  # timed out or cancelled, not yet gone
                line.popleft()
                continue
            try:
                value = w.attempt()
            except CapacityError:
                return  # still too few: the ones behind wait too (first come, first served)
            except Exception as exc:  # e.g. its handle was released meanwhile
                line.popleft()
                w.future.set_exception(exc)
                continue
            line.popleft()
            w.future.set_result(value)

    async def acquire(
        self,
        attempt: Callable[[], T],
        timeout: float,
        describe: Callable[[], str],
        undo: Callable[[T], None] | None = None,
    ) -> T:
        """``attempt()`` now if nobody waits (or ``timeout`` is 0), else in line; retried
        whenever pages may have come back, until ``timeout`` seconds passed.

        Raises:
            CapacityError: ``describe()``, once the deadline passed.
            CacheClosedError: the cache closed while waiting.
            Whatever ``attempt`` raises other than ``CapacityError``.
        """
        if not self._line or timeout == 0:
            try:
                return attempt()
            except CapacityError:
                if timeout == 0:
                    raise
        loop = self._core.loop
        assert loop is not None
        fut: asyncio.Future[T] = loop.create_future()
        w: _Waiter[T] = _Waiter(attempt, fut)
        self._line.append(w)
        self._listen()
        # no pass now: nothing came back since the attempt above, or the head's last one
        timer = loop.call_later(timeout, self._expire, w, describe)
        try:
            return await fut
        except asyncio.CancelledError:
            if undo is not None and fut.done() and not fut.cancelled() and not fut.exception():
                undo(fut.result())  # served while its task was being cancelled: give it back
            raise
        finally:
            timer.cancel()
            if not fut.done():
                fut.cancel()
            elif not fut.cancelled():
                fut.exception()  # retrieved: raised above, or dropped with the cancellation
            head = bool(self._line) and self._line[0] is w
            with contextlib.suppress(ValueError):
                self._line.remove(w)
            self._listen()
            if head:
                self.notify()  # the next in line may fit now

    def _expire(self, w: _Waiter[T], describe: Callable[[], str]) -> None:
        if not w.future.done():
            w.future.set_exception(CapacityError(describe()))

    def close(self) -> None:
        """The cache is closing: every waiter fails with ``CacheClosedError``."""
        self._closed = True
        for w in self._line:
            if not w.future.done():
                w.future.set_exception(CacheClosedError("cache closed while waiting for pages"))
        self._line.clear()
        self._listen()

    # ------------------------------------------------------------------ the two waits

    def check_timeout(self, timeout: object) -> float:
        """``timeout`` as seconds for a bounded wait.

        Raises:
            InvalidInputError: not a finite number in ``[0, MAX_SECONDS]``, or a cache with
                tensor parallelism (a deadline is one rank's clock; the ranks would differ).
        """
        t = check_real("timeout", timeout)
        if self._core.coordinator.deferred:
            raise InvalidInputError(
                "timeout= is refused with tensor parallelism: a deadline passes on one rank's "
                "clock, and ranks that decided differently would hold different trees"
            )
        return t

    async def alloc(self, n: int, timeout: float) -> torch.Tensor:
        """:meth:`HiCache.alloc`'s slots for ``n`` tokens (> 0), waiting up to ``timeout``
        seconds, in line, for pages to come back.

        Raises:
            CapacityError: more pages than the pool has (at once), or still too few when
                the deadline passed (nothing taken).
            CacheClosedError: the cache closed while waiting.
        """
        core = self._core
        p = core.page_size
        pages = -(-n // p)
        alloc = core.dev_alloc
        assert alloc is not None
        if pages > alloc.num_pages:
            raise CapacityError(f"{core.capacity_report(pages)}: more than the pool holds")

        def give_back(slots: torch.Tensor) -> None:
            core.free_device([slots[::p] // p])

        return await self.acquire(
            lambda: core.alloc_device(pages, PageState.HELD, slots_of=p),
            timeout,
            lambda: f"{core.capacity_report(pages)}; waited {timeout:g} s",
            give_back,
        )

    def loads(self, timeout: float, need: Callable[[], int]) -> Acquire:
        """The ``acquire`` of a load-back bounded by ``timeout`` seconds in all (``need()``:
        the pages its host run needs now, for the message)."""
        loop = self._core.loop
        assert loop is not None
        deadline = loop.time() + timeout

        async def acquire(
            attempt: Callable[[], list[asyncio.Future[None]]],
        ) -> list[asyncio.Future[None]]:
            left = max(0.0, deadline - loop.time())
            return await self.acquire(attempt, left, describe)

        def describe() -> str:
            return f"{self._core.capacity_report(need())}; waited {timeout:g} s"

        return acquire
