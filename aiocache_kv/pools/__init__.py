"""Paged KV buffers of the device and host tiers, and their page allocators."""

from aiocache_kv.pools.admission import admit_host_bytes, available_host_bytes
from aiocache_kv.pools.allocator import PageAllocator, PageState, has_duplicates
from aiocache_kv.pools.kv_pool import DeviceKVPool, HostKVPool, host_slot_bytes

__all__ = [
    "DeviceKVPool",
    "HostKVPool",
    "PageAllocator",
    "PageState",
    "admit_host_bytes",
    "available_host_bytes",
    "has_duplicates",
    "host_slot_bytes",
]
