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
    drops: int = 0  #: ``drop`` calls that changed something (``purge.py``)
    dropped_pages_device: int = 0  #: device pages freed by drops (at once or once idle)
    dropped_pages_host: int = 0  #: host pages freed by drops
    zeroized_bytes: int = 0  #: bytes of freed device and host pages overwritten with zeros
    warms: int = 0  #: ``warm`` calls (one per prompt of ``warm_from``)
    warms_cut_short: int = 0  #: of those, ended by their timeout (or cancelled)
    warm_storage_tokens: int = 0  #: tokens warm-ups brought in from storage


@dataclass(slots=True)
class PinCounters:
    """Counters of the hard pins (``cache.pin``), bumped on the loop."""

    pins_created: int = 0
    pins_released: int = 0  #: by ``unpin`` or when the cache closed
    pins_expired: int = 0  #: their ``ttl`` ran out


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
    dropped_pages_storage: int = 0  #: keys removed from the store by drops (any node's)
    prefetch_dropped: int = 0  #: prefetches that committed nothing because of a drop
    late_puts_removed: int = 0  #: keys a backup put after their drop, removed again
    #: prefetched pages that failed their verification at load-back (``storage/deferred.py``)
    load_back_corrupt_pages: int = 0


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
    #: storage calls a worker thread still runs, calls past their deadline included (a stuck
    #: store shows here: its pages stay quarantined until the call returns)
    storage_calls_running: int = 0
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
    drops: int = 0  #: ``drop`` calls that changed something
    dropped_pages_device: int = 0  #: device pages freed by drops (at once or once idle)
    dropped_pages_host: int = 0  #: host pages freed by drops
    dropped_pages_storage: int = 0  #: keys removed from the store by drops
    zeroized_bytes: int = 0  #: freed device and host bytes overwritten with zeros by drops
    prefetch_dropped: int = 0  #: prefetches that committed nothing because of a drop
    late_puts_removed: int = 0  #: keys a backup put after their drop, removed again
    #: prefetched pages that failed their verification at load-back (``storage/deferred.py``)
    load_back_corrupt_pages: int = 0
    events_pending: int = 0  #: KV events buffered and not yet taken or streamed
    events_dropped: int = 0  #: KV events dropped because the buffer was full
    warms: int = 0  #: ``warm`` calls (one per prompt of ``warm_from``)
    warms_cut_short: int = 0  #: warm-ups ended by their timeout (or cancelled)
    warm_storage_tokens: int = 0  #: tokens warm-ups brought in from storage
    active_pins: int = 0  #: hard pins in force now
    pinned_pages_device: int = 0  #: device pages under a hard pin (each page once)
    pinned_pages_host: int = 0  #: host pages under a hard host pin (each page once)
    pins_created: int = 0
    pins_released: int = 0  #: ended by ``unpin`` or by closing the cache
    pins_expired: int = 0  #: ended by their ``ttl``
    #: seconds per operation: load_back, write_through, write_back, backup, prefetch
    latency: Mapping[str, HistogramSnapshot] = field(default_factory=dict)
    #: per-tenant quotas (empty when none is configured): pages evicted to bring a tenant
    #: down to its budget, per tenant; and pages per tenant per tier ("device", "host")
    quota_evictions: Mapping[str, int] = field(default_factory=dict)
    #: quota evictions of tenants folded out of ``quota_evictions`` (past 1,024 names, those
    #: that hold no page and have no quota of their own: names come from requests)
    quota_evictions_folded: int = 0
    tenant_pages: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
