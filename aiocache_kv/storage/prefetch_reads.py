"""How a prefetch's reads are cut into backend calls and handed to the storage workers (the
mechanics of :meth:`PrefetchingTier._fetch <aiocache_kv.storage.prefetch.PrefetchingTier>`).

Each call reads at most ``prefetch_batch_pages`` pages, spread over every worker (a read of one
batch would otherwise run on one worker while the others idle), interleaved so that the
leading pages land first.  Each worker's batches go in one hand-off
(:meth:`~aiocache_kv.storage.executor.StorageIO.get_into_batches`: a hand-off per batch cost
~60 us of loop time) and report in order to the prefetch's
:class:`~aiocache_kv.storage.prefetch_landing.Landing`.  A worker's host pages are leased if
the wait for it ends before it returns (:class:`~aiocache_kv.storage.worker_pages.WorkerPages`:
a late read never lands in a reused page).

The usual plan, a run of KV pages, is cut into ranges (:func:`start_range`): every batch's
lists are slices, no Python step a page.  Plans over several pools go pair by pair
(:func:`start_plan`).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiocache_kv.storage.base import PageBuffer
from aiocache_kv.storage.batch_reports import BatchReports, part_runner
from aiocache_kv.storage.prefetch_job import PrefetchJob, report_batch, span_of
from aiocache_kv.storage.prefetch_landing import Landing, Parts
from aiocache_kv.storage.worker_pages import InFlightPages

if TYPE_CHECKING:
    from aiocache_kv.pools.allocator import PageAllocator, PageIds
    from aiocache_kv.storage.executor import StorageIO

__all__ = ["REPORT_GAP", "TIMER_GRACE", "Readers", "start_plan", "start_range"]

#: a read worker wakes the loop to report landed batches at most this often (each wake-up
#: cost ~40 us of CPU, 2-3x that beside a store's copies; 16-page batches of 64 KiB pages end
#: every ~0.5-1 ms); the wait drains what landed when it ends, so no page that arrived in
#: time is lost to the gap, and nothing reads the reports before then: a read worker busy
#: up to 50 ms wakes the loop for its first batch and when it is done
REPORT_GAP = 0.05

#: seconds a read call's own timer waits past the prefetch's deadline (see _start_batches)
TIMER_GRACE = 0.05

#: what a part reads: keys, buffers, identities (each page's chain hash)
Batch = tuple[list[str], list[PageBuffer], list[bytes]]


@dataclass(frozen=True)
class Readers:
    """What the reads run on: the workers, each pool's host page buffers, the host
    allocator (for leases), and the most pages a call."""

    io: StorageIO
    buffers: Sequence[Sequence[PageBuffer]]
    alloc: PageAllocator
    batch_pages: int

    def chunk(self, pages: int) -> int:
        """Pages a read call for a plan of ``pages``."""
        return max(1, min(self.batch_pages, -(-pages // self.io.workers)))


def start_range(
    readers: Readers, job: PrefetchJob, first: int, end: int, land: Landing
) -> list[asyncio.Future[None]]:
    """Start reading the KV pages ``first..end-1`` of ``job``; returns the read tasks."""
    chunk = readers.chunk(end - first)
    parts: Parts = [range(a, min(a + chunk, end)) for a in range(first, end, chunk)]
    ids = job.pages.numpy()[first:end].copy()  # host page of each prefetch page
    bufs = list(map(readers.buffers[0].__getitem__, ids.tolist()))
    keys, hashes = job.keys[0], job.hashes

    def batch(i: int) -> Batch:
        part = parts[i]
        assert isinstance(part, range)
        a, b = part.start, part.stop
        return keys[a:b], bufs[a - first : b - first], hashes[a:b]

    def pages_of(i: int) -> PageIds:
        part = parts[i]
        assert isinstance(part, range)
        pages: PageIds = ids[part.start - first : part.stop - first]
        return pages

    return _hand_over(readers, job, parts, batch, bufs, pages_of, land)


def start_plan(
    readers: Readers, job: PrefetchJob, plan: list[tuple[int, int]], land: Landing
) -> list[asyncio.Future[None]]:
    """Start reading ``plan`` (``(pool, page)``, pools in order, pages ascending); returns
    the read tasks."""
    chunk = readers.chunk(len(plan))
    parts: Parts = [plan[a : a + chunk] for a in range(0, len(plan), chunk)]
    reserved = job.pages.numpy()  # one conversion; a torch index per page costs ~1 us
    rows = reserved.tolist()  # host page of each prefetch page (one call, not one a part)
    buffers = readers.buffers

    def batch(i: int) -> Batch:
        part = parts[i]
        assert not isinstance(part, range)
        run = span_of(part)
        if run is not None:  # consecutive pages of one pool: slices
            pool, a, b = run
            return (
                job.keys[pool][a:b],
                list(map(buffers[pool].__getitem__, rows[a:b])),
                job.hashes[a:b],
            )
        keys = [job.keys[pool][j] for pool, j in part]
        bufs = [buffers[pool][rows[j]] for pool, j in part]
        # every component of page j is bound to the page's own chain hash
        return keys, bufs, [job.hashes[j] for _, j in part]

    def pages_of(i: int) -> PageIds:
        part = parts[i]
        assert not isinstance(part, range)
        return reserved[sorted({j for _, j in part})]

    every = [buffers[pool][rows[j]] for pool, j in plan]
    return _hand_over(readers, job, parts, batch, every, pages_of, land)


def _hand_over(
    readers: Readers,
    job: PrefetchJob,
    parts: Parts,
    batch: Callable[[int], Batch],
    buffers: list[PageBuffer],
    pages_of: Callable[[int], PageIds],
    land: Landing,
) -> list[asyncio.Future[None]]:
    """Hand ``parts`` (``batch(i)``: what part ``i`` reads, built by the worker that reads
    it) to every worker at once: each takes the next part not taken yet when it is free
    (one shared order: the leading pages go first, and no worker idles while another has
    parts queued).  ``buffers``: every buffer the parts read; ``pages_of(i)``: part ``i``'s
    host pages."""
    alloc = readers.alloc
    spread = min(readers.io.workers, len(parts))
    order = iter(range(len(parts)))  # shared: next() hands each index to one worker
    reports = BatchReports(functools.partial(report_batch, land, parts))
    # a late read must never land in a reused page: the pages of the parts still in flight
    # when the wait ends are leased, until every worker let go
    hold = InFlightPages(alloc, pages_of, reports.in_flight)
    left = [spread]

    def released() -> None:
        left[0] -= 1
        if left[0] == 0:
            hold.release()

    job.holds.append(hold)
    land.started([reports], [parts])
    remaining = max(job.deadline - time.monotonic(), 0.001)
    stop = time.monotonic() + remaining
    tasks: list[asyncio.Future[None]] = []
    for w in range(spread):
        run = part_runner(readers.io.backend.get_into, batch, order, reports, stop, REPORT_GAP)
        tasks.append(_start(readers.io, run, reports, buffers, remaining, released))
        if w == 0 and spread > 1:
            time.sleep(0)  # let go of the GIL: the first worker starts now, not after this
    return tasks


def _start(
    io: StorageIO,
    run: Callable[[], None],
    reports: BatchReports,
    buffers: list[PageBuffer],
    timeout: float,
    on_release: Callable[[], None],
) -> asyncio.Future[None]:
    """``run`` handed to a worker now, without a task or a turn of the loop, where a slot
    is free (``StorageIO.start``; else a task waits for one: ``StorageIO.call``).  The
    future ends when ``run`` does, the reports drained first; cancelling it stops the wait,
    not the worker (``on_release`` runs once the worker let go).  The call's own timer
    fires :data:`TIMER_GRACE` after ``timeout``, so the prefetch's wait, which ends at that
    deadline, abandons a read still running then (what landed counts, the job is partial)
    rather than seeing it fail."""
    limit = timeout + TIMER_GRACE
    if not io.has_slots(1):

        async def wait_for_slot() -> None:
            try:
                await io.call(
                    "get_into", run, timeout=limit, buffers=buffers, on_release=on_release
                )
            finally:
                reports.drain()

        return asyncio.ensure_future(wait_for_slot())
    out: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def done(fut: asyncio.Future[Any]) -> None:
        reports.drain()  # what landed is reported before the wait ends
        error = None if fut.cancelled() else fut.exception()  # (retrieved: a late timeout)
        if out.done():
            return
        if fut.cancelled():
            out.cancel()
        elif error is not None:
            out.set_exception(error)
        else:
            out.set_result(None)

    started = io.start(
        "get_into", run, timeout=limit, on_done=done, buffers=buffers, on_release=on_release
    )
    assert started, "a free slot was not taken"
    return out
