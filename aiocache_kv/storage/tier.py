"""The storage tier as the cache sees it: L2 -> L3 backup and L3 -> L2 prefetch.

Design
------
``StorageTier`` is the cache's collaborator for L3.  It runs on the loop thread and changes the
tree only through the cache's tree and allocators, in plain synchronous steps between awaits;
blocking backend calls run on :class:`~aiocache_kv.storage.executor.StorageIO` workers.

Backup.  When a write ack makes nodes host-resident, :meth:`backup` marks them storage-FILLING
(their host copy is then protected from eviction), and a task puts their pages.  The op's
target list is re-targeted by node splits exactly like device<->host copies, and its per-page
results are consumed in target order, so every fragment gets its own verdict, its own STORAGE
``BlockStored`` event, and a failed page is never reported as stored.  After a failed batch the
tier backs off for ``storage_retry_seconds``; nodes whose backup failed stay storage-ABSENT and
are retried on a later hit.

Prefetch.  ``prefetch`` pins the cached prefix, asks storage for the leading run of present page
keys (one batched call), reserves host pages for them (at most half the host pool across every
prefetch in flight), reads them in chunks, and commits only the leading run of pages that
arrived and verified.  Host pages are freed only once no worker holds them any more
(``wait_released``): a timed-out or cancelled prefetch hands its pages to a cleanup task.
Storage faults never escape: the result reports what was committed, possibly nothing.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog
import torch

from aiocache_kv.config import PrefetchPolicy
from aiocache_kv.distributed.acks import AckQueue
from aiocache_kv.errors import KVCacheError
from aiocache_kv.storage.base import PageBuffer, StorageBackend, leading_run
from aiocache_kv.storage.executor import StorageIO
from aiocache_kv.storage.integrity import FRAME_OVERHEAD
from aiocache_kv.storage.keys import storage_key
from aiocache_kv.tree.hashing import chain_hashes
from aiocache_kv.tree.node import ABSENT, RESIDENT, Node, Tier

if TYPE_CHECKING:
    from aiocache_kv.cache import HiCache
    from aiocache_kv.namespace import Namespace

log = structlog.get_logger(__name__)

COMPONENT = "kv"


class PrefetchStatus(enum.Enum):
    """How a prefetch ended."""

    NO_STORAGE = "no_storage"  #: the cache has no storage tier
    BELOW_THRESHOLD = "below_threshold"  #: too few uncached tokens to be worth it
    MISS = "miss"  #: storage has none of the next pages
    COMPLETE = "complete"  #: every page storage reported was loaded and committed
    PARTIAL = "partial"  #: deadline or a bad page cut it short; the leading run was committed
    BACKGROUND = "background"  #: best effort: loading continues, commits when it lands
    FAILED = "failed"  #: storage unreachable or failing; nothing committed


@dataclass(frozen=True, slots=True)
class PrefetchResult:
    """What a prefetch found and committed."""

    status: PrefetchStatus
    cached_tokens: int  #: tokens already in L1/L2 before the prefetch
    storage_hit_tokens: int  #: tokens after those that storage reported present
    hit_tokens: int  #: tokens loaded from storage and committed to the host tier
    error: str | None = None

    @property
    def usable_tokens(self) -> int:
        """Tokens now matchable from device or host (cached + committed)."""
        return self.cached_tokens + self.hit_tokens


class BackupOp:
    """A batch of nodes whose pages are being put to storage, in page order."""

    __slots__ = ("error", "future", "results", "targets")

    def __init__(self, targets: list[Node], future: asyncio.Future[None]) -> None:
        self.targets = targets
        self.future = future  # set when the verdicts are applied to the tree
        self.results: list[bool] = []
        self.error: str | None = None


@dataclass(eq=False)
class _Prefetch:
    """One prefetch: its reservation, what storage had, what arrived, what was committed."""

    rid: int
    ns: Namespace
    tokens: list[int]
    cached: int  #: tokens already in the tree (the anchor's path)
    anchor: Node
    pages: torch.Tensor  #: reserved host pages, one per key
    keys: list[str]
    hashes: list[int]
    deadline: float
    hits: int = 0  #: leading pages storage reported present
    run: int = 0  #: leading pages that arrived intact (local)
    committed: int = 0  #: pages attached to the tree
    error: str | None = None
    failed: bool = False


def prefetch_timeout(tokens: int, base: float, per_1k: float, cap: float) -> float:
    """Deadline of a ``timeout``-policy prefetch: base + per-1k-tokens, capped."""
    return min(cap, base + per_1k * tokens / 1000.0)


class StorageTier:
    """L3 for one cache.  Created and driven by :class:`~aiocache_kv.cache.HiCache`."""

    def __init__(self, cache: HiCache, backend: StorageBackend) -> None:
        cfg = cache.config
        self._cache = cache
        self.io = StorageIO(
            backend, workers=cfg.storage_workers, default_timeout=cfg.storage_timeout
        )
        self._buffers: list[PageBuffer] = []
        group = cache.tp_group
        #: each tensor-parallel rank stores its own shard of a page under its own key
        self._component = (
            COMPONENT if group.world_size == 1 else f"{COMPONENT}-tp{group.rank}-{group.world_size}"
        )
        self._backups: dict[int, BackupOp] = {}
        self.acks: AckQueue[BackupOp] = AckQueue("backup", self._apply_backup)
        self._tasks: set[asyncio.Task[Any]] = set()
        self.reserved: dict[int, torch.Tensor] = {}  # prefetch id -> host pages not yet in tree
        self._ids = 0
        self._retry_after = 0.0
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "backup_started",
                "backup_pages_ok",
                "backup_pages_failed",
                "backup_skipped_pages",
                "prefetch_queries",
                "prefetch_storage_hit_tokens",
                "prefetch_hit_tokens",
                "prefetch_pages_discarded",
                "storage_errors",
            ),
            0,
        )

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Open the backend, register the host pool once, build per-page buffer views.

        Raises:
            StorageUnavailableError / StorageTimeoutError: the backend cannot be opened.
        """
        pool = self._cache.host_pool
        assert pool is not None, "a storage tier needs a host pool"
        await self.io.open()
        await self.io.register_buffer(pool.raw)
        nbytes = pool.page_bytes + FRAME_OVERHEAD
        raw = pool.raw

        def views() -> list[PageBuffer]:
            return [PageBuffer.from_tensor(raw[i, :nbytes]) for i in range(raw.shape[0])]

        self._buffers = await asyncio.to_thread(views)

    async def settle(self) -> None:
        """Wait for every backup and background prefetch (each bounded by its deadline)."""
        while self._backups or self._tasks:
            waits: list[asyncio.Future[None]] = [op.future for op in self._backups.values()]
            waits += list(self._tasks)
            await asyncio.wait(waits)

    async def aclose(self) -> None:
        """Settle, then close the executor and the backend."""
        try:
            await self.settle()
        finally:
            await self.io.aclose(timeout=self._cache.config.storage_timeout)

    @property
    def in_flight(self) -> int:
        """Backups and background prefetches not yet settled."""
        return len(self._backups) + len(self._tasks)

    @property
    def reserved_pages(self) -> int:
        """Host pages held by prefetches in flight (not yet in the tree)."""
        return sum(p.numel() for p in self.reserved.values())

    # ------------------------------------------------------------------ keys

    def _keys(self, ns: Namespace, hashes: list[int]) -> list[str]:
        tag = ns.tag
        component = self._component
        return [storage_key(tag, h, component) for h in hashes]

    def _bufs(self, pages: torch.Tensor) -> list[PageBuffer]:
        b = self._buffers
        return [b[i] for i in pages.tolist()]

    # ------------------------------------------------------------------ backup

    def backup(self, nodes: list[Node]) -> BackupOp | None:
        """Start putting the host copies of ``nodes`` (path order) to storage."""
        cache = self._cache
        tree = cache._tree
        todo = [
            n
            for n in nodes
            if n.alive and n.host is RESIDENT and n.storage is ABSENT and n.backup is None
        ]
        if not todo:
            return None
        pages = sum(len(n.key) for n in todo) // cache.config.page_size
        # back off after a failure (single rank only: a clock must not shape a TP tree)
        if not cache._deferred and time.monotonic() < self._retry_after:
            self.counters["backup_skipped_pages"] += pages
            return None
        loop = cache._loop
        assert loop is not None
        op = BackupOp(todo, loop.create_future())
        keys: list[str] = []
        host: list[torch.Tensor] = []
        for node in todo:
            keys += self._keys(node.ns, tree.block_hashes(node))
            assert node.host_pages is not None
            host.append(node.host_pages)
            tree.begin_backup(node, op)
        bufs = self._bufs(torch.cat(host))
        self._backups[id(op)] = op
        if cache._deferred:
            self.acks.push(op, loop)
        self.counters["backup_started"] += 1
        loop.create_task(self._run_backup(op, keys, bufs))
        return op

    @property
    def backups_pending(self) -> int:
        """Backups started and not yet applied."""
        return len(self._backups)

    async def _run_backup(self, op: BackupOp, keys: list[str], bufs: list[PageBuffer]) -> None:
        try:
            op.results = await self.io.put(keys, bufs)
        except KVCacheError as exc:
            op.results = [False] * len(keys)
            op.error = repr(exc)
        except BaseException:
            op.results = [False] * len(keys)
            op.error = "cancelled"
            self._land_backup(op)
            raise
        self._land_backup(op)

    def _land_backup(self, op: BackupOp) -> None:
        if self._cache._deferred:
            self.acks.land(op, all(op.results))
        else:
            self._apply_backup(op, True)

    def _apply_backup(self, op: BackupOp, ok: bool) -> None:
        """Apply per-page verdicts to every target, in order (on the loop).

        ``ok=False`` (agreed across ranks) fails every page whatever this rank saw.
        """
        del self._backups[id(op)]
        cache = self._cache
        tree = cache._tree
        results = op.results if ok else [False] * len(op.results)
        p = cache.config.page_size
        i = 0
        ok_pages = 0
        for node in op.targets:
            k = len(node.key) // p
            node_ok = all(results[i : i + k])
            i += k
            tree.end_backup(node, node_ok)
            if node_ok:
                ok_pages += k
                if cache._events.enabled:
                    cache._emit_stored(node, Tier.STORAGE)
        assert i == len(results), f"backup results {len(results)} != target pages {i}"
        failed = len(results) - ok_pages
        self.counters["backup_pages_ok"] += ok_pages
        self.counters["backup_pages_failed"] += failed
        if failed:
            self.counters["storage_errors"] += 1
            self._retry_after = time.monotonic() + cache.config.storage_retry_seconds
            log.warning("backup_incomplete", pages=len(results), failed=failed, error=op.error)
        if not op.future.done():
            op.future.set_result(None)

    def retarget(self, head: Node, tail: Node) -> None:
        """A node under backup was split: the backup now covers both parts, head first."""
        op: BackupOp = tail.backup
        op.targets.insert(op.targets.index(tail), head)

    # ------------------------------------------------------------------ prefetch

    async def prefetch(
        self, ns: Namespace, tokens: list[int], n: int, policy: PrefetchPolicy
    ) -> PrefetchResult:
        """Bring the storage-resident continuation of ``tokens[:n]`` into the host tier.

        Everything that shapes the tree happens synchronously here (pin, host reservation)
        or when the agreed run is committed, never at a moment chosen by I/O timing.
        """
        cache = self._cache
        cfg = cache.config
        tree = cache._tree
        p = cfg.page_size
        anchor, cached = tree.match(ns, tokens, n, pin=True)
        self.counters["prefetch_queries"] += 1
        if n - cached < max(cfg.prefetch_threshold_tokens, p):
            tree.unpin(anchor)
            return PrefetchResult(PrefetchStatus.BELOW_THRESHOLD, cached, 0, 0)
        assert cache.host_pool is not None
        want = min((n - cached) // p, cache.host_pool.num_pages // 2 - self.reserved_pages)
        pages = cache._alloc_host(want) if want > 0 else None
        if pages is None:
            tree.unpin(anchor)
            return PrefetchResult(PrefetchStatus.PARTIAL, cached, 0, 0, "host pool full")
        prev = tree._seeds[ns] if anchor.parent is None else tree.block_hashes(anchor)[-1]
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
        job = _Prefetch(
            rid=self._ids,
            ns=ns,
            tokens=tokens,
            cached=cached,
            anchor=anchor,
            pages=pages,
            keys=self._keys(ns, hashes),
            hashes=hashes,
            deadline=time.monotonic() + timeout,
        )
        self.reserved[job.rid] = pages
        loop = asyncio.get_running_loop()
        if cache._deferred:
            # the reads run in their own task: the other ranks need this rank's answer even
            # if the caller goes away; the agreed run is committed in ticket order
            work = loop.create_task(self._fetch(job))
            self._track(work)

            async def ready() -> None:
                await asyncio.wait([work])
                await self.io.wait_released(self._bufs(job.pages))

            def apply(agreed: list[int]) -> None:
                job.hits, job.failed = agreed[1], agreed[2] == 0  # report what all ranks had
                self._finish(job, agreed[0])

            req = cache.agreement(
                ready, width=3, pack=lambda: [job.run, job.hits, int(not job.failed)], apply=apply
            )
            if policy is PrefetchPolicy.BEST_EFFORT:
                return PrefetchResult(PrefetchStatus.BACKGROUND, cached, 0, 0)
            assert cache._seq is not None
            await cache._seq.settle(req)
            return self._result(job)
        if policy is PrefetchPolicy.BEST_EFFORT:
            self._track(loop.create_task(self._fetch_and_finish(job)))
            return PrefetchResult(PrefetchStatus.BACKGROUND, cached, 0, 0)
        await self._fetch_and_finish(job)
        return self._result(job)

    def _track(self, task: asyncio.Task[Any]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _fetch_and_finish(self, job: _Prefetch) -> None:
        try:
            await self._fetch(job)
        finally:  # cancelled too: commit what is known good, free the rest when released
            self._finish(job, job.run)

    def _result(self, job: _Prefetch) -> PrefetchResult:
        p = self._cache.config.page_size
        if job.failed and job.committed == 0:
            status = PrefetchStatus.FAILED
        elif job.hits == 0:
            status = PrefetchStatus.MISS
        elif job.committed >= job.hits:
            status = PrefetchStatus.COMPLETE
        else:
            status = PrefetchStatus.PARTIAL
        return PrefetchResult(status, job.cached, job.hits * p, job.committed * p, job.error)

    async def _fetch(self, job: _Prefetch) -> None:
        """Ask storage for the leading present keys, read them in chunks until the deadline;
        record the leading run that arrived intact in ``job.run`` (no tree change)."""
        timeout = max(job.deadline - time.monotonic(), 0.001)
        try:
            job.hits = await self.io.leading_hits(job.keys, timeout=timeout)
        except KVCacheError as exc:
            self.counters["storage_errors"] += 1
            job.failed, job.error = True, repr(exc)
            log.warning("prefetch_exists_failed", error=job.error)
            return
        self.counters["prefetch_storage_hit_tokens"] += job.hits * self._cache.config.page_size
        chunk = self._cache.config.prefetch_batch_pages
        bufs = self._bufs(job.pages)
        load = min(job.hits, len(bufs))
        tasks: list[asyncio.Task[list[bool]]] = []
        try:
            for a in range(0, load, chunk):
                b = min(a + chunk, load)
                remaining = max(job.deadline - time.monotonic(), 0.001)
                coro = self.io.get_into(job.keys[a:b], bufs[a:b], timeout=remaining)
                tasks.append(asyncio.ensure_future(coro))
            if tasks:
                await asyncio.wait(tasks, timeout=max(job.deadline - time.monotonic(), 0.0))
            for t in tasks:
                if not t.done() or t.cancelled():
                    break
                failure = t.exception()
                if failure is not None:
                    self.counters["storage_errors"] += 1
                    job.failed, job.error = True, repr(failure)
                    break
                flags = t.result()
                good = leading_run(flags)
                job.run += good
                if good < len(flags):
                    break
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()
                elif not t.cancelled():
                    t.exception()  # retrieved: counted above

    def _finish(self, job: _Prefetch, run: int) -> None:
        """Commit the first ``run`` pages (agreed across ranks), unpin, free the rest."""
        try:
            job.committed = self._commit(job, min(run, job.run))
        finally:
            self._cache._tree.unpin(job.anchor)
            self._release_later(job.rid, self._bufs(job.pages))

    def _commit(self, job: _Prefetch, run: int) -> int:
        """Attach the first ``run`` loaded pages below the cached prefix; return pages used."""
        if run == 0:
            return 0
        cache = self._cache
        tree = cache._tree
        p = cache.config.page_size
        end = job.cached + run * p
        new = tree.attach_host_only(job.ns, job.tokens, end, job.cached, job.pages[:run])
        used = sum(len(n.key) for n in new) // p
        if new:  # the tail of pages[:run] now belongs to the tree
            first = run - used
            self.reserved[job.rid] = torch.cat([job.pages[:first], job.pages[run:]])
            (node,) = new
            node.hashes = job.hashes[first:run]
            if cache._events.enabled:
                cache._emit_stored(node, Tier.HOST)
        self.counters["prefetch_hit_tokens"] += used * p
        return used

    def _release_later(self, rid: int, bufs: list[PageBuffer]) -> None:
        """Free the prefetch's leftover host pages once no worker holds their buffers."""
        if self.reserved[rid].numel() == 0 or not self.io.holds(bufs):
            self._free_reserved(rid)
            return

        async def later() -> None:
            try:
                await self.io.wait_released(bufs)
            finally:
                self._free_reserved(rid)

        self._track(asyncio.get_running_loop().create_task(later()))

    def _free_reserved(self, rid: int) -> None:
        pages = self.reserved.pop(rid)
        if pages.numel():
            self.counters["prefetch_pages_discarded"] += pages.numel()
            alloc = self._cache._host_alloc
            assert alloc is not None
            alloc.free([pages])
