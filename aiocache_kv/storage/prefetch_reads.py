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
from typing import TYPE_CHECKING

from aiocache_kv.storage.base import PageBuffer
from aiocache_kv.storage.batch_reports import BatchReports
from aiocache_kv.storage.prefetch_job import Part, PrefetchJob, report_batch, span_of
from aiocache_kv.storage.prefetch_landing import Landing, Parts
from aiocache_kv.storage.worker_pages import WorkerPages

if TYPE_CHECKING:
    from aiocache_kv.pools.allocator import PageAllocator, PageIds
    from aiocache_kv.storage.executor import StorageIO

__all__ = ["REPORT_GAP", "Readers", "start_plan", "start_range"]

#: a read worker wakes the loop to report landed batches at most this often (each wake-up
#: cost ~40 us of CPU, 2-3x that beside a store's copies; 16-page batches of 64 KiB pages end
#: every ~0.5-1 ms); the wait drains what landed when it ends, so no page that arrived in
#: time is lost to the gap, and nothing reads the reports before then: a read worker busy
#: up to 50 ms wakes the loop for its first batch and when it is done
REPORT_GAP = 0.05

#: what a batch reads: keys, buffers, identities (each page's chain hash), host pages
Batch = tuple[list[str], list[PageBuffer], list[bytes], "PageIds"]


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

    def batch(part: Part) -> Batch:
        assert isinstance(part, range)
        a, b = part.start, part.stop
        return keys[a:b], bufs[a - first : b - first], hashes[a:b], ids[a - first : b - first]

    return _hand_over(readers, job, parts, batch, land)


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

    def batch(part: Part) -> Batch:
        assert not isinstance(part, range)
        run = span_of(part)
        if run is not None:  # consecutive pages of one pool: slices
            pool, a, b = run
            bufs = list(map(buffers[pool].__getitem__, rows[a:b]))
            return job.keys[pool][a:b], bufs, job.hashes[a:b], reserved[a:b].copy()
        keys = [job.keys[pool][j] for pool, j in part]
        bufs = [buffers[pool][rows[j]] for pool, j in part]
        # every component of page j is bound to the page's own chain hash
        ids = [job.hashes[j] for _, j in part]
        return keys, bufs, ids, reserved[[j for _, j in part]]

    return _hand_over(readers, job, parts, batch, land)


def _hand_over(
    readers: Readers,
    job: PrefetchJob,
    parts: Parts,
    batch: Callable[[Part], Batch],
    land: Landing,
) -> list[asyncio.Future[None]]:
    """Hand ``parts`` (``batch(part)``: what each reads) to the workers, interleaved."""
    spread = readers.io.workers
    tasks: list[asyncio.Future[None]] = []
    reports: list[BatchReports] = []
    spread_parts: list[Parts] = []
    for w in range(min(spread, len(parts))):
        mine = parts[w::spread]
        batches = []
        pages = []
        for part in mine:
            keys, bufs, ids, rows = batch(part)
            batches.append((keys, bufs, ids))
            pages.append(rows)
        # a late read must never land in a reused page: leased if the wait ends first
        hold = WorkerPages(readers.alloc, pages)
        job.holds.append(hold)
        remaining = max(job.deadline - time.monotonic(), 0.001)
        reports.append(BatchReports(functools.partial(report_batch, land, mine)))
        spread_parts.append(mine)
        task = asyncio.ensure_future(
            readers.io.get_into_batches(
                batches,
                reports[-1],
                timeout=remaining,
                on_release=hold.release,
                report_gap=REPORT_GAP,
            )
        )
        tasks.append(task)
    land.started(reports, spread_parts)
    return tasks
