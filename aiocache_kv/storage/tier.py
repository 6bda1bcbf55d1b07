"""The storage tier as the cache sees it: L2 -> L3 backup and L3 -> L2 prefetch.

Design
------
``StorageTier`` is the cache's collaborator for L3.  It runs on the loop thread and changes the
tree only through the :class:`~aiocache_kv.core.CacheCore` (tree, allocators, events), in plain
synchronous steps between awaits; completions reach the tree through the core's coordinator;
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
arrived and verified.  Storage faults never escape: the result reports what was committed,
possibly nothing.

Buffer leases.  Every storage call leases the host pages whose bytes it reads or writes
(:meth:`PageAllocator.lease`) and the lease ends only when the worker reports it is done
(``StorageIO``'s ``on_release``), never when the caller gives up.  A backup that misses its
deadline is failed at once (the node stays storage-ABSENT, its host copy evictable) but its
pages stay quarantined until the late put finishes, so the put stores the very bytes that
were there when it was issued, under the keys they belong to.  A timed-out or cancelled
prefetch frees its leftover pages at once: the ones a worker still writes into wait in
quarantine.  No wait here is unbounded: ``flush`` and ``aclose`` wait for deadlines, never
for workers.  (With TP, verdicts wait for the workers, so that every rank frees the same
pages at the same agreed point.)
"""

from __future__ import annotations

import asyncio
import enum
import functools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog
import torch

from aiocache_kv.components import HitPolicy, feasible_ends
from aiocache_kv.config import PrefetchPolicy
from aiocache_kv.distributed.acks import AckQueue
from aiocache_kv.distributed.coordinator import AgreedCoordinator
from aiocache_kv.errors import KVCacheError
from aiocache_kv.events import BlockRemoved
from aiocache_kv.stats import StorageCounters
from aiocache_kv.storage.base import PageBuffer, StorageBackend, leading_run
from aiocache_kv.storage.executor import StorageIO
from aiocache_kv.storage.integrity import FRAME_OVERHEAD
from aiocache_kv.storage.keys import storage_key
from aiocache_kv.tree.hashing import chain_hashes
from aiocache_kv.tree.node import ABSENT, RESIDENT, Node, Tier

if TYPE_CHECKING:
    from aiocache_kv.core import CacheCore
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

    __slots__ = ("entry_pages", "error", "future", "results", "targets")

    def __init__(self, targets: list[Node], future: asyncio.Future[None]) -> None:
        self.targets = targets
        self.future = future  # set when the verdicts are applied to the tree
        #: per stored key (KV and sidecars), the index of its page in the op's page order
        self.entry_pages: list[int] = []
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
    pages: torch.Tensor  #: reserved host pages (their slots in every pool)
    keys: list[list[str]]  #: per pool, one key per page after ``cached``
    hashes: list[int]
    deadline: float
    #: per trailing component: pages before ``cached`` that count for its window, and how
    #: many of those the tree holds (consecutive, ending at ``cached``)
    before: list[tuple[int, int]] = field(default_factory=list)
    hits: int = 0  #: leading pages present for the KV and every ALL_PAGES component
    loaded: list[list[bool]] = field(default_factory=list)  #: per pool, page arrived intact
    committed: int = 0  #: pages attached to the tree
    error: str | None = None
    failed: bool = False
    #: pages storage listed but could not deliver intact (gone or corrupt: the backend drops
    #: a corrupt page), reported as STORAGE ``BlockRemoved``
    vanished: list[int] = field(default_factory=list)


def prefetch_timeout(tokens: int, base: float, per_1k: float, cap: float) -> float:
    """Deadline of a ``timeout``-policy prefetch: base + per-1k-tokens, capped."""
    return min(cap, base + per_1k * tokens / 1000.0)


class StorageTier:
    """L3 for one cache.  Created and driven by :class:`~aiocache_kv.cache.HiCache`."""

    def __init__(self, core: CacheCore, backend: StorageBackend) -> None:
        cfg = core.config
        self.core = core
        self.io = StorageIO(
            backend, workers=cfg.storage_workers, default_timeout=cfg.storage_timeout
        )
        #: per pool (KV first, then each sidecar component): one buffer view per host page
        self._buffers: list[list[PageBuffer]] = []
        group = core.tp_group
        #: each tensor-parallel rank stores its own shard of a page under its own keys
        shard = "" if group.world_size == 1 else f"-tp{group.rank}-{group.world_size}"
        names = [COMPONENT, *(c.name for c in cfg.components)]
        self._suffixes = [name + shard for name in names]
        self._component = self._suffixes[0]
        page_size = cfg.page_size
        #: trailing-window components: (pool index, name, window pages)
        self._trailing = [
            (i + 1, c.name, c.window_pages(page_size))
            for i, c in enumerate(cfg.components)
            if c.window_pages(page_size)
        ]
        self._backups: dict[int, BackupOp] = {}
        self.acks: AckQueue[BackupOp] = AckQueue("backup", self._apply_backup)
        core.coordinator.register(self.acks)
        core.on_split(self.retarget)
        self._tasks: set[asyncio.Task[Any]] = set()
        self.reserved: dict[int, torch.Tensor] = {}  # prefetch id -> host pages not yet in tree
        self._jobs: dict[int, _Prefetch] = {}  # prefetches whose anchor is pinned
        self._ids = 0
        self._retry_after = 0.0
        self.counters = StorageCounters()

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Open the backend, register the host pool once, build per-page buffer views.

        Raises:
            StorageUnavailableError / StorageTimeoutError: the backend cannot be opened.
        """
        pool = self.core.host_pool
        assert pool is not None, "a storage tier needs a host pool"
        await self.io.open()
        raws = [(pool.raw, pool.page_bytes)]
        raws += [(sc.host_raw, sc.page_bytes) for sc in self.core.sidecars]
        for raw, _ in raws:
            await self.io.register_buffer(raw)

        def views() -> list[list[PageBuffer]]:
            return [
                [PageBuffer.from_tensor(raw[i, : nbytes + FRAME_OVERHEAD]) for i in range(len(raw))]
                for raw, nbytes in raws
            ]

        self._buffers = await asyncio.to_thread(views)

    async def settle(self, *, drain: bool = True) -> None:
        """Wait for every backup and background prefetch (each bounded by its deadline), then
        up to ``storage_timeout`` for late workers to hand their pages back.  Workers still
        stuck after that keep their pages quarantined (``statistics().host.quarantined_pages``)
        and release them when they return."""
        while self._backups or self._tasks:
            waits: list[asyncio.Future[None]] = [op.future for op in self._backups.values()]
            waits += list(self._tasks)
            await asyncio.wait(waits)
        if drain and self.io.io_statistics().in_flight:
            try:
                await asyncio.wait_for(self.io.drain(), self.core.config.storage_timeout)
            except asyncio.TimeoutError:
                log.warning(
                    "storage_workers_stuck",
                    calls=self.io.io_statistics().in_flight,
                    quarantined_pages=self._quarantined(),
                )

    def _quarantined(self) -> int:
        alloc = self.core.host_alloc
        return alloc.quarantined if alloc is not None else 0

    async def aclose(self) -> None:
        """Settle, then close the executor and the backend: within about three
        ``storage_timeout`` however stuck the store is (deadlines, the workers' drain, the
        backend's close), abandoning stuck workers (their pages stay quarantined)."""
        try:
            await self.settle(drain=False)  # the executor's close drains, bounded
        finally:
            await self.io.aclose(timeout=self.core.config.storage_timeout)

    @property
    def in_flight(self) -> int:
        """Backups and background prefetches not yet settled."""
        return len(self._backups) + len(self._tasks)

    def anchors(self) -> list[Node]:
        """Nodes pinned by prefetches in flight (one pin each, like a handle)."""
        return [job.anchor for job in self._jobs.values()]

    @property
    def reserved_pages(self) -> int:
        """Host pages held by prefetches in flight (not yet in the tree)."""
        return sum(p.numel() for p in self.reserved.values())

    # ------------------------------------------------------------------ keys

    def _keys(self, ns: Namespace, hashes: list[int], pool: int = 0) -> list[str]:
        tag = ns.tag
        suffix = self._suffixes[pool]
        return [storage_key(tag, h, suffix) for h in hashes]

    def _bufs(self, pages: torch.Tensor, pool: int = 0) -> list[PageBuffer]:
        b = self._buffers[pool]
        return [b[i] for i in pages.tolist()]

    @property
    def pools(self) -> int:
        """KV plus sidecar components."""
        return len(self._suffixes)

    # ------------------------------------------------------------------ backup

    def backup(self, nodes: list[Node]) -> BackupOp | None:
        """Start putting the host copies of ``nodes`` (path order) to storage."""
        core = self.core
        tree = core.tree
        todo = [
            n
            for n in nodes
            if n.alive and n.host is RESIDENT and n.storage is ABSENT and n.backup is None
        ]
        if not todo:
            return None
        pages = sum(len(n.key) for n in todo) // core.config.page_size
        # back off after a failure (single rank only: a clock must not shape a TP tree)
        if not core.coordinator.deferred and time.monotonic() < self._retry_after:
            self.counters.backup_skipped_pages += pages
            return None
        loop = core.loop
        assert loop is not None
        op = BackupOp(todo, loop.create_future())
        keys: list[str] = []
        bufs: list[PageBuffer] = []
        base = 0
        for node in todo:
            hashes = tree.block_hashes(node)
            assert node.host_pages is not None
            k = len(hashes)
            for pool in range(self.pools):
                if pool and core.config.components[pool - 1].name in node.invalid:
                    continue  # never store a page this node does not have
                keys += self._keys(node.ns, hashes, pool)
                bufs += self._bufs(node.host_pages, pool)
                op.entry_pages += range(base, base + k)
            base += k
            tree.begin_backup(node, op)
        self._backups[id(op)] = op
        core.coordinator.track(self.acks, op)
        self.counters.backup_started += 1
        leased = torch.cat([n.host_pages for n in todo])  # type: ignore[misc]
        alloc = core.host_alloc
        assert alloc is not None
        alloc.lease(leased)  # until the worker is done with the bytes, whatever the verdict
        release = functools.partial(alloc.unlease, leased)
        loop.create_task(self._run_backup(op, keys, bufs, release))
        return op

    @property
    def backups_pending(self) -> int:
        """Backups started and not yet applied."""
        return len(self._backups)

    async def _run_backup(
        self,
        op: BackupOp,
        keys: list[str],
        bufs: list[PageBuffer],
        release: functools.partial[None],
    ) -> None:
        try:
            op.results = await self.io.put(keys, bufs, on_release=release)
        except KVCacheError as exc:
            op.results = [False] * len(keys)
            op.error = repr(exc)
            if self.core.coordinator.deferred:  # every rank frees the pages at the agreed point
                await self.io.wait_released(bufs)
        except BaseException:
            op.results = [False] * len(keys)
            op.error = "cancelled"
            self._land_backup(op)
            raise
        self._land_backup(op)

    def _land_backup(self, op: BackupOp) -> None:
        # one rank applies per-page verdicts (ok=True: the results decide); TP agrees on
        # all-or-nothing
        ok = all(op.results) if self.core.coordinator.deferred else True
        self.core.coordinator.land(self.acks, op, ok)

    def _apply_backup(self, op: BackupOp, ok: bool) -> None:
        """Apply per-page verdicts to every target, in order (on the loop).

        ``ok=False`` (agreed across ranks) fails every page whatever this rank saw.
        """
        del self._backups[id(op)]
        core = self.core
        tree = core.tree
        p = core.config.page_size
        pages = sum(len(node.key) for node in op.targets) // p
        page_ok = [ok] * pages  # a page is stored when every pool's key for it is
        for j, good in zip(op.entry_pages, op.results, strict=True):
            if not good:
                page_ok[j] = False
        i = 0
        ok_pages = 0
        for node in op.targets:  # split heads were inserted in path order: pages line up
            k = len(node.key) // p
            node_ok = all(page_ok[i : i + k])
            i += k
            tree.end_backup(node, node_ok)
            if node_ok:
                ok_pages += k
                core.emit_stored(node, Tier.STORAGE)
        assert i == pages, f"backup covers {pages} pages but targets {i}"
        failed = pages - ok_pages
        self.counters.backup_pages_ok += ok_pages
        self.counters.backup_pages_failed += failed
        if failed:
            self.counters.storage_errors += 1
            self._retry_after = time.monotonic() + core.config.storage_retry_seconds
            log.warning("backup_incomplete", pages=pages, failed=failed, error=op.error)
        if not op.future.done():
            op.future.set_result(None)

    def retarget(self, head: Node, tail: Node) -> None:
        """A node under backup was split: the backup now covers both parts, head first."""
        if tail.backup is not None:
            op: BackupOp = tail.backup
            op.targets.insert(op.targets.index(tail), head)

    # ------------------------------------------------------------------ prefetch

    async def prefetch(
        self, ns: Namespace, tokens: list[int], n: int, policy: PrefetchPolicy
    ) -> PrefetchResult:
        """Bring the storage-resident continuation of ``tokens[:n]`` into the host tier.

        Everything that shapes the tree happens synchronously here (pin, host reservation)
        or when the agreed end is committed, never at a moment chosen by I/O timing.
        """
        core = self.core
        cfg = core.config
        tree = core.tree
        p = cfg.page_size
        anchor, cached = tree.match(ns, tokens, n, pin=True)
        self.counters.prefetch_queries += 1
        if n - cached < max(cfg.prefetch_threshold_tokens, p):
            tree.unpin(anchor)
            return PrefetchResult(PrefetchStatus.BELOW_THRESHOLD, cached, 0, 0)
        assert core.host_pool is not None
        want = min((n - cached) // p, core.host_pool.num_pages // 2 - self.reserved_pages)
        pages = core.alloc_host(want) if want > 0 else None
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
        job = _Prefetch(
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
        )
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
                if have >= need or name in node.invalid:
                    break
                have += len(node.key) // p
            out.append((need, min(have, need)))
        return out

    def _feasible(self, job: _Prefetch) -> list[bool]:
        """Per end (pages after ``cached``): could this rank commit a prefix ending there?"""
        if not job.loaded:
            return []
        limit = len(job.loaded[0])
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

    def _track(self, task: asyncio.Task[Any]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _fetch_and_finish(self, job: _Prefetch) -> None:
        try:
            await self._fetch(job)
        finally:  # cancelled too: commit what is known good, free the rest when released
            flags = self._feasible(job)
            self._finish(job, max((e + 1 for e, f in enumerate(flags) if f), default=0))

    def _result(self, job: _Prefetch) -> PrefetchResult:
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

    async def _fetch(self, job: _Prefetch) -> None:
        """One existence check over every pool's keys, then chunked reads until the deadline;
        record per pool which pages arrived intact (no tree change)."""
        pools = self.pools
        total = len(job.keys[0])
        fits = job.pages.numel()  # pages reserved: at most half the host pool in flight
        job.loaded = [[False] * fits for _ in range(pools)]
        timeout = max(job.deadline - time.monotonic(), 0.001)
        flat = [k for keys in job.keys for k in keys]
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
        self.counters.prefetch_storage_hit_tokens += job.hits * self.core.config.page_size
        # what to read: the leading run for KV/ALL pools, present pages inside it for the rest
        plan: list[tuple[int, int]] = [
            (pool, j)
            for pool in range(pools)
            for j in range(min(job.hits, fits))
            if by_pool[pool][j]
        ]
        chunk = self.core.config.prefetch_batch_pages
        alloc = self.core.host_alloc
        assert alloc is not None
        tasks: list[tuple[list[tuple[int, int]], asyncio.Future[list[bool]]]] = []
        try:
            for a in range(0, len(plan), chunk):
                part = plan[a : a + chunk]
                keys = [job.keys[pool][j] for pool, j in part]
                rows = [int(job.pages[j]) for _, j in part]
                bufs = [self._buffers[pool][row] for (pool, _), row in zip(part, rows, strict=True)]
                remaining = max(job.deadline - time.monotonic(), 0.001)
                leased = torch.tensor(rows, dtype=torch.int64)
                alloc.lease(leased)  # a late read must never land in a reused page
                task = asyncio.ensure_future(
                    self.io.get_into(
                        keys,
                        bufs,
                        timeout=remaining,
                        on_release=functools.partial(alloc.unlease, leased),
                    )
                )
                tasks.append((part, task))
            if tasks:
                await asyncio.wait(
                    [t for _, t in tasks], timeout=max(job.deadline - time.monotonic(), 0.0)
                )
            for part, t in tasks:
                if not t.done() or t.cancelled():
                    continue
                failure = t.exception()
                if failure is not None:
                    self.counters.storage_errors += 1
                    job.failed, job.error = True, repr(failure)
                    continue
                for (pool, j), good in zip(part, t.result(), strict=True):
                    job.loaded[pool][j] = good
                    if not good and pool == 0:
                        job.vanished.append(j)
        finally:
            for _, t in tasks:
                if not t.done():
                    t.cancel()
                elif not t.cancelled():
                    t.exception()  # retrieved: counted above

    def _finish(self, job: _Prefetch, end: int) -> None:
        """Commit the first ``end`` pages (agreed across ranks), unpin, free the rest."""
        try:
            job.committed = self._commit(job, end)
            core = self.core
            # per-rank facts about a rank's own store: not published where ranks must agree
            if job.vanished and not core.coordinator.deferred:
                gone = [job.hashes[j] for j in sorted(job.vanished)]
                core.emit(BlockRemoved(gone, Tier.STORAGE.medium))
        finally:
            self.core.tree.unpin(job.anchor)
            del self._jobs[job.rid]
            self._free_reserved(job.rid)  # pages a late read still holds stay quarantined

    def _commit(self, job: _Prefetch, end: int) -> int:
        """Attach the first ``end`` loaded pages below the cached prefix; return pages used.

        A trailing component's pages that did not arrive make the nodes that lack them
        ``invalid`` for it (split where that changes), so no prefix ends inside its window.
        """
        if end == 0:
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
            pieces = self._segments(node, first, end, job)
            for piece, lo, hi in pieces:
                piece.invalid = frozenset(
                    name for pool, name, _ in self._trailing if not all(job.loaded[pool][lo:hi])
                )
                core.emit_stored(piece, Tier.HOST)
        self.counters.prefetch_hit_tokens += used * p
        return used

    def _segments(
        self, node: Node, first: int, end: int, job: _Prefetch
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
