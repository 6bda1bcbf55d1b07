"""The storage tier's prefetch path: L3 -> L2, committing only the leading run that arrived.

``prefetch`` pins the cached prefix, asks storage for the leading run of present page keys
(one batched call), reserves host pages for them (at most half the host pool across every
prefetch in flight), reads them in chunks under page leases (a backend with ``read_ahead``,
Mooncake: beside the check), and commits only the leading run of pages that arrived and
verified.  Leftover pages are freed at once; the ones a late read
still writes into wait in quarantine (docs/ARCHITECTURE.md, rule 2).  With tensor parallelism
the committed end is agreed across ranks.  Storage faults never escape: the result reports
what was committed, possibly nothing.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import TYPE_CHECKING

import torch

from aiocache_kv.components import HitPolicy, feasible_ends
from aiocache_kv.config import PrefetchPolicy
from aiocache_kv.distributed.coordinator import AgreedCoordinator
from aiocache_kv.errors import KVCacheError
from aiocache_kv.events import BlockRemoved
from aiocache_kv.logs import get_logger
from aiocache_kv.storage import prefetch_reads
from aiocache_kv.storage.base import StorageBackend
from aiocache_kv.storage.prefetch_job import (
    PrefetchJob,
    last_true,
    leading_run,
)
from aiocache_kv.storage.prefetch_landing import Landing
from aiocache_kv.storage.prefetch_result import PrefetchResult, PrefetchStatus, prefetch_timeout
from aiocache_kv.storage.tier_base import StorageTierBase
from aiocache_kv.tracing import span
from aiocache_kv.tree.hashing import chain_hashes
from aiocache_kv.tree.node import Node, Tier, lacking

if TYPE_CHECKING:
    from aiocache_kv.core import CacheCore
    from aiocache_kv.namespace import Namespace

__all__ = ["PrefetchResult", "PrefetchStatus", "PrefetchingTier", "prefetch_timeout"]

log = get_logger(__name__)


class PrefetchingTier(StorageTierBase):
    """The prefetch half of the storage tier (reservations, reads, commits)."""

    def __init__(self, core: CacheCore, backend: StorageBackend) -> None:
        super().__init__(core, backend)
        self.reserved: dict[int, torch.Tensor] = {}  # prefetch id -> host pages not yet in tree
        self._jobs: dict[int, PrefetchJob] = {}  # prefetches whose anchor is pinned
        self._ids = 0
        #: drops in progress (``purge.py``): (namespace, page hash or None: all of it)
        self._fences: list[tuple[Namespace, bytes | None]] = []

    def anchors(self) -> list[Node]:
        """Nodes pinned by prefetches in flight (one pin each, like a handle)."""
        return [job.anchor for job in self._jobs.values()]

    @property
    def reserved_pages(self) -> int:
        """Host pages held by prefetches in flight (not yet in the tree)."""
        return sum(p.numel() for p in self.reserved.values())

    async def prefetch(
        self,
        ns: Namespace,
        tokens: list[int],
        n: int,
        policy: PrefetchPolicy,
        min_tokens: int | None = None,
    ) -> PrefetchResult:
        """Bring the storage-resident continuation of ``tokens[:n]`` into the host tier (in
        an ``aiocache_kv.prefetch`` span when tracing is on).  ``min_tokens``: the fewest
        uncached tokens worth a storage query (default ``prefetch_threshold_tokens``; a
        warm-up passes 0)."""
        with span("aiocache_kv.prefetch", tokens=n, policy=policy.value) as sp:
            res = await self._prefetch(ns, tokens, n, policy, min_tokens)
            sp.set_attribute("aiocache_kv.status", res.status.value)
            sp.set_attribute("aiocache_kv.cached_tokens", res.cached_tokens)
            sp.set_attribute("aiocache_kv.hit_tokens", res.hit_tokens)
            return res

    async def _prefetch(
        self,
        ns: Namespace,
        tokens: list[int],
        n: int,
        policy: PrefetchPolicy,
        min_tokens: int | None = None,
    ) -> PrefetchResult:
        """See :meth:`prefetch`.

        With tensor parallelism everything that shapes the tree happens synchronously here
        (pin, host reservation) or when the agreed end is committed, never at a moment chosen
        by I/O timing.  With one rank the reservation takes free host pages only, and host
        pages are evicted for more only once storage said which pages it has (a miss, and
        the cold prompt of every arrival is one, flushed half the host pool for nothing).
        """
        core = self.core
        cfg = core.config
        tree = core.tree
        p = cfg.page_size
        anchor, cached = tree.match(ns, tokens, n, pin=True)
        self.counters.prefetch_queries += 1
        least = cfg.prefetch_threshold_tokens if min_tokens is None else min_tokens
        if n - cached < max(least, p):
            tree.unpin(anchor)
            return PrefetchResult(PrefetchStatus.BELOW_THRESHOLD, cached, 0, 0)
        assert core.host_pool is not None
        want = min((n - cached) // p, core.host_pool.num_pages // 2 - self.reserved_pages)
        pages = None
        if want > 0 and core.coordinator.deferred:  # TP: every rank reserves the same now
            pages = core.alloc_host(want)
        elif want > 0:  # free pages now; evicting for more waits until storage has them
            free = core.host_alloc.num_free if core.host_alloc is not None else 0
            pages = core.alloc_host(min(want, free), evict=False)
        if pages is None:
            tree.unpin(anchor)
            return PrefetchResult(PrefetchStatus.PARTIAL, cached, 0, 0, "host pool full")
        prev = tree.seed(ns) if anchor.parent is None else tree.block_hashes(anchor)[-1]
        hashes = chain_hashes(prev, tokens[cached:n], p)  # ask for all, load what fits
        if policy is PrefetchPolicy.WAIT_COMPLETE:
            timeout = cfg.storage_timeout * 2
        else:
            timeout = prefetch_timeout(
                n - cached,
                cfg.prefetch_timeout_base,
                cfg.prefetch_timeout_per_1k,
                cfg.prefetch_timeout_max,
            )
        self._ids += 1
        job = PrefetchJob(
            rid=self._ids,
            ns=ns,
            tokens=tokens,
            cached=cached,
            anchor=anchor,
            pages=pages,
            keys=[self._keys(ns, hashes, pool) for pool in range(self.pools)],
            hashes=hashes,
            deadline=time.monotonic() + timeout,
            before=self._valid_before(anchor, cached // p),
            want=want,
        )
        job.dropped = any(self._fence_hits(job, f) for f in self._fences)
        self.reserved[job.rid] = pages
        self._jobs[job.rid] = job
        loop = asyncio.get_running_loop()
        if core.coordinator.deferred:
            # the reads run in their own task: the other ranks need this rank's answer even
            # if the caller goes away; the agreed end is committed in ticket order
            work = loop.create_task(self._fetch(job))
            self._track(work)

            async def ready() -> None:
                await asyncio.wait([work])
                for pool in range(self.pools):
                    await self.io.wait_released(self._bufs(job.pages, pool))

            width = (n - cached) // p  # the same on every rank: the tree shapes agree

            def pad(flags: list[bool]) -> list[int]:
                return [int(f) for f in flags] + [0] * (width - len(flags))

            def pack() -> list[int]:
                vec = [job.hits, int(not job.failed), *pad(self._feasible(job))]
                for pool, _, _ in self._trailing:  # which sidecar pages every rank holds
                    vec += pad(job.loaded[pool] if job.loaded else [])
                return vec

            def apply(agreed: list[int]) -> None:
                job.hits, job.failed = agreed[0], agreed[1] == 0  # what every rank had
                end = max((e + 1 for e, f in enumerate(agreed[2 : 2 + width]) if f), default=0)
                for k, (pool, _, _) in enumerate(self._trailing):
                    held = agreed[2 + width * (k + 1) : 2 + width * (k + 2)]
                    job.loaded[pool] = [bool(f) for f in held[: len(job.loaded[pool])]]
                self._finish(job, end)

            extra = 2 + width * (1 + len(self._trailing))
            coord = core.coordinator
            assert isinstance(coord, AgreedCoordinator)
            req = coord.agreement(ready, width=extra, pack=pack, apply=apply)
            if policy is PrefetchPolicy.BEST_EFFORT:
                return PrefetchResult(PrefetchStatus.BACKGROUND, cached, 0, 0)
            await coord.settle(req)
            return self._result(job)
        if policy is PrefetchPolicy.BEST_EFFORT:
            self._track(loop.create_task(self._fetch_and_finish(job)))
            return PrefetchResult(PrefetchStatus.BACKGROUND, cached, 0, 0)
        await self._fetch_and_finish(job)
        return self._result(job)

    def _valid_before(self, anchor: Node, cached_pages: int) -> list[tuple[int, int]]:
        """Per trailing component: (pages before the prefetch that its window may need,
        how many of those the tree's path holds, consecutive up to the anchor)."""
        out = []
        path = self.core.tree.path(anchor)
        p = self.core.config.page_size
        for _, name, window in self._trailing:
            need = min(window, cached_pages)
            have = 0
            for node in reversed(path):
                if have >= need or name in lacking(node):
                    break
                have += len(node.key) // p
            out.append((need, min(have, need)))
        return out

    def _feasible(self, job: PrefetchJob) -> list[bool]:
        """Per end (pages after ``cached``): could this rank commit a prefix ending there?"""
        if not job.loaded:
            return []
        limit = len(job.loaded[0])
        if not self._trailing:  # feasible_ends without trailing components, in two list ops
            run = min(min(leading_run(flags) for flags in job.loaded), limit)
            return [True] * run + [False] * (limit - run)
        all_pools = [0] + [
            i + 1
            for i, c in enumerate(self.core.config.components)
            if not c.window_pages(self.core.config.page_size)
        ]
        all_run = min(leading_run(job.loaded[i]) for i in all_pools)
        trailing = []
        for (pool, _, window), (need, have) in zip(self._trailing, job.before, strict=True):
            valid = [False] * (need - have) + [True] * have + job.loaded[pool]
            trailing.append((window, valid, need))
        return feasible_ends(all_run, trailing, limit)

    async def _fetch_and_finish(self, job: PrefetchJob) -> None:
        try:
            await self._fetch(job)
        finally:  # cancelled too: commit what is known good, free the rest when released
            if job.loaded and not self._trailing:  # the leading run every pool has
                limit = len(job.loaded[0])
                self._finish(job, min(min(leading_run(f) for f in job.loaded), limit))
            else:
                self._finish(job, last_true(self._feasible(job)) + 1)

    def _result(self, job: PrefetchJob) -> PrefetchResult:
        p = self.core.config.page_size
        if job.failed and job.committed == 0:
            status = PrefetchStatus.FAILED
        elif job.hits == 0:
            status = PrefetchStatus.MISS
        elif job.committed >= job.hits:
            status = PrefetchStatus.COMPLETE
        else:
            status = PrefetchStatus.PARTIAL
        return PrefetchResult(status, job.cached, job.hits * p, job.committed * p, job.error)

    async def _fetch(self, job: PrefetchJob) -> None:
        """One existence check over every pool's keys, then chunked reads until the deadline;
        record per pool which pages arrived intact (no tree change).

        A backend whose read of a missing key costs no more than asking (``read_ahead``:
        Mooncake answers -704 per key) reads the whole run *beside* the check instead of after
        it (one pool, one rank, two workers or more): the check's round trip and the loop's
        turn between the two are off the critical path.  Only pages in the leading run the
        check reports count, whenever their read lands; batches past it are not started once
        the run is known.  Where every page asked for is reserved up front, the reads *are*
        the check (:mod:`.prefetch_landing`): no existence check runs unless a claim past a
        short run must be judged (:meth:`_judge_run`)."""
        pools = self.pools
        total = len(job.keys[0])
        fits = job.pages.numel()  # pages reserved: at most half the host pool in flight
        job.loaded = [[False] * fits for _ in range(pools)]
        timeout = max(job.deadline - time.monotonic(), 0.001)
        flat = job.keys[0] if pools == 1 else [k for keys in job.keys for k in keys]
        ahead = min(total, fits)
        read_ahead = (
            pools == 1
            and ahead > 0
            and self.io.workers > 1
            and not self.core.coordinator.deferred
            and getattr(self.io.backend, "read_ahead", False)
        )
        land = Landing(job, self.counters, sole=read_ahead and ahead == total)
        tasks: list[asyncio.Future[None]] = []
        if read_ahead:
            tasks += self._start_reads(job, 0, ahead, land)
        try:
            if land.sole:
                await self._wait_reads(job, tasks, land.all_in)
                await self._judge_run(job, land, timeout)
                return
            try:
                present = await self.io.exists(flat, timeout=timeout)
            except KVCacheError as exc:
                self.counters.storage_errors += 1
                job.failed, job.error = True, repr(exc)
                log.warning("prefetch_exists_failed", error=job.error)
                return
            by_pool = [present[i * total : (i + 1) * total] for i in range(pools)]
            comps = self.core.config.components
            all_pools = [0] + [
                i + 1 for i, c in enumerate(comps) if c.hit_policy is HitPolicy.ALL_PAGES
            ]
            job.hits = min(leading_run(by_pool[i]) for i in all_pools)
            if not self.core.coordinator.deferred:  # (with TP a rank's store is not published)
                job.unclaimed = self._stored.take_missing(job.hashes, by_pool[0])
            self.counters.prefetch_storage_hit_tokens += job.hits * self.core.config.page_size
            if fits < min(job.hits, job.want):  # one rank: evict for what storage has
                fits = self._reserve_more(job, min(job.hits, job.want))
            end = min(job.hits, fits)
            if not tasks and pools == 1:  # the KV pages alone: read as ranges
                land.limit = end
                tasks += self._start_reads(job, 0, end, land)
            elif not tasks:
                # what to read: the leading run for KV/ALL pools, present pages inside it
                # for the rest
                # (all of it for those: the leading run is theirs too)
                land.limit = end
                plan: list[tuple[int, int]] = []
                for pool in range(pools):
                    if pool in all_pools:
                        plan += zip(itertools.repeat(pool, end), range(end), strict=True)
                    else:
                        plan += [(pool, j) for j in range(end) if by_pool[pool][j]]
                tasks += self._start_plan(job, plan, land)
            else:
                land.run_known(end)  # skip what is past it, count what landed early
                if end > ahead:  # pages reserved after the check: read them now
                    tasks += self._start_reads(job, ahead, end, land)
            await self._wait_reads(job, tasks)
        finally:
            for r in land.reports:  # batches that landed in time but wait for a wake-up count
                r.stop_after(-1)  # (the wait is over: a worker starts none more)
                r.drain()
            land.done = True
            for hold in job.holds:  # workers still writing: their pages stay theirs
                hold.keep()
            for t in tasks:
                if not t.done():
                    t.cancel()
                elif not t.cancelled():
                    t.exception()  # retrieved: counted in _wait_reads

    async def _wait_reads(
        self,
        job: PrefetchJob,
        tasks: list[asyncio.Future[None]],
        all_in: asyncio.Future[None] | None = None,
    ) -> None:
        """Wait for the read tasks until the job's deadline, or until ``all_in`` (every batch
        that counts was reported: a worker finishing a batch past the run, or returning, is
        not waited for); a failed one fails the job."""
        while tasks and not (all_in is not None and all_in.done()):
            waiting = [t for t in tasks if not t.done()]
            left = job.deadline - time.monotonic()
            if not waiting or left <= 0:
                break
            if all_in is not None:
                waiting.append(all_in)
            await asyncio.wait(waiting, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        for t in tasks:
            failure = t.exception() if t.done() and not t.cancelled() else None
            if failure is not None:  # a timeout too: what had landed was reported
                self.counters.storage_errors += 1
                job.failed, job.error = True, repr(failure)

    async def _judge_run(self, job: PrefetchJob, land: Landing, timeout: float) -> None:
        """The reads were the check: storage had the pages up to the first that did not
        read intact (one still unread at the deadline counts as present: the result is then
        partial).  Claims of pages past the run are judged by an existence check of those
        pages alone, and only where this cache claims one of them (events on)."""
        assert land.first_bad is not None
        for r in land.reports:  # what landed and waits for a wake-up counts
            r.drain()
        land.judge_raised()
        job.hits = land.first_bad
        self.counters.prefetch_storage_hit_tokens += job.hits * self.core.config.page_size
        past = job.hashes[job.hits :]
        if not past or not self._stored.claims_any(past):
            return
        try:
            rest = await self.io.exists(job.keys[0][job.hits :], timeout=timeout)
        except KVCacheError as exc:  # judged by a later prefetch: nothing retracted now
            log.warning("prefetch_exists_failed", error=repr(exc))
            return
        job.unclaimed = self._stored.take_missing(past, rest)

    def _reserve_more(self, job: PrefetchJob, upto: int) -> int:
        """Grow ``job``'s reservation toward ``upto`` pages, evicting host-only leaves (one
        rank, once storage said it has them); returns the pages now reserved."""
        core = self.core
        have = job.pages.numel()
        alloc, pool = core.host_alloc, core.host_pool
        assert alloc is not None and pool is not None
        cap = pool.num_pages // 2 - (self.reserved_pages - have)  # half the pool in flight
        k = min(min(upto, cap) - have, alloc.num_free + core.tree.host_evictable)
        if job.dropped:  # (a drop ran meanwhile: nothing of it is committed)
            return have
        more = None
        if k > 0:
            # evict once for what is short, as far as host eviction can (host copies of device
            # pages count as evictable, but it never takes them), then take what is free
            if k > alloc.num_free:
                core.evict_host(k - alloc.num_free)
            if alloc.num_free:
                more = core.alloc_host(min(k, alloc.num_free), evict=False)
        if more is not None:
            job.pages = torch.cat([job.pages, more])
            self.reserved[job.rid] = job.pages
            for flags in job.loaded:
                flags.extend([False] * more.numel())
        elif not have:
            job.error = "host pool full"
        return job.pages.numel()

    def _start_reads(
        self, job: PrefetchJob, first: int, end: int, land: Landing
    ) -> list[asyncio.Future[None]]:
        """Start reading KV pages ``first..end-1`` (:func:`.prefetch_reads.start_range`)."""
        return prefetch_reads.start_range(self._readers(), job, first, end, land)

    def _start_plan(
        self, job: PrefetchJob, plan: list[tuple[int, int]], land: Landing
    ) -> list[asyncio.Future[None]]:
        """Start reading ``plan``'s ``(pool, page)`` (:func:`.prefetch_reads.start_plan`)."""
        return prefetch_reads.start_plan(self._readers(), job, plan, land)

    def _readers(self) -> prefetch_reads.Readers:
        alloc = self.core.host_alloc
        assert alloc is not None
        return prefetch_reads.Readers(
            self.io, self._buffers, alloc, self.core.config.prefetch_batch_pages
        )

    def _finish(self, job: PrefetchJob, end: int) -> None:
        """Commit the first ``end`` pages (agreed across ranks), unpin, free the rest."""
        try:
            job.committed = self._commit(job, end)
            core = self.core
            core.latencies.prefetch.observe(time.monotonic() - job.started)
            # per-rank facts about a rank's own store: not published where ranks must agree
            if (job.vanished or job.unclaimed) and not core.coordinator.deferred:
                # published whether or not the stream claims them: a consumer that kept its
                # index across a restart learns the store lost them (documented)
                vanished = [job.hashes[j] for j in sorted(job.vanished)]
                for h in vanished:  # no claim of it is left to announce again
                    self.lose_stored(h)
                core.emit(BlockRemoved(job.unclaimed + vanished, Tier.STORAGE.medium))
        finally:
            self.core.tree.unpin(job.anchor)
            del self._jobs[job.rid]
            self._free_reserved(job.rid)  # pages a late read still holds stay quarantined

    def fence(self, ns: Namespace, page_hash: bytes | None) -> tuple[Namespace, bytes | None]:
        """A drop of ``ns`` (``page_hash`` None) or of the page ``page_hash`` and what follows
        it starts: prefetches in flight that would commit it, and those started until
        :meth:`unfence`, commit nothing (what they read may predate the removal)."""
        fence = (ns, page_hash)
        self._fences.append(fence)
        for job in self._jobs.values():
            job.dropped = job.dropped or self._fence_hits(job, fence)
        return fence

    def unfence(self, *fences: tuple[Namespace, bytes | None]) -> None:
        """The drop that set ``fences`` is done (and every removal it started)."""
        for fence in fences:
            self._fences.remove(fence)

    @staticmethod
    def _fence_hits(job: PrefetchJob, fence: tuple[Namespace, bytes | None]) -> bool:
        ns, page_hash = fence
        return job.ns == ns and (page_hash is None or page_hash in job.hashes)

    def _commit(self, job: PrefetchJob, end: int) -> int:
        """Attach the first ``end`` loaded pages below the cached prefix; return pages used.

        A trailing component's pages that did not arrive make the nodes that lack them
        ``invalid`` for it (split where that changes), so no prefix ends inside its window.
        """
        if end == 0:
            return 0
        if job.dropped or not (job.anchor.alive or job.anchor.parent is None):
            self.counters.prefetch_dropped += 1  # a drop ran meanwhile: nothing comes back
            return 0
        core = self.core
        tree = core.tree
        p = core.config.page_size
        new = tree.attach_host_only(
            job.ns, job.tokens, job.cached + end * p, job.cached, job.pages[:end]
        )
        used = sum(len(n.key) for n in new) // p
        if new:  # the tail of pages[:end] now belongs to the tree
            first = end - used
            self.reserved[job.rid] = torch.cat([job.pages[:first], job.pages[end:]])
            (node,) = new
            node.hashes = job.hashes[first:end]
            if self.deferred_verify:  # read with their trailers checked only (deferred.py)
                assert core.host_pool is not None
                core.host_pool.unverified[job.pages[first:end].numpy()] = True
            pieces = self._segments(node, first, end, job)
            for piece, lo, hi in pieces:
                piece.invalid = frozenset(
                    name for pool, name, _ in self._trailing if not all(job.loaded[pool][lo:hi])
                )
                self.remember_announced(piece)  # it came from storage (announced there)
                core.emit_stored(piece, Tier.HOST)
        self.counters.prefetch_hit_tokens += used * p
        return used

    def _segments(
        self, node: Node, first: int, end: int, job: PrefetchJob
    ) -> list[tuple[Node, int, int]]:
        """Split ``node`` (pages ``first..end`` of the prefetch) where any trailing
        component's loaded flags change; return ``(piece, lo, hi)`` root-most first."""
        cuts = sorted(
            {
                j
                for pool, _, _ in self._trailing
                for j in range(first + 1, end)
                if job.loaded[pool][j] != job.loaded[pool][j - 1]
            }
        )
        tree = self.core.tree
        p = self.core.config.page_size
        pieces: list[tuple[Node, int, int]] = []
        lo = first
        tail = node
        for cut in cuts:
            head = tree.split_at(tail, (cut - lo) * p)
            pieces.append((head, lo, cut))
            lo = cut
        pieces.append((tail, lo, end))
        return pieces

    def _free_reserved(self, rid: int) -> None:
        pages = self.reserved.pop(rid)
        if pages.numel():
            self.counters.prefetch_pages_discarded += pages.numel()
            alloc = self.core.host_alloc
            assert alloc is not None
            alloc.free([pages])
