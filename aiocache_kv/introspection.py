"""What the cache reports about itself: statistics snapshots and the invariant check."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from aiocache_kv.blocks import BlockInfo
from aiocache_kv.core import CacheCore
from aiocache_kv.events.kv_events import BlockStored, namespace_fields
from aiocache_kv.pools import PageAllocator, PageState
from aiocache_kv.stats import CacheStatistics, StorageCounters, TierStatistics
from aiocache_kv.storage.stored_pages import StoredRun
from aiocache_kv.storage.tier import StorageTier
from aiocache_kv.transfer.ops import Transfers
from aiocache_kv.tree import Tier
from aiocache_kv.tree.node import RESIDENT, Node


def _tier(alloc: PageAllocator | None, evictable: int, protected: int) -> TierStatistics:
    if alloc is None:
        return TierStatistics(0, 0, 0, 0, 0)
    return TierStatistics(
        alloc.num_pages,
        alloc.num_free,
        alloc.count(PageState.HELD),
        evictable,
        protected,
        alloc.quarantined,
        alloc.retained,
    )


def _quota_fields(core: CacheCore) -> dict[str, Any]:
    book = core.tree.tenants
    if book is None:
        return {}
    return {
        "quota_evictions": dict(book.evictions),
        "quota_evictions_folded": book.evictions_folded,
        "tenant_pages": {t: book.pages(t) for t in book.usage},
    }


def snapshot(core: CacheCore, transfers: Transfers, l3: StorageTier | None) -> CacheStatistics:
    """A frozen snapshot of sizes, hits and operations in flight (on the loop)."""
    tree = core.tree
    return CacheStatistics(
        device=_tier(core.dev_alloc, tree.dev_evictable, tree.dev_protected),
        host=_tier(core.host_alloc, tree.host_evictable, tree.host_protected),
        nodes=tree.num_nodes,
        namespaces=sum(1 for _ in tree.roots()),
        ops_in_flight=len(transfers.inflight),
        events_published=core.events.published,
        events_pending=core.events.pending,
        events_dropped=core.events.dropped,
        latency=core.latencies.snapshot(),
        storage_in_flight=l3.in_flight if l3 is not None else 0,
        storage_calls_running=l3.io.io_statistics().in_flight if l3 is not None else 0,
        prefetch_reserved_pages=l3.reserved_pages if l3 is not None else 0,
        **_quota_fields(core),
        active_pins=len(core.hard_pins),
        pinned_pages_device=core.hard_pins.pinned_pages(Tier.DEVICE),
        pinned_pages_host=core.hard_pins.pinned_pages(Tier.HOST),
        **dataclasses.asdict(core.hard_pins.counters),
        **dataclasses.asdict(core.counters),
        **dataclasses.asdict(l3.counters if l3 is not None else StorageCounters()),
    )


def check_all(
    core: CacheCore,
    pinned: list[Node],
    transfers: Transfers,
    l3: StorageTier | None,
    retained: list[np.ndarray] | None = None,
) -> None:
    """Recompute every counter and cross-check tree, allocators, pins, the device rows insert
    results retain (``retained``: one id array per live result) and transfers.

    Raises:
        AssertionError: naming the broken invariant.
    """
    handle_pins: dict[int, int] = {}
    for node in pinned:  # one entry per live handle
        handle_pins[id(node)] = handle_pins.get(id(node), 0) + 1
        assert node.alive or core.tree.is_detached(node), f"a handle pins a removed {node!r}"
    for anchor in l3.anchors() if l3 is not None else []:
        assert anchor.alive or core.tree.is_detached(anchor), f"prefetch pins gone {anchor!r}"
        handle_pins[id(anchor)] = handle_pins.get(id(anchor), 0) + 1
    hard = core.hard_pins
    hard.check_invariants()
    for node in hard.nodes(Tier.DEVICE):  # a device hard pin is a tree pin, like a handle's
        handle_pins[id(node)] = handle_pins.get(id(node), 0) + 1
    host_pins: dict[int, int] = {}
    for node in hard.nodes(Tier.HOST):
        host_pins[id(node)] = host_pins.get(id(node), 0) + 1
    core.tree.check_invariants(handle_pins, host_pins)
    hook = core.capacity_hook()
    assert core.tree.on_unpinned == hook, f"unpin hook {core.tree.on_unpinned} != {hook}"
    assert core.dev_alloc is None or core.dev_alloc.on_free == hook, "free hook != unpin hook"
    if core.dev_alloc is not None:
        core.dev_alloc.check_invariants(core.tree.device_pages_in_tree(), retained)
    if core.host_alloc is not None:
        reserved = list(l3.reserved.values()) if l3 is not None else []
        core.host_alloc.check_invariants(core.tree.host_pages_in_tree() + reserved)
    transfers.check_invariants()


def describe(core: CacheCore, transfers: Transfers, state: str) -> str:
    """A one-line ``repr`` of a cache: sizes per tier and copies in flight."""
    dev, host = core.dev_alloc, core.host_alloc
    if dev is None:
        return f"<HiCache {state}>"
    t = core.tree
    return (
        f"<HiCache {state} nodes={t.num_nodes} "
        f"device={dev.num_pages - dev.num_free}/{dev.num_pages} "
        f"(evictable={t.dev_evictable} protected={t.dev_protected}) "
        f"host={t.host_evictable + t.host_protected}/{host.num_pages if host else 0} "
        f"(evictable={t.host_evictable} protected={t.host_protected}) "
        f"in_flight={len(transfers.inflight)}>"
    )


def snapshot_events(
    core: CacheCore, l3: StorageTier | None, *, closed: bool = False
) -> list[BlockStored]:
    """What a consumer of the event stream holds, as ``BlockStored`` events: one per node and
    medium it is resident in, parents before children (a host copy not yet announced on CPU
    is left out, as in the stream), then the STORAGE events in the order of their first
    page's place in its sequence (so a parent's page comes before its children's): one per
    storage-resident node, and the pages still claimed in storage that no such node holds
    (pages of nodes that left the tree; the rest of a node that lost one of its pages).
    ``closed``: the cache closed, announcing its device and host pages removed: storage only.
    """
    tree = core.tree
    p = core.page_size
    out: list[BlockStored] = []
    storage: list[tuple[int, BlockStored]] = []  # (pages before it, event)
    covered: set[bytes] = set()  # the pages of the storage-resident nodes
    starts: dict[int, int] = {}  # id(node) -> pages before its first
    for node in tree.walk():
        parent = node.parent  # before it in the walk (a root: no pages, no entry)
        assert parent is not None
        start = starts[id(node)] = starts.get(id(parent), 0) + len(parent.key) // p
        for tier, state in ((Tier.DEVICE, node.device), (Tier.HOST, node.host)):
            if state is RESIDENT and not closed and not (tier is Tier.HOST and node.cpu_hidden):
                out.append(_stored(core, node, tier))
        if node.storage is RESIDENT:
            storage.append((start, _stored(core, node, Tier.STORAGE)))
            covered.update(tree.block_hashes(node))
    if l3 is not None:
        storage += _claimed_elsewhere(p, l3.storage_claims(), covered)
    storage.sort(key=lambda item: item[0])
    return out + [event for _, event in storage]


def _claimed_elsewhere(
    p: int, claims: list[tuple[StoredRun, list[int]]], covered: set[bytes]
) -> list[tuple[int, BlockStored]]:
    """The storage claims outside ``covered``: one event per run of consecutive pages of one
    remembered run, with the pages before its first in its sequence."""
    found: list[tuple[int, BlockStored]] = []
    for run, held in claims:
        pages = sorted(i for i in held if run.hashes[i] not in covered)
        at = 0
        while at < len(pages):
            a = b = pages[at]
            while at + 1 < len(pages) and pages[at + 1] == b + 1:
                at += 1
                b += 1
            at += 1
            event = BlockStored(
                block_hashes=list(run.hashes[a : b + 1]),
                parent_block_hash=run.parent if a == 0 else run.hashes[a - 1],
                token_ids=list(run.tokens[a * p : (b + 1) * p]),
                block_size=p,
                medium=Tier.STORAGE.medium,
                **namespace_fields(run.ns),
            )
            found.append((run.start + a, event))
    return found


def _stored(core: CacheCore, node: Node, tier: Tier) -> BlockStored:
    tree = core.tree
    return BlockStored(
        block_hashes=list(tree.block_hashes(node)),
        parent_block_hash=tree.parent_hash(node),
        token_ids=list(node.key),
        block_size=core.page_size,
        medium=tier.medium,
        **namespace_fields(node.ns),
    )


def blocks(core: CacheCore) -> list[BlockInfo]:
    """Every cached page, parents before children, with the tiers it is resident in."""
    tree = core.tree
    p = core.page_size
    out: list[BlockInfo] = []
    for node in tree.walk():
        tiers = tuple(
            t.medium
            for t, state in (
                (Tier.DEVICE, node.device),
                (Tier.HOST, node.host),
                (Tier.STORAGE, node.storage),
            )
            if state is RESIDENT
        )
        parent = tree.parent_hash(node)
        for i, h in enumerate(tree.block_hashes(node)):
            out.append(
                BlockInfo(
                    block_hash=h,
                    parent_block_hash=parent,
                    token_ids=tuple(node.key[i * p : (i + 1) * p]),
                    tiers=tiers,
                    lora_name=node.ns.lora or None,
                    namespace_tag=node.ns.tag,
                )
            )
            parent = h
    return out


__all__ = ["blocks", "check_all", "describe", "snapshot", "snapshot_events"]
