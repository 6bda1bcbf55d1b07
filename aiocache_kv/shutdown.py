"""How a :class:`~aiocache_kv.cache.HiCache` closes: one sequence, run once in its own task.

``aclose`` starts the sequence the first time it is called and every call awaits it shielded:
a caller that is cancelled (or gives up at its own deadline) stops waiting while the close runs
to its end (the copy engine stopped, the storage tier and its backend closed, event streams
ended), and a second caller waits for that same close instead of returning while it runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiocache_kv.flush import settle_work, settle_zeroing

if TYPE_CHECKING:
    from aiocache_kv.core import CacheCore
    from aiocache_kv.pins import HandleTable
    from aiocache_kv.storage.tier import StorageTier
    from aiocache_kv.transfer.engine import CopyEngine
    from aiocache_kv.transfer.ops import Transfers

__all__ = ["close_parts"]


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
    """
    try:
        if core.coordinator.deferred:  # every rank closes at the same point of its loop
            await settle_work(core, transfers, l3, until_idle=True)
        await engine.aclose()  # runs what is queued; completions reach the loop
        await transfers.wait_all()
        await settle_zeroing(core)
        if l3 is not None:
            await l3.aclose()
        await core.coordinator.aclose()
    finally:
        handles.close()  # a handle dropped after this does not warn
        core.emit_closing()
        core.events.close()
