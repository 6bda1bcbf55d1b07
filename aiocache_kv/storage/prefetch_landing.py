"""Where a prefetch's read batches land on the loop: which pages count, and which batches are
not started any more (the bookkeeping of :meth:`PrefetchingTier._fetch
<aiocache_kv.storage.prefetch.PrefetchingTier>`).

Pages count from the moment the run they may belong to is known (:attr:`Landing.limit`):

- after an existence check, the leading run it reported (batches read ahead of the check wait
  in :attr:`Landing.early` until then, :meth:`Landing.run_known`);
- with the reads as the check (:attr:`Landing.sole`: the read-ahead covers every page asked
  for), every page at once.  A page that does not read intact (absent, or corrupt: the backend
  drops a corrupt page) ends the run there: :attr:`Landing.first_bad`, and no batch past it
  is started (:meth:`Landing.cut`).  A batch whose read raised tells nothing of its pages:
  the run is not cut there, the job is failed (its pages never arrived).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable
from typing import TYPE_CHECKING

from aiocache_kv.storage.batch_reports import BatchReports
from aiocache_kv.storage.prefetch_job import Part, PrefetchJob, span_of

if TYPE_CHECKING:
    from aiocache_kv.stats import StorageCounters

__all__ = ["Landing", "Part", "Parts"]

#: a read worker's batches
Parts = list[Part]


def first_page(part: Part) -> int:
    """The first page a batch reads."""
    return part.start if isinstance(part, range) else part[0][1]


class Landing:
    """The ``landed(part, result)`` of one prefetch's reads (loop thread only)."""

    __slots__ = (
        "all_in",
        "counters",
        "done",
        "early",
        "first_bad",
        "got",
        "job",
        "landed_firsts",
        "limit",
        "needed",
        "parts",
        "raised",
        "reports",
    )

    def __init__(self, job: PrefetchJob, counters: StorageCounters, sole: bool = False) -> None:
        self.job = job
        self.counters = counters
        #: set once the wait is over: a batch reported later is not counted
        self.done = False
        #: pages ``[0, limit)`` count (-1: not known yet, the check has not answered)
        self.limit = len(job.loaded[0]) if sole else -1
        #: batches that landed before the run was known, with their results
        self.early: list[tuple[Part, list[bool] | BaseException]] = []
        #: with the reads as the check: the first page that did not read intact (else the
        #: page count); ``None``: an existence check tells the run
        self.first_bad: int | None = len(job.loaded[0]) if sole else None
        #: every read worker's reports and batches, as started
        self.reports: list[BatchReports] = []
        self.parts: list[Parts] = []
        #: with the reads as the check: set once every batch before :attr:`first_bad` was
        #: reported (what follows cannot count: the wait is over)
        self.all_in: asyncio.Future[None] | None = None
        #: the first page of every batch reported, and how many batches must be
        self.landed_firsts: list[int] = []
        self.needed = 0
        self.got = 0  #: batches reported of those
        #: with the reads as the check: reads that raised, by their batch's first page
        self.raised: list[tuple[int, BaseException]] = []

    @property
    def sole(self) -> bool:
        """Whether the reads are the existence check."""
        return self.first_bad is not None

    def started(self, reports: list[BatchReports], parts: list[Parts]) -> None:
        """Reads started: ``reports[w]`` reports the batches ``parts[w]``."""
        self.reports += reports
        self.parts += parts
        if self.first_bad is not None:
            if self.all_in is None:
                self.all_in = asyncio.get_running_loop().create_future()
            self._count_needed()

    def _count_needed(self) -> None:
        """Recount the batches that must be reported (all before :attr:`first_bad`)."""
        bound = self.first_bad
        assert bound is not None and self.all_in is not None
        self.needed = sum(1 for mine in self.parts for p in mine if first_page(p) < bound)
        self.got = sum(1 for f in self.landed_firsts if f < bound)
        self._maybe_all_in()

    def _maybe_all_in(self) -> None:
        assert self.all_in is not None
        if self.got >= self.needed and not self.all_in.done():
            self.all_in.set_result(None)

    def stop_past(self, end: int) -> None:
        """Start no batch whose first page is ``end`` or later (a running one ends as usual)."""
        for rep, mine in zip(self.reports, self.parts, strict=True):
            keep = sum(1 for part in mine if first_page(part) < end) - 1
            rep.stop_after(min(rep.last, keep))

    def run_known(self, end: int) -> None:
        """The check answered: pages ``[0, end)`` count; batches past them are not started,
        and the batches that landed early are counted now."""
        self.limit = end
        self.stop_past(end)
        early, self.early = self.early, []
        for part, res in early:
            self(part, res)

    def __call__(self, part: Part, res: list[bool] | BaseException) -> None:
        if self.done:
            return
        if self.all_in is not None:
            self._arrived(part, res)
            return
        self._land(part, res)

    def _arrived(self, part: Part, res: list[bool] | BaseException) -> None:
        """With the reads as the check: land ``part``, then see whether all are in."""
        self._land(part, res)
        first = first_page(part)
        self.landed_firsts.append(first)
        assert self.first_bad is not None
        if first < self.first_bad:  # (a cut inside it recounted the others)
            self.got += 1
            self._maybe_all_in()

    def _land(self, part: Part, res: list[bool] | BaseException) -> None:
        end = self.limit
        if end < 0:  # read ahead of the check: counted once the run is known
            self.early.append((part, res))
            return
        job = self.job
        if isinstance(res, BaseException):
            if self.first_bad is not None:  # judged once the run is known (judge_raised)
                self.raised.append((first_page(part), res))
            elif first_page(part) < end:  # (a batch wholly past the run concerns nobody)
                self.fail(res)
            return
        pairs: Iterable[tuple[int, int]]
        if isinstance(part, range):
            run: tuple[int, int, int] | None = (0, part.start, part.stop)
            pairs = zip(itertools.repeat(0), part)
        else:
            run, pairs = span_of(part), part
        if run is not None and run[2] <= end and len(res) == run[2] - run[1] and all(res):
            pool, a, b = run  # a whole run of one pool, every page intact: one slice
            job.loaded[pool][a:b] = res
            return
        for (pool, j), good in zip(pairs, res, strict=True):
            if j < end:
                job.loaded[pool][j] = good
                if not good and pool == 0:
                    self._bad(j)

    def fail(self, error: BaseException) -> None:
        """A read that counts raised: the job failed."""
        self.counters.storage_errors += 1
        self.job.failed, self.job.error = True, repr(error)

    def judge_raised(self) -> None:
        """With the reads as the check, once the run is known: the reads that raised for a
        batch starting inside it fail the job (those past it concern nobody)."""
        assert self.first_bad is not None
        for first, error in self.raised:
            if first < self.first_bad:
                self.fail(error)
        self.raised.clear()

    def _bad(self, j: int) -> None:
        """Page ``j`` (of the KV pool) did not read intact."""
        if self.first_bad is None:  # inside the run the check reported: it vanished
            self.job.vanished.append(j)
        elif j < self.first_bad:  # the reads are the check: the run ends here
            self.first_bad = j
            self.stop_past(j)
            if self.all_in is not None:
                self._count_needed()
