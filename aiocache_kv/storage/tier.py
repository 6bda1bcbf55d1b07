"""The storage tier as the cache sees it: L2 -> L3 backup and L3 -> L2 prefetch.

Design
------
``StorageTier`` is the cache's collaborator for L3.  It runs on the loop thread and changes the
tree only through the :class:`~aiocache_kv.core.CacheCore` (tree, allocators, events), in plain
synchronous steps between awaits; completions reach the tree through the core's coordinator;
blocking backend calls run on :class:`~aiocache_kv.storage.executor.StorageIO` workers.

Backup.  When a write ack makes nodes host-resident, :meth:`backup` marks them storage-FILLING
(their host copy is then protected from eviction) and queues the op.  At most
``storage_workers`` backup puts are in flight; ops acked meanwhile are sent together, in ack
order, as one put of up to :data:`BACKUP_BATCH_BYTES` (at least one op), so a burst of small
write acks pays the per-call cost once per batch of bytes rather than once per ack.  The last
group queued goes out over every idle worker instead: consecutive slices of at least
:data:`BACKUP_PART_BYTES`, put at once (a slice that fails fails the group, as one put
would).  Every op keeps its own slice of the verdicts and lands on its own; an op still queued
at its deadline (``storage_timeout`` after its ack) fails unsent.  Node splits re-target an op
as they do copies, and its per-page results are consumed in target order: every fragment gets
its own verdict and STORAGE ``BlockStored`` event, and a failed page is never called stored.
After a backup the store took nothing of (the call failed or timed out, or it refused every
page) the tier backs off for ``storage_retry_seconds``; one it took some pages of (a full store
refusing a page while it evicts, as a Mooncake master does) is no reason to stop backing up.
Nodes whose backup failed stay storage-ABSENT and are retried on a later hit.

Prefetch is :mod:`.prefetch`'s job, the plumbing (executor, buffer views, keys) :mod:`.tier_base`'s.

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
import collections
import contextvars
import functools
import itertools
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from aiocache_kv.distributed.acks import AckQueue
from aiocache_kv.errors import KVCacheError, StorageTimeoutError
from aiocache_kv.events import BlockRemoved
from aiocache_kv.logs import get_logger
from aiocache_kv.pools.allocator import PageIds
from aiocache_kv.storage import owners
from aiocache_kv.storage.backup_op import BackupOp, put_lists, put_parts
from aiocache_kv.storage.base import (
    ChainAwareStorage,
    PageBuffer,
    StorageBackend,
)
from aiocache_kv.storage.fences import FenceHold
from aiocache_kv.storage.integrity import FRAME_OVERHEAD
from aiocache_kv.storage.key_layout import COMPONENT
from aiocache_kv.storage.prefetch import (
    PrefetchingTier,
    PrefetchResult,
    PrefetchStatus,
    prefetch_timeout,
)
from aiocache_kv.storage.worker_pages import WorkerPages, joined
from aiocache_kv.tracing import SpanLike, span
from aiocache_kv.tree.node import ABSENT, RESIDENT, Node, Tier, continues

if TYPE_CHECKING:
    from aiocache_kv.core import CacheCore
    from aiocache_kv.namespace import Namespace

log = get_logger(__name__)


#: backups queued while every storage worker is busy are sent together, in puts of about this
#: many bytes of pages (trailers aside; an op at least): the per-call cost is paid per batch
BACKUP_BATCH_BYTES = 32 << 20
#: a backup with storage workers to spare is split into puts of at least this many bytes,
#: one per idle worker, so one large backup does not run on one worker while the others idle
BACKUP_PART_BYTES = 2 << 20


class StorageTier(PrefetchingTier):
    """L3 for one cache.  Created and driven by :class:`~aiocache_kv.cache.HiCache`."""

    def __init__(self, core: CacheCore, backend: StorageBackend) -> None:
        super().__init__(core, backend)
        self._backups: dict[int, BackupOp] = {}
        self.acks: AckQueue[BackupOp] = AckQueue("backup", self._apply_backup)
        core.coordinator.register(self.acks)
        core.on_split(self.retarget)
        self._retry_after = 0.0
        self._queued: collections.deque[BackupOp] = collections.deque()  # waiting for a worker
        self._sending = 0  # backup puts handed to StorageIO and not yet answered
        self._pump_scheduled = False
        #: backups whose put workers have not returned yet (a drop marks their targets)
        self._putting: dict[int, BackupOp] = {}

    def pending_work(self, *, prefetches: bool = True) -> list[asyncio.Future[Any]]:
        """The backups queued or running and (with ``prefetches``) the background
        prefetches, as of now: what a flush called now waits for."""
        waits: list[asyncio.Future[Any]] = [op.future for op in self._backups.values()]
        return waits + list(self._tasks) if prefetches else waits

    @staticmethod
    def backups_of(nodes: list[Node]) -> list[asyncio.Future[None]]:
        """The backups reading ``nodes`` now (one started when a node's host copy landed)."""
        ops = {id(n.backup): n.backup for n in nodes if n.backup is not None}
        return [op.future for op in ops.values()]

    async def settle(
        self, waits: list[asyncio.Future[Any]] | None = None, *, drain: bool = True
    ) -> None:
        """Wait for ``waits`` (from :meth:`pending_work` and :meth:`backups_of`; ``None``:
        every backup and background prefetch, until none is left), each bounded by its
        deadline, then up to ``storage_timeout`` for the workers busy at that point to hand
        their pages back (with ``waits``, not for calls handed over later: new work does not
        hold a flush up).  Workers still stuck after that keep their pages quarantined
        (``statistics().host.quarantined_pages``) and release them when they return."""
        if waits is None:
            while self._backups or self._tasks:
                await asyncio.wait(self.pending_work())
        elif waits:
            await asyncio.wait(waits)
        if drain and self.io.io_statistics().in_flight:
            try:
                drained = self.io.drain(later=waits is None)
                await asyncio.wait_for(drained, self.core.config.storage_timeout)
            except asyncio.TimeoutError:
                log.warning(
                    "storage_workers_stuck",
                    calls=self.io.io_statistics().in_flight,
                    quarantined_pages=self._quarantined(),
                )

    async def aclose(self) -> None:
        """Settle, then close the executor and the backend: within about three
        ``storage_timeout`` however stuck the store is (deadlines, the workers' drain, the
        backend's close), abandoning stuck workers (their pages stay quarantined).  A
        prefetch still reading commits nothing into the closing cache."""
        for job in self._jobs.values():
            job.dropped = True
        try:
            await self.settle(drain=False)  # the executor's close drains, bounded
        finally:
            try:
                await self.io.aclose(timeout=self.core.config.storage_timeout)
            finally:
                owners.release(self.io.backend, self.core)

    async def abandon(self) -> None:
        """A cache's ``start`` gave up on this tier: its hooks go (a retry builds another
        tier), its workers stop (bounded as :meth:`aclose`); the backend stays open."""
        self.core.off_split(self._split_stored, self.retarget)
        self.core.coordinator.unregister(self.acks)
        await self.io.aclose(timeout=self.core.config.storage_timeout, keep_backend=True)

    @property
    def in_flight(self) -> int:
        """Backups and background prefetches not yet settled."""
        return len(self._backups) + len(self._tasks)

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
        p = core.config.page_size
        if self._fences and not core.coordinator.deferred:
            # a drop is removing keys of these namespaces (a tenant's tag, or the keys of a
            # prefix): a put landing now could be removed under its claim.  Not now, from
            # the first such node on; a later hit backs them up again.  (With TP each rank's
            # drop ends on its own clock: ranks would disagree.)
            fenced = {ns for ns, _ in self._fences}
            cut = next((i for i, n in enumerate(todo) if n.ns in fenced), len(todo))
            if cut < len(todo):
                self.counters.backup_skipped_pages += sum(len(n.key) for n in todo[cut:]) // p
                todo = todo[:cut]
        if not todo:
            return None
        pages = sum(len(n.key) for n in todo) // p
        # back off after a failure (single rank only: a clock must not shape a TP tree)
        if not core.coordinator.deferred and time.monotonic() < self._retry_after:
            self.counters.backup_skipped_pages += pages
            return None
        loop = core.loop
        assert loop is not None
        op = BackupOp(todo, loop.create_future())
        keys: list[str] = []
        parents: list[str | None] = []  # the key each page depends on (chain-aware eviction)
        idents: list[bytes] = []  # what each page was computed from (its trailer binds it)
        bufs: list[PageBuffer] = []
        entry_pages = op.entry_pages
        components = core.config.components
        buffers = self._buffers
        nbytes = 0
        base = 0
        # per node and pool, whole lists at a time (C loops): no Python step per page
        for node in todo:
            hashes = tree.block_hashes(node)
            prev = tree.parent_hash(node)
            host = node.host_pages
            assert host is not None
            rows = host.tolist()  # one conversion per node, for every pool
            k = len(hashes)
            for pool in range(self.pools):
                if pool and components[pool - 1].name in node.invalid:
                    continue  # never store a page this node does not have
                # each page depends on the one before it (its key is made beside the node's)
                if prev is None:
                    mine = self._keys(node.ns, hashes, pool)
                    parents.append(None)
                    parents += mine[:-1]
                else:
                    mine = self._keys(node.ns, [prev, *hashes], pool)
                    parents += mine[:-1]
                    del mine[0]
                keys += mine
                idents += hashes
                views = buffers[pool]
                bufs += map(views.__getitem__, rows)
                if k:  # every view of a pool has one size: the page, then its trailer
                    nbytes += k * (views[rows[0]].nbytes - FRAME_OVERHEAD)
                entry_pages += range(base, base + k)
            base += k
            tree.begin_backup(node, op)
        self._backups[id(op)] = op
        core.coordinator.track(self.acks, op)
        self.counters.backup_started += 1
        op.pages = [n.host_pages for n in todo if n.host_pages is not None]
        op.keys, op.parents, op.bufs, op.idents = keys, parents, bufs, idents
        op.nbytes = nbytes
        op.deadline = loop.time() + core.config.storage_timeout
        self._queued.append(op)
        self._schedule_pump()
        return op

    def _schedule_pump(self) -> None:
        if not self._pump_scheduled and self._queued:
            loop = self.core.loop
            assert loop is not None
            self._pump_scheduled = True
            loop.call_soon(self._pump)

    def _pump(self) -> None:
        """Send queued backups while a storage worker is free, those queued meanwhile
        together (up to :data:`BACKUP_BATCH_BYTES` a put, in ack order; on the loop)."""
        self._pump_scheduled = False
        loop = self.core.loop
        assert loop is not None
        while self._queued and self._sending < self.io.workers:
            group = [self._queued.popleft()]
            size = group[0].nbytes
            while self._queued and size + self._queued[0].nbytes <= BACKUP_BATCH_BYTES:
                size += self._queued[0].nbytes
                group.append(self._queued.popleft())
            parts = 1
            if not self._queued:  # the last group: spread it over every idle worker
                pages = sum(len(op.keys) for op in group)
                idle = self.io.workers - self._sending
                parts = max(1, min(idle, pages, size // BACKUP_PART_BYTES))
            self._sending += parts
            for op in group:  # putting from now on: a drop before the task runs marks it
                self._putting[id(op)] = op
            held = [p for op in group for p in op.pages]  # (joined only where leased)
            for op in group:
                op.pages = []
            try:  # (_send raises only before it hands anything over: the task path runs)
                sent = not self.core.coordinator.deferred and self._send(group, held, parts)
            except Exception:  # a broken hand-over must not orphan the group: flush waits on it
                log.exception("backup_send_failed", nodes=len(group))
                sent = False
            if not sent:  # one lease for the group's pages until its workers are done
                alloc = self.core.host_alloc
                assert alloc is not None
                hosts = joined(held)
                alloc.lease(hosts)
                unlease = functools.partial(alloc.unlease, hosts)
                loop.create_task(self._run_backup(group, parts, unlease))

    @property
    def backups_pending(self) -> int:
        """Backups started and not yet applied."""
        return len(self._backups)

    def _releaser(self, group: list[BackupOp], unlease: Callable[[], None]) -> Callable[[], None]:
        def release() -> None:  # on the loop, once the put's workers are done, late or not
            unlease()
            self.reconcile_evictions()  # a put that ended after its deadline evicted too
            self._remove_late(group)

        return release

    def _send(self, group: list[BackupOp], pages: Sequence[PageIds], parts: int) -> bool:
        """Hand ``group``'s put to workers now in ``parts`` slices, without a task (one rank,
        in time, a slot for every slice); its verdicts land once every slice answered (one
        failing fails the group), after the next put is handed over.  ``False``: not sent.

        The host ``pages`` it reads are leased only if the verdicts come first (the put's
        deadline): until they land, its nodes are storage-FILLING and nothing evicts or
        frees them, so a put answered in time costs no lease."""
        loop = self.core.loop
        assert loop is not None
        alloc = self.core.host_alloc
        assert alloc is not None
        timeout = min(op.deadline for op in group) - loop.time()
        if timeout <= 0 or not self.io.has_slots(parts):  # the task path fails or waits
            return False
        keys, parents, idents, bufs = put_lists(group)
        backend = self.io.backend
        # the span runs from here to the verdicts, current in a context of its own
        ctx = contextvars.copy_context()
        cm = span("aiocache_kv.backup", pages=len(keys), nodes=len(group))
        sp = ctx.run(cm.__enter__)
        hold = WorkerPages(alloc, pages)
        results, errors, left = [False] * len(keys), list[str](), [parts, parts]

        def release() -> None:  # on the loop, once every slice's worker is done
            left[1] -= 1
            if not left[1]:
                hold.release()
                self.reconcile_evictions()  # a put that ended after its deadline evicted too
                self._remove_late(group)

        def done(a: int, b: int, fut: asyncio.Future[list[bool]]) -> None:  # on the loop
            if fut.cancelled():
                errors.append("cancelled")
            elif (exc := fut.exception()) is not None:
                errors.append(repr(exc))
            else:
                results[a:b] = fut.result()
            left[0] -= 1
            if left[0]:
                return
            hold.keep()  # verdicts before the workers returned: their pages stay theirs
            try:
                got = [False] * len(keys) if errors else results
                self._verdicts(group, parts, got, errors[0] if errors else None, sp)
            finally:
                ctx.run(cm.__exit__, None, None, None)

        n = len(keys)
        for a, b in itertools.pairwise([n * i // parts for i in range(parts + 1)]):
            fn: Callable[[], list[bool]] = functools.partial(
                backend.put, keys[a:b], bufs[a:b], identities=idents[a:b]
            )
            if self._chain_aware:
                chain = cast(ChainAwareStorage, backend).put_chain
                fn = functools.partial(
                    chain, keys[a:b], bufs[a:b], parents[a:b], identities=idents[a:b]
                )
            on_done = functools.partial(done, a, b)
            sent = self.io.start(
                "put", fn, timeout=timeout, on_done=on_done, buffers=bufs[a:b], on_release=release
            )
            assert sent, "a slot was free for every slice"
        return True

    def _verdicts(
        self,
        group: list[BackupOp],
        parts: int,
        results: list[bool],
        error: str | None,
        sp: SpanLike,
    ) -> None:
        """The put of ``group`` answered: hand out each op's slice of ``results``, send what
        is queued (the workers are free again), then land every op, in order (on the loop).
        A backend's answer of another length than its keys is a failed put."""
        if len(results) != (n := sum(len(op.keys) for op in group)):
            error = error or f"the put answered {len(results)} verdicts for {n} keys"
            results = [False] * n
        at = 0
        for op in group:
            n = len(op.keys)
            op.results = results[at : at + n]
            op.error = error
            at += n
        sp.set_attribute("aiocache_kv.pages_ok", sum(results))
        if error is not None:
            sp.set_attribute("aiocache_kv.error", error)
        self._sending -= parts
        try:
            self._pump()  # the next put starts before this one's bookkeeping
        finally:
            for op in group:
                self._land_backup(op)

    async def _run_backup(
        self, group: list[BackupOp], parts: int, unlease: Callable[[], None]
    ) -> None:
        """One put for ``group``'s pages (``parts`` concurrent puts of consecutive slices)
        in a task (with TP, or when :meth:`_send` could not: past its deadline, no slot for
        every slice); each op gets its own slice of the verdicts and lands on its own, in
        order.  The group's lease ends (``unlease``) when the workers are done."""
        keys, parents, idents, bufs = put_lists(group)
        release = self._releaser(group, unlease)
        loop = self.core.loop
        assert loop is not None
        results: list[bool] = [False] * len(keys)
        error: str | None = None
        with span("aiocache_kv.backup", pages=len(keys), nodes=len(group)) as sp:
            try:
                timeout = min(op.deadline for op in group) - loop.time()
                if timeout <= 0:  # queued past its deadline behind busy workers
                    release()
                    raise StorageTimeoutError("storage put did not start in time")
                results = await put_parts(
                    self.io, keys, bufs, parents, idents, timeout, release, parts
                )
            except KVCacheError as exc:
                error = repr(exc)
                if self.core.coordinator.deferred:  # every rank frees at the agreed point
                    await self.io.wait_released(bufs)
            except BaseException:
                error = "cancelled"
                raise
            finally:
                self._verdicts(group, parts, results, error, sp)

    def _land_backup(self, op: BackupOp) -> None:
        # one rank applies per-page verdicts (ok=True: the results decide); TP agrees on
        # all-or-nothing
        ok = all(op.results) if self.core.coordinator.deferred else True
        self.core.coordinator.land(self.acks, op, ok)

    def _apply_backup(self, op: BackupOp, ok: bool) -> None:
        """Apply per-page verdicts to every target, in order (on the loop).

        ``ok=False`` (agreed across ranks) fails every page whatever this rank saw.
        """
        self.reconcile_evictions()  # what this put (or another) evicted: never announced
        del self._backups[id(op)]
        core = self.core
        tree = core.tree
        p = core.config.page_size
        pages = sum(len(node.key) for node in op.targets) // p
        assert len(op.results) == len(op.entry_pages), "a verdict per stored key"
        page_ok: list[bool] | None = None  # None: every page stored (the usual case)
        if not ok or op.lost or not all(op.results):
            page_ok = [ok] * pages  # a page is stored when every pool's key for it is
            for j, good in zip(op.entry_pages, op.results, strict=True):
                if not good:
                    page_ok[j] = False
            for k in op.lost:  # stored, then evicted before this landed: not in the store now
                page_ok[op.entry_pages[k]] = False
        i = 0
        ok_pages = 0
        for node in op.targets:  # split heads were inserted in path order: pages line up
            k = len(node.key) // p
            node_ok = page_ok is None or all(page_ok[i : i + k])
            i += k
            tree.end_backup(node, node_ok)
            if node_ok and node.alive:  # a dropped node's pages are removed, not claimed
                ok_pages += k
                self.remember_announced(node)
        assert i == pages, f"backup covers {pages} pages but targets {i}"
        failed = pages - ok_pages
        core.latencies.backup.observe(time.monotonic() - op.started)
        self.counters.backup_pages_ok += ok_pages
        self.counters.backup_pages_failed += failed
        if failed:
            self.counters.storage_errors += 1
            if op.error is not None or not any(op.results):  # the store took nothing: rest
                self._retry_after = time.monotonic() + core.config.storage_retry_seconds
            log.warning("backup_incomplete", pages=pages, failed=failed, error=op.error)
        if not op.future.done():
            op.future.set_result(None)
        if tree.detached:
            core.capacity_changed()  # dropped nodes it read may be freed now

    # ------------------------------------------------------------------ drops (purge.py)

    def node_keys(self, node: Node) -> list[str]:
        """Every storage key of ``node``'s pages (KV and every component)."""
        return self.page_keys(node.ns, self.core.tree.block_hashes(node))

    def page_keys(self, ns: Namespace, hashes: list[bytes]) -> list[str]:
        """Every storage key of the pages ``hashes`` of ``ns`` (KV and every component)."""
        return [k for pool in range(self.pools) for k in self._keys(ns, hashes, pool)]

    async def workers_done(self, pages: torch.Tensor) -> None:
        """Until no storage worker holds any of the host ``pages`` (every pool's slot)."""
        for pool in range(self.pools):
            await self.io.wait_released(self._bufs(pages, pool))

    def mark_dropped(
        self,
        nodes: list[Node],
        namespaces: frozenset[Namespace] = frozenset(),
        prefix: list[int] | None = None,
        *,
        late_only: bool = False,
    ) -> None:
        """``nodes`` were dropped, and of ``namespaces`` everything (``prefix`` None, a
        tenant drop) or every node holding ``prefix``'s last page or continuing it (a prefix
        drop): a backup still putting one of them removes what it put of them once its
        workers are done (whether or not it already landed).  By namespace and prefix too,
        because a put that missed its deadline still runs after its node left the tree by
        eviction.  ``late_only`` (a storage-only drop, whose nodes stay in the tree and whose
        backups it awaits): only puts already past their landing, or of nodes gone."""
        ids = {id(n) for n in nodes}
        p = self.core.config.page_size

        def hit(n: Node) -> bool:
            if id(n) in ids:
                return True
            return n.ns in namespaces and (prefix is None or continues(n, prefix, p))

        for op in [*self._putting.values(), *self._queued]:
            landed = id(op) not in self._backups
            have = {id(n) for n in op.dropped}
            op.dropped += [
                n
                for n in op.targets
                if id(n) not in have and hit(n) and (not late_only or landed or not n.alive)
            ]

    def _remove_late(self, group: list[BackupOp]) -> None:
        """``group``'s workers are done: what it put of targets a drop marked is removed.
        The same pages computed again since the drop may be claimed (a backup of them
        landed) or be in a backup not landed yet by now, and the removal takes the keys they
        share: as for a storage eviction, those claims go (``BlockRemoved``; a later hit
        backs them up again) and such a backup fails those pages; a backup of those
        namespaces waits for the removal (a fence), so none lands under it."""
        for op in group:
            self._putting.pop(id(op), None)
        dropped = [n for op in group for n in op.dropped]
        if not dropped:
            return
        keys = [k for n in dropped for k in self.node_keys(n)]
        fences = []
        if not self.core.coordinator.deferred:  # with TP the tree must not follow one rank
            tree = self.core.tree
            hashes = dict.fromkeys(h for n in dropped for h in tree.block_hashes(n))
            claimed = self.retract_claims(list(hashes))
            self._evicted_in_flight(set(keys))
            if claimed:
                self.core.emit(BlockRemoved(claimed, Tier.STORAGE.medium))
            fences = [self.fence(ns, None) for ns in dict.fromkeys(n.ns for n in dropped)]
        loop = self.core.loop
        assert loop is not None
        self._track(loop.create_task(self._remove_keys_late(keys, fences)))

    async def _remove_keys_late(
        self, keys: list[str], fences: list[tuple[Namespace, bytes | None]]
    ) -> None:
        hold = FenceHold(functools.partial(self.unfence, *fences))
        try:  # the fences stand until the worker is done, however late (fences.py)
            removed = await self.remove_keys(keys, on_release=hold.worker())
        except KVCacheError as exc:
            log.warning("drop_late_remove_failed", keys=len(keys), error=repr(exc))
            return
        finally:
            hold.done()
        self.counters.late_puts_removed += removed

    def _evicted_in_flight(self, keys: set[str]) -> None:
        """Fail the pages of ``keys`` in every backup not yet landed (on the loop)."""
        for op in self._backups.values():
            if not keys.isdisjoint(op.keys):
                op.lost.update(i for i, key in enumerate(op.keys) if key in keys)

    def retarget(self, head: Node, tail: Node) -> None:
        """A node under backup was split: the backup now covers both parts, head first."""
        if tail.backup is not None:
            op: BackupOp = tail.backup
            op.targets.insert(op.targets.index(tail), head)


__all__ = [
    "COMPONENT",
    "BackupOp",
    "PrefetchResult",
    "PrefetchStatus",
    "StorageTier",
    "prefetch_timeout",
]
