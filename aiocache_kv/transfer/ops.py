"""Device<->host transfers as plan-then-apply: one planner, one applier, both directions.

:meth:`Transfers.start` plans a copy of whole nodes to the other tier (allocate the destination,
mark the nodes FILLING, build the :class:`~aiocache_kv.transfer.engine.CopyJob`) and submits it;
the copy engine completes it off the loop and the coordinator decides when
:meth:`Transfers.apply` runs (at once with one rank, through an agreement with TP).  Applying
makes the nodes RESIDENT in the destination tier, or rolls them back and frees the destination
pages.  A node split while its copy is in flight adds the new head to the op's targets
(:meth:`Transfers.retarget`), so the outcome lands on every fragment, in path order.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Awaitable, Callable

import numpy as np
import torch

from aiocache_kv.core import CacheCore
from aiocache_kv.distributed.acks import AckQueue
from aiocache_kv.errors import TransferError
from aiocache_kv.logs import get_logger
from aiocache_kv.pools.allocator import PageIds, as_ids
from aiocache_kv.tracing import span
from aiocache_kv.transfer.engine import CopyEngine, CopyJob, Direction
from aiocache_kv.tree import Node, Tier
from aiocache_kv.tree.node import ABSENT, RESIDENT

log = get_logger(__name__)

#: a bounded wait for device pages: runs a round's start until it gets them (see ``capacity``)
Acquire = Callable[
    [Callable[[], list[asyncio.Future[None]]]], Awaitable[list[asyncio.Future[None]]]
]


class OpKind(enum.Enum):
    """Why a copy runs."""

    WRITE_THROUGH = "write_through"
    WRITE_BACK = "write_back"
    LOAD_BACK = "load_back"

    @property
    def direction(self) -> Direction:
        """Device->host for backups, host->device for loads."""
        return Direction.H2D if self is OpKind.LOAD_BACK else Direction.D2H


class TransferOp:
    """One copy in flight and the nodes its completion applies to, in path order."""

    __slots__ = (
        "error",
        "evict_after",
        "future",
        "job",
        "kind",
        "nbytes",
        "staged",
        "started",
        "targets",
    )

    def __init__(self, kind: OpKind, targets: list[Node], future: asyncio.Future[None]) -> None:
        self.kind = kind
        self.targets = targets
        self.future = future  # set when the op is applied to the tree
        self.nbytes = 0
        self.started = time.monotonic()
        self.evict_after: Node | None = None  # write-back: the victim to demote on ack
        self.staged = 0  # write-back: its device pages, counted in ``core.staging`` till then
        self.error: BaseException | None = None  # local copy failure, if any
        self.job: CopyJob | None = None  # the copy (a load's ``bad`` is read from it)

    def __repr__(self) -> str:
        state = "done" if self.future.done() else "pending"
        return f"<TransferOp {self.kind.value} targets={len(self.targets)} {state}>"


class Transfers:
    """The device<->host copies of one cache: plan, submit, apply (on the loop)."""

    def __init__(
        self,
        core: CacheCore,
        engine: CopyEngine,
        on_host_resident: Callable[[list[Node]], None] | None = None,
        on_corrupt: Callable[[Node, int], None] | None = None,
    ) -> None:
        self.core = core
        self.engine = engine
        #: a load-back found a page of ``node`` (at this page offset) that failed its deferred
        #: verification (``storage/deferred.py``): the cache drops it from there on
        self.on_corrupt = on_corrupt
        #: nodes that just became host-resident through a write (the storage tier backs them up)
        self.on_host_resident = on_host_resident
        self.inflight: dict[int, TransferOp] = {}
        self.writes: AckQueue[TransferOp] = AckQueue("write", self.apply)
        self.loads: AckQueue[TransferOp] = AckQueue("load", self.apply)
        core.coordinator.register(self.writes)
        core.coordinator.register(self.loads)
        core.on_split(self.retarget)

    def _queue(self, op: TransferOp) -> AckQueue[TransferOp]:
        return self.loads if op.kind is OpKind.LOAD_BACK else self.writes

    # ------------------------------------------------------------------ plan

    def backup(self, path: list[Node], kind: OpKind) -> TransferOp | None:
        """Copy the device-only nodes of ``path`` (root-most first) to host, or ``None``
        when there are none or the host pool cannot take all of them (all or nothing keeps
        host presence of a run together)."""
        core = self.core
        nodes = [n for n in path if n.host is ABSENT and n.device is RESIDENT]
        if not nodes or core.host_pool is None:
            return None
        need = sum(len(n.key) for n in nodes) // core.page_size
        dst = core.alloc_host(need)
        if dst is None:
            core.counters.write_through_skipped_pages += need
            log.debug("backup_skipped", pages=need, reason="host pool full")
            return None
        core.counters.write_through_started += 1
        op = self._start(kind, nodes, dst)
        if core.config.storage is not None:
            # the pages' hashes (their storage keys' part that costs) while the copy runs:
            # the backup its ack starts then derives keys without hashing first
            for n in nodes:
                core.tree.block_hashes(n)
        return op

    def stage(self, node: Node) -> bool:
        """Write-back: start copying an eviction victim (and its host-less ancestors) to host;
        its device pages are dropped when the copy lands.  ``False`` if no host pages."""
        op = self.backup(self.core.tree.path(node), OpKind.WRITE_BACK)
        if op is None:
            return False
        op.evict_after = node
        op.staged = len(node.key) // self.core.page_size
        self.core.count_staging(node.ns, op.staged)
        return True

    def load(self, nodes: list[Node]) -> TransferOp:
        """Copy host-only ``nodes`` (a run on one path, root-most first) to device.

        Raises:
            CapacityError: too few device pages even after eviction (nothing changed).
        """
        need = sum(len(n.key) for n in nodes) // self.core.page_size
        dst = self.core.alloc_device(need)
        self.core.counters.load_back_started += 1
        return self._start(OpKind.LOAD_BACK, nodes, dst)

    async def load_path(
        self,
        parts: Callable[[], tuple[list[Node], list[Node]]],
        check: Callable[[], None],
        acquire: Acquire | None = None,
    ) -> None:
        """Bring the host run of a pinned match (``parts()``: its device run and the host run
        after it) to device: wait for nodes another load is filling, load the rest, and repeat
        until nothing of the match is host-only.  ``check`` raises once the cache closed or
        the match was released (its unpinned nodes may be evicted by this very load's
        allocation); it runs before every round.  With ``acquire`` (the capacity waiters'
        bounded wait), a round that finds too few device pages waits in line for them:
        ``acquire(attempt)`` runs the round's start again whenever pages may have come back.

        Raises:
            CapacityError: too few device pages even after eviction (nothing changed; with
                ``acquire``: still too few when its wait ended).
            TransferError: a copy failed; its nodes stay host-only.
            CacheClosedError: from ``check``, the cache closed while waiting.
        """
        coord = self.core.coordinator
        rounds = 0
        with span("aiocache_kv.load_back") as sp:
            while True:
                check()  # the cache may have closed, or the match been released, meanwhile
                _, host_nodes = parts()
                if not host_nodes:
                    sp.set_attribute("aiocache_kv.rounds", rounds)
                    return
                rounds += 1
                # FILLING nodes come first on the path (device presence is prefix-closed)
                pending = {id(op.future): op.future for n in host_nodes if (op := n.op)}
                waits = list(pending.values())
                if not waits:
                    pages = sum(len(n.key) for n in host_nodes) // self.core.page_size
                    sp.set_attribute("aiocache_kv.pages", pages)
                    if acquire is None:
                        waits = [self.load(host_nodes).future]
                    else:  # the state may change while it waits: each try starts afresh
                        waits = await acquire(lambda: self._round(parts, check))
                        if not waits:
                            continue
                await coord.settle_landed(self.loads)
                await asyncio.wait(waits)
                failed = [f.exception() for f in waits if f.exception() is not None]
                if failed:
                    raise TransferError(f"load-back failed: {failed[0]}") from failed[0]

    def _round(
        self, parts: Callable[[], tuple[list[Node], list[Node]]], check: Callable[[], None]
    ) -> list[asyncio.Future[None]]:
        """One round of :meth:`load_path` as one step on the loop: what to wait for (the
        copies filling the host run, or the one this round starts; nothing: no host run).

        Raises:
            CapacityError: too few device pages even after eviction (nothing changed).
            HandleError / CacheClosedError: from ``check``.
        """
        check()
        _, host_nodes = parts()
        pending = {id(op.future): op.future for n in host_nodes if (op := n.op)}
        if pending or not host_nodes:
            return list(pending.values())
        return [self.load(host_nodes).future]

    def _start(self, kind: OpKind, nodes: list[Node], dst: torch.Tensor) -> TransferOp:
        """Mark ``nodes`` FILLING in the destination tier at ``dst`` and submit the copy."""
        core = self.core
        tree = core.tree
        load = kind is OpKind.LOAD_BACK
        # device page ids are int64 arrays in the tree, host pages tensors (as_ids: shared)
        parts = [n.host_pages if load else n.device_pages for n in nodes]
        src = torch.from_numpy(np.concatenate([as_ids(p) for p in parts]))  # type: ignore[arg-type]
        op = TransferOp(kind, list(nodes), core.new_future())
        off = 0
        dst_ids = dst.numpy()
        for node in nodes:
            k = len(node.key) // core.page_size
            if load:
                tree.begin_device_fill(node, dst_ids[off : off + k], op)
            else:
                tree.begin_host_fill(node, dst[off : off + k], op)
            off += k
        assert core.device_pool is not None and core.host_pool is not None
        host = core.host_pool
        # a write to be backed up records each host page's checksum as it copies, for the
        # backup's seal (storage/presum.py)
        sums = not load and core.config.storage is not None
        expect = None
        if load:  # pages a Mooncake prefetch read unverified: the copy checks them
            ids = src.numpy()
            flags = host.unverified[ids]
            if flags.any():
                expect = host.sums[ids] * flags[:, None]
        job = CopyJob(
            kind.direction,
            core.device_pool.buffer,
            host.pages,
            src,
            dst,
            core.sidecar_pairs(),
            host_raw=host.raw if sums or expect is not None else None,
            sums=host.sums if sums else None,
            expect=expect,
        )
        op.job = job
        op.nbytes = job.nbytes
        self.inflight[id(op)] = op
        core.coordinator.track(self._queue(op), op)
        self.engine.submit(job, lambda err: self._landed(op, err))
        return op

    def retarget(self, head: Node, tail: Node) -> None:
        """``tail`` was split while its copy was in flight: the copy now covers ``head`` too."""
        if tail.op is not None:
            op: TransferOp = tail.op
            op.targets.insert(op.targets.index(tail), head)

    # ------------------------------------------------------------------ apply

    def _landed(self, op: TransferOp, err: BaseException | None) -> None:
        op.error = err
        self.core.coordinator.land(self._queue(op), op, err is None)

    def apply(self, op: TransferOp, ok: bool) -> None:
        """Apply a finished copy to every target, in path order (on the loop)."""
        del self.inflight[id(op)]
        core = self.core
        tree = core.tree
        c = core.counters
        load = op.kind is OpKind.LOAD_BACK
        end = tree.end_device_fill if load else tree.end_host_fill
        tier = Tier.DEVICE if load else Tier.HOST
        freed: list[PageIds] = []
        good, failed, at = self._verified(op) if ok and load else (op.targets, [], 0)
        # a failed load rolls back children first: device presence stays prefix-closed
        order = good if ok or not load else list(reversed(good))
        for node in order:
            pages = end(node, ok)
            if pages is not None:
                freed.append(pages)
            else:
                core.emit_stored(node, tier)
        for node in reversed(failed):  # after a page that failed verification: never served
            pages = end(node, False)
            assert pages is not None, f"{node!r} kept device pages of a failed verify"
            freed.append(pages)
        if failed and self.on_corrupt is not None:
            self.on_corrupt(failed[0], at)
        if freed:
            (core.free_device if load else core.free_host)(freed)
        t = core.latencies
        hists = {OpKind.LOAD_BACK: t.load_back, OpKind.WRITE_THROUGH: t.write_through}
        hists.get(op.kind, t.write_back).observe(time.monotonic() - op.started)
        if load:
            c.load_back_done += ok
            c.load_back_failed += not ok
            c.bytes_host_to_device += op.nbytes if ok else 0
        else:
            c.write_through_done += ok
            c.write_through_failed += not ok
            c.bytes_device_to_host += op.nbytes if ok else 0
            if ok and self.on_host_resident is not None:
                self.on_host_resident(op.targets)  # every fragment, including split heads
            if op.evict_after is not None:
                core.count_staging(op.evict_after.ns, -op.staged)
            if ok and op.evict_after is not None and op.evict_after.alive:
                core.demote(op.evict_after)
        err = op.error if op.error is not None else "failed on another rank"
        if not ok:
            log.error("transfer_failed", kind=op.kind.value, nodes=len(op.targets), error=repr(err))
        if not op.future.done():
            if ok:
                op.future.set_result(None)
            else:
                op.future.set_exception(TransferError(f"{op.kind.value} copy failed: {err!r}"))
        core.capacity_changed()  # its nodes are idle again (or its pages were freed)

    def _verified(self, op: TransferOp) -> tuple[list[Node], list[Node], int]:
        """Split a landed load's targets at the first page that failed its deferred
        verification: ``(nodes before it, the node holding it and the rest, the page's offset
        in that node)``; its verified pages are unmarked (``storage/deferred.py``)."""
        job = op.job
        if job is None or job.expect is None:
            return op.targets, [], 0
        host = self.core.host_pool
        assert host is not None
        p = self.core.page_size
        bad = job.bad[0] if job.bad else job.src.numel()
        off = 0
        for k, node in enumerate(op.targets):
            n = len(node.key) // p
            if bad < off + n:
                host.unverified[job.src[:bad].numpy()] = False
                return op.targets[:k], op.targets[k:], bad - off
            off += n
        host.unverified[job.src.numpy()] = False
        return op.targets, [], 0

    async def wait_all(self) -> None:
        """Until no copy is in flight (copies are never abandoned)."""
        while self.inflight:
            await asyncio.wait([op.future for op in self.inflight.values()])

    def check_invariants(self) -> None:
        """Every op in flight is unsettled and its targets point back at it."""
        for op in self.inflight.values():
            assert not op.future.done(), f"settled op still in flight {op!r}"
            for node in op.targets:
                assert node.op is op, f"{op!r} target {node!r} points elsewhere"
        for node in self.core.tree.walk():
            if node.op is not None:
                assert id(node.op) in self.inflight, f"{node!r} points at a settled op"


__all__ = ["OpKind", "TransferOp", "Transfers"]
