"""How a :class:`~aiocache_kv.cache.HiCache` closes: one sequence, run once in its own task.

``aclose`` starts the sequence the first time it is called and every call awaits it shielded:
a caller that is cancelled (or gives up at its own deadline) stops waiting while the close runs
to its end (the copy engine stopped, the storage tier and its backend closed, event streams
ended), and a second caller waits for that same close instead of returning while it runs.
Each step runs whatever the steps before it raised (a broken tensor-parallel group, a backend
whose close failed): the first error is raised once every part is closed.

A ``start`` that gives up (cancelled, or failing after the storage tier was built) abandons
that tier (:func:`abandon`): its hooks go and its workers stop, while the backend, the
caller's, stays open for a retry (``open`` is idempotent); ``aclose`` of the never-started
cache closes it (:func:`close_abandoned`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TYPE_CHECKING

from aiocache_kv.errors import AgreementError
from aiocache_kv.flush import settle_work, settle_zeroing
from aiocache_kv.logs import get_logger
from aiocache_kv.storage import owners
from aiocache_kv.storage.executor import StorageIO

if TYPE_CHECKING:
    from aiocache_kv.config import CacheConfig
    from aiocache_kv.core import CacheCore
    from aiocache_kv.distributed.coordinator import Coordinator
    from aiocache_kv.pins import HandleTable
    from aiocache_kv.storage.tier import StorageTier
    from aiocache_kv.transfer.engine import CopyEngine
    from aiocache_kv.transfer.ops import Transfers

__all__ = ["abandon", "close_abandoned", "close_parts"]

log = get_logger(__name__)


async def close_parts(
    core: CacheCore,
    engine: CopyEngine,
    transfers: Transfers,
    l3: StorageTier | None,
    handles: HandleTable,
) -> None:
    """Settle the copies in flight, a drop's zeroing (up to ``storage_timeout``), then close
    the storage tier and the TP coordinator; end the handles and event streams whatever
    failed (device and host pages are reported removed; storage persists).

    Bounded even when the store hangs: copies finish, storage calls have their deadlines,
    and the storage tier closes within about ``3 * storage_timeout``.

    Raises:
        The first error a step raised (``AgreementError``: the TP group broke), after every
        part was closed.
    """
    errors: list[Exception] = []
    core.closing = True  # no quota pass from here on: the tree changes only as closing does

    async def step(what: str, work: Awaitable[None]) -> None:
        try:
            await work
        except Exception as exc:  # the other parts still close
            log.error("cache_close_step_failed", step=what, error=repr(exc))
            errors.append(exc)

    try:
        if core.coordinator.deferred:  # every rank closes at the same point of its loop
            await step("settle", settle_work(core, transfers, l3, until_idle=True))
        await step("copy engine", engine.aclose())  # runs what is queued; completions land
        if not any(isinstance(e, AgreementError) for e in errors):
            # (with a broken group no copy is applied any more: the engine's close above
            # already saw every copy's worker return)
            await step("copies", transfers.wait_all())
        await step("zeroing", settle_zeroing(core))
        if l3 is not None:
            await step("storage", l3.aclose())
        await step("coordinator", core.coordinator.aclose())
    finally:
        handles.close()  # a handle dropped after this does not warn
        core.emit_closing()
        core.events.close()
    if errors:
        raise errors[0]


def abandon(
    l3: StorageTier | None, closes: set[asyncio.Task[None]], coordinator: Coordinator
) -> None:
    """A ``start`` gave up on ``l3``: unhook it and stop its workers in the background (a
    task added to ``closes``; bounded: an ``open`` still stuck in a worker is waited for up
    to ``storage_timeout``).  Its backend stays open for a retry, and unclaimed: the retry
    may be a new cache (:mod:`.storage.owners`).  A ``coordinator`` it started (TP: the
    copy engine's start failed after it) is stopped the same way."""
    loop = asyncio.get_running_loop()
    if l3 is not None:
        owners.release(l3.io.backend, l3.core)  # a retry (a new cache too) may claim it
        closes.add(loop.create_task(l3.abandon()))
    if coordinator.started:
        closes.add(loop.create_task(coordinator.aclose()))


async def close_abandoned(
    closes: set[asyncio.Task[None]], config: CacheConfig, owner: object
) -> None:
    """``aclose`` of a cache whose ``start`` gave up: wait for the abandoned tiers' workers,
    then close the backend they opened (on a daemon thread, up to ``storage_timeout``) unless
    another cache holds it: a start refused because another cache uses the backend leaves
    it alone (:mod:`.storage.owners`)."""
    if closes:
        await asyncio.wait(closes)
        backend = config.storage
        if backend is not None and owners.usable_by(backend, owner):
            try:
                io = StorageIO(backend, default_timeout=config.storage_timeout)
                await io.aclose(timeout=config.storage_timeout)
            finally:
                owners.release(backend, owner)
