"""``HiCache.flush``: wait for the work that was in flight when it was called.

A flush settles what it was called for, not the cache as a whole: the device<->host copies in
flight at the call (write-through, write-back staging, load-back), the storage backups those
copies start when they land, and the backups and background prefetches queued or running at
the call.  Work that arrives meanwhile does not hold it up, so a flush under sustained inserts
returns.  Each wait is bounded as docs/ARCHITECTURE.md ("Bounded waits") says: copies are
never abandoned, a storage call has its deadline, and the workers busy once those settled get
up to ``storage_timeout`` to hand their pages back.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from aiocache_kv.logs import get_logger
from aiocache_kv.outlast import outlast
from aiocache_kv.transfer.ops import TransferOp, Transfers
from aiocache_kv.tree import Node

if TYPE_CHECKING:
    from aiocache_kv.core import CacheCore
    from aiocache_kv.storage.tier import StorageTier

log = get_logger(__name__)


def _targets(copies: list[TransferOp]) -> list[Node]:
    """Every node the copies applied to (split heads included)."""
    return [n for op in copies for n in op.targets]


async def settle_work(
    core: CacheCore, transfers: Transfers, l3: StorageTier | None, *, until_idle: bool = False
) -> None:
    """Wait for the copies, backups and background prefetches in flight now, and for the
    backups those copies start; with ``until_idle`` repeat until nothing is in flight (for a
    closing cache, where no new work can start).  Failures do not raise here.

    With TP a caller cancelled meanwhile stops waiting only once the agreement rounds ran:
    every rank runs as many, and the other ranks' callers were not cancelled."""
    if core.coordinator.deferred:
        task = asyncio.get_running_loop().create_task(_settle_loop(core, transfers, l3, until_idle))
        if await outlast(task):
            raise asyncio.CancelledError
        task.result()
        return
    await _settle_loop(core, transfers, l3, until_idle)


async def _settle_loop(
    core: CacheCore, transfers: Transfers, l3: StorageTier | None, until_idle: bool
) -> None:
    while True:
        await _settle_once(core, transfers, l3)
        if not until_idle or not (transfers.inflight or (l3 is not None and l3.in_flight)):
            return


async def _settle_once(core: CacheCore, transfers: Transfers, l3: StorageTier | None) -> None:
    coord = core.coordinator
    copies = list(transfers.inflight.values())
    waits: list[asyncio.Future[Any]] = [] if l3 is None else l3.pending_work()
    if coord.deferred:
        # Completions apply only through agreements, one per round; a round can start
        # backups (a copy landed), which later rounds apply.  The rounds depend only on the
        # agreed state (copies and backups are applied at agreed points), never on I/O
        # timing, so every rank runs as many.
        backups = [] if l3 is None else l3.pending_work(prefetches=False)

        def agreed() -> list[asyncio.Future[Any]]:
            done = all(op.future.done() for op in copies)
            later = l3.backups_of(_targets(copies)) if l3 is not None and done else []
            return [op.future for op in copies] + backups + later

        while not all(f.done() for f in agreed()):
            await coord.settle_all()
        if coord.pending:
            await coord.sync()
    if copies:  # copies are never abandoned: each lands (or fails) on its own
        await asyncio.wait([op.future for op in copies])
    if l3 is not None:  # the backups those copies started when they landed, too
        await l3.settle(waits + l3.backups_of(_targets(copies)))
    await settle_zeroing(core)


async def settle_zeroing(core: CacheCore) -> None:
    """Wait for a drop's zeroing of freed pages (and a bad page's drop) for up to
    ``storage_timeout``.  A zeroing first waits for storage workers still reading its pages,
    so a stuck store would hold it: the wait is bounded, and the pages stay quarantined
    until that worker returns, then are zeroed and freed."""
    if core.zeroing:
        _, pending = await asyncio.wait(list(core.zeroing), timeout=core.config.storage_timeout)
        if pending:
            log.warning("zeroing_pending", tasks=len(pending))
