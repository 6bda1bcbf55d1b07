"""What :class:`~aiocache_kv.cache.HiCache` reports about itself: statistics snapshots, the
cached blocks (for a KV-event consumer that joined late) and the invariant check.  A mixin
``HiCache`` inherits; the work is ``introspection.py``'s."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from aiocache_kv.blocks import BlockInfo
from aiocache_kv.events import BlockStored, KVEvent
from aiocache_kv.introspection import blocks, check_all, describe, snapshot, snapshot_events
from aiocache_kv.lifecycle import Lifecycle
from aiocache_kv.stats import CacheStatistics

if TYPE_CHECKING:
    from aiocache_kv.capacity import CapacityWaiters
    from aiocache_kv.core import CacheCore
    from aiocache_kv.pins import HandleTable
    from aiocache_kv.storage.tier import StorageTier
    from aiocache_kv.transfer.ops import Transfers


class CacheReports:
    """Mixin of :class:`~aiocache_kv.cache.HiCache`: reports that change nothing."""

    # the facade's state (set by HiCache.__init__)
    _core: CacheCore
    _handles: HandleTable
    _l3: StorageTier | None
    _transfers: Transfers
    _state: Lifecycle
    _waiters: CapacityWaiters

    def statistics(self) -> CacheStatistics:
        """A frozen snapshot of sizes, hits, latencies and operations in flight."""
        self._core.check_owner()
        return snapshot(self._core, self._transfers, self._l3)

    def snapshot(self) -> list[BlockInfo]:
        """Every cached block (hash, parent hash, tokens, tiers, namespace), parents first:
        what a KV-event consumer that joined late needs to resync.

        Raises:
            OwnershipError: called from a thread other than the loop's.
        """
        self._core.check_owner()
        return blocks(self._core)

    def snapshot_events(self) -> list[BlockStored]:
        """The event stream's view of the cache as ``BlockStored`` events (parents first):
        what :class:`~aiocache_kv.events.ZmqEventPublisher` answers a snapshot request with.
        Every page still claimed in storage is in it, and after :meth:`aclose` only those.

        Raises:
            OwnershipError: called from a thread other than the loop's.
        """
        self._core.check_owner()
        return snapshot_events(self._core, self._l3, closed=self._state is Lifecycle.CLOSED)

    def check_invariants(self) -> None:
        """Recompute every counter and cross-check tree, allocators, handles and transfers.

        Raises:
            AssertionError: naming the broken invariant.
        """
        handles = self._handles
        check_all(self._core, handles.nodes(), self._transfers, self._l3, handles.retained())
        self._waiters.check_invariants()

    def events(self) -> AsyncIterator[KVEvent]:
        """Async iterator over KV events as they happen; ends when the cache closes."""
        return self._core.events.stream()

    def __repr__(self) -> str:
        return describe(self._core, self._transfers, self._state.name)
