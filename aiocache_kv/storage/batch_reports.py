"""``BatchReports``: the results of a worker's read batches on their way to the event loop.

:meth:`~aiocache_kv.storage.executor.StorageIO.get_into_batches` runs a list of batches on one
worker; each batch's result is :meth:`BatchReports.put` by the worker and reported on the loop
by :meth:`BatchReports.drain`, in order.  The loop may also tell the worker to start no batch
after a given one (:meth:`BatchReports.stop_after`: a prefetch that read ahead of its existence
check learns where the leading run ends).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aiocache_kv.storage.base import PageBuffer

__all__ = ["BatchReports", "Batches", "batch_runner", "part_runner"]

#: read batches: ``(keys, buffers, identities or None)`` each
Batches = Sequence[tuple[Sequence[str], Sequence["PageBuffer"], Sequence[bytes] | None]]
#: ``get_into(keys, buffers, identities=...)``: a backend's read
GetInto = Callable[..., list[bool]]


class BatchReports:
    """The results of :meth:`StorageIO.get_into_batches`' batches on their way to the loop.

    The worker :meth:`put` s each batch's result as it ends; :meth:`drain`, on the loop, runs
    ``on_batch(i, result)`` for every result put so far, in order (the worker wakes the loop
    to drain; a caller may drain at any time, e.g. when its deadline passes).
    """

    __slots__ = ("_on_batch", "_ready", "in_flight", "last")

    def __init__(self, on_batch: Callable[[int, list[bool] | BaseException], None]) -> None:
        self._on_batch = on_batch
        self._ready: collections.deque[tuple[int, list[bool] | BaseException]] = collections.deque()
        #: the worker starts no batch after this index (set by the loop: :meth:`stop_after`)
        self.last = sys.maxsize
        #: batches a worker took and has not put yet (:func:`part_runner` adds an index
        #: before it checks whether it may start it: once the loop set :attr:`last`, what
        #: may still be read is here)
        self.in_flight: set[int] = set()

    def put(self, i: int, result: list[bool] | BaseException) -> None:
        """Worker thread: batch ``i`` ended with ``result`` (deque appends are thread-safe)."""
        self._ready.append((i, result))

    def drain(self) -> None:
        """Loop thread: report every batch put so far, in order."""
        ready = self._ready
        while ready:
            i, result = ready.popleft()
            self._on_batch(i, result)

    def stop_after(self, i: int) -> None:
        """Loop thread: start no batch after batch ``i`` (-1: none more); a batch already
        running ends and reports as usual.  (One int written under the GIL, read by the
        worker before each batch, like the deadline.)"""
        self.last = i


def batch_runner(
    get_into: GetInto,
    batches: Batches,
    reports: BatchReports,
    loop: asyncio.AbstractEventLoop,
    stop: float,
    report_gap: float,
) -> Callable[[], None]:
    """The worker-thread body that reads ``batches`` in turn (:func:`part_runner` over
    copies of their lists, in order)."""
    jobs = [(list(k), list(b), None if i is None else list(i)) for k, b, i in batches]
    return part_runner(
        get_into, jobs.__getitem__, iter(range(len(jobs))), reports, stop, report_gap, loop
    )


def part_runner(
    get_into: GetInto,
    batch: Callable[[int], tuple[Sequence[str], Sequence[PageBuffer], Sequence[bytes] | None]],
    order: Iterator[int],
    reports: BatchReports,
    stop: float,
    report_gap: float,
    loop: asyncio.AbstractEventLoop | None = None,
) -> Callable[[], None]:
    """A worker-thread body: read batch after batch taken from ``order`` (an iterator
    several workers may share: each index goes to one of them), ``batch(i)`` building
    batch ``i``'s lists in the worker; each result (or exception: the next batch still
    runs) is put to ``reports``, and ``loop`` (default: the running one) is woken to drain
    at most every ``report_gap`` seconds (the first batch at once) and at the end.  No
    batch starts after ``time.monotonic()`` passes ``stop``, or past ``reports.last``.
    Results reach the loop only through ``call_soon_threadsafe``."""
    target = asyncio.get_running_loop() if loop is None else loop

    def run() -> None:
        last = -float("inf")  # the first batch is reported at once
        unposted = False
        try:
            for i in order:
                reports.in_flight.add(i)  # before the check (see BatchReports.in_flight)
                if time.monotonic() >= stop or i > reports.last:  # deadline, or told to stop
                    reports.in_flight.discard(i)
                    return
                res: list[bool] | BaseException
                try:
                    keys, bufs, ids = batch(i)
                    res = get_into(keys, bufs, identities=ids)
                except Exception as exc:  # reported per batch; the next one still runs
                    res = exc
                reports.in_flight.discard(i)  # (its pages are not written any more)
                reports.put(i, res)
                unposted = True
                now = time.monotonic()
                if now - last >= report_gap:
                    last, unposted = now, False
                    with contextlib.suppress(RuntimeError):  # a closed loop: nobody to tell
                        target.call_soon_threadsafe(reports.drain)
        finally:
            if unposted:
                with contextlib.suppress(RuntimeError):
                    target.call_soon_threadsafe(reports.drain)

    return run
