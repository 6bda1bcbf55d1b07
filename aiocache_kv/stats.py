"""Frozen snapshots of the cache's counters."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TierStatistics:
    """Page counts of one tier."""

    total_pages: int
    free_pages: int
    held_pages: int  #: handed out by ``alloc`` and not yet inserted or freed
    evictable_pages: int
    protected_pages: int  #: pinned or in flight


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
