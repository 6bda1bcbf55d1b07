"""Result and statistics types of the embedding cache (frozen snapshots)."""

from __future__ import annotations

import dataclasses

__all__ = ["COUNTERS", "EmbeddingCacheStats", "InsertBatchStats"]

#: the cache's running counters, each a field of :class:`EmbeddingCacheStats` of that name
COUNTERS = (
    "insert_calls",
    "insert_new",
    "insert_local_hits",
    "insert_skipped",
    "pushed",
    "push_failed",
    "get_calls",
    "get_local_hits",
    "get_store_hits",
    "get_misses",
    "get_no_space",
    "get_invalid",
    "evictions",
    "evicted_bytes",
    "store_errors",
)


@dataclasses.dataclass(frozen=True)
class InsertBatchStats:
    """What one ``insert_batch`` did, per entry of the batch.

    ``new + local_hit + skipped == len(hashes)``.  ``push_failed`` counts entries (new or local
    hits) that the global store did not confirm (store down, timeout, no space); they are still
    cached locally.  Always 0 in local-only mode.
    """

    new: int  # copied into the local pool (and pushed)
    local_hit: int  # already cached locally; pushed again (bytes re-sent only if the store lost it)
    skipped: int  # no room in the pool even after eviction: neither cached nor pushed
    push_failed: int = 0


@dataclasses.dataclass(frozen=True)
class EmbeddingCacheStats:
    """Frozen snapshot of an :class:`~aiocache_kv.embedding.EmbeddingCache`."""

    state: str
    pool_bytes: int
    used_bytes: int  # extents held by entries (aligned), any state
    free_bytes: int
    largest_free_bytes: int
    entries: int  # in the table, any state
    ready: int
    filling: int
    lookup: int
    pinned: int  # READY entries read by an in-flight push (not evictable)
    evictable: int
    evictable_bytes: int
    cleanups_pending: int  # slots waiting for a worker to release them
    insert_calls: int
    insert_new: int
    insert_local_hits: int
    insert_skipped: int
    pushed: int  # entries offered to the global store
    push_failed: int
    get_calls: int
    get_local_hits: int
    get_store_hits: int
    get_misses: int
    get_no_space: int  # present in the store but no room in the pool
    # present but unusable: implausible size, bad header, other dtype (an object that fails
    # the store's integrity check is a miss there: the store's ``corrupt`` counts it)
    get_invalid: int
    evictions: int
    evicted_bytes: int
    store_errors: int  # store calls that raised (unavailable, timeout, ...)
