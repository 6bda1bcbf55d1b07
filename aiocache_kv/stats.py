"""The cache's counters (mutable, on the loop) and their frozen snapshots."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from aiocache_kv.telemetry import HistogramSnapshot


@dataclass(slots=True)
class CacheCounters:
    """Counters of the device and host tiers, bumped on the loop."""

    match_queries: int = 0
    hit_tokens_device: int = 0
    hit_tokens_host: int = 0
    inserted_tokens: int = 0
    write_through_started: int = 0
    write_through_done: int = 0
    write_through_failed: int = 0
    write_through_skipped_pages: int = 0
    load_back_started: int = 0
    load_back_done: int = 0
    load_back_failed: int = 0
    bytes_device_to_host: int = 0
    bytes_host_to_device: int = 0
    evicted_pages_device: int = 0  #: device copies dropped (demoted or deleted)
    evicted_pages_host: int = 0  #: host copies dropped


@dataclass(slots=True)
class StorageCounters:
    """Counters of the storage tier, bumped on the loop."""

    backup_started: int = 0
    backup_pages_ok: int = 0
    backup_pages_failed: int = 0
    backup_skipped_pages: int = 0
    prefetch_queries: int = 0
    prefetch_storage_hit_tokens: int = 0
    prefetch_hit_tokens: int = 0
    prefetch_pages_discarded: int = 0
    storage_errors: int = 0
    evicted_pages_storage: int = 0


@dataclass(frozen=True, slots=True)
class TierStatistics:
    """Page counts of one tier."""

    total_pages: int
    free_pages: int
    held_pages: int  #: handed out by ``alloc`` and not yet inserted or freed
    evictable_pages: int
    protected_pages: int  #: pinned or in flight
    #: freed while a worker thread still holds them; free again when the worker is done
    quarantined_pages: int = 0
    #: callers' rows the tree did not take, kept by unreleased insert results (device)
    retained_pages: int = 0


@dataclass(frozen=True, slots=True)
class CacheStatistics:
    """A consistent snapshot, taken on the loop."""

    device: TierStatistics
    host: TierStatistics
    nodes: int
    namespaces: int
    match_queries: int
    hit_tokens_device: int
    hit_tokens_host: int
    inserted_tokens: int
    write_through_started: int
    write_through_done: int
    write_through_failed: int
    write_through_skipped_pages: int
    load_back_started: int
    load_back_done: int
    load_back_failed: int
    bytes_device_to_host: int
    bytes_host_to_device: int
    ops_in_flight: int
    events_published: int
    storage_in_flight: int = 0  #: backups and background prefetches
    prefetch_reserved_pages: int = 0  #: host pages held by prefetches in flight
    backup_started: int = 0
    backup_pages_ok: int = 0
    backup_pages_failed: int = 0
    backup_skipped_pages: int = 0  #: not attempted while backing off after a failure
    prefetch_queries: int = 0
    prefetch_storage_hit_tokens: int = 0
    prefetch_hit_tokens: int = 0  #: committed to the host tier
    prefetch_pages_discarded: int = 0  #: loaded or reserved but not committed
    storage_errors: int = 0
    evicted_pages_device: int = 0  #: device copies dropped by eviction (demoted or deleted)
    evicted_pages_host: int = 0  #: host copies dropped by eviction
    #: pages the storage backend reported evicted (``BlockRemoved(STORAGE)``, node re-backed up)
    evicted_pages_storage: int = 0
    events_pending: int = 0  #: KV events buffered and not yet taken or streamed
    events_dropped: int = 0  #: KV events dropped because the buffer was full
    #: seconds per operation: load_back, write_through, write_back, backup, prefetch
    latency: Mapping[str, HistogramSnapshot] = field(default_factory=dict)
