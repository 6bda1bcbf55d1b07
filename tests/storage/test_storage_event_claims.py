"""A consumer of the STORAGE events holds exactly what the cache claims, each block once.

(A page a prefetch finds missing or corrupt is published as removed whether or not this
stream stored it: a consumer that kept its index across a restart learns the store lost it;
see ``test_chain_eviction.py``.)

Found by an adversarial round, each a sequence a consumer keeping a set per medium (or
counting stores against removals) got wrong:

* two drops that overlapped retracted the same pages twice;
* after a prefetch retracted a page whose second node (same tokens, left the tree, not yet
  collected) still held its claim, ``snapshot_events()`` kept announcing it for good;
* the backup of tokens recomputed after their node left the tree announced pages whose
  claims lived on: ``BlockStored(STORAGE)`` twice with no removal between.
"""

from __future__ import annotations

import asyncio
import gc

import aiocache_kv as akv
from aiocache_kv.events import BlockRemoved, BlockStored, KVEvent
from aiocache_kv.testing import ManualCopyEngine, MemoryStorage
from tests.conftest import small_config

TOKS = [1, 2, 3, 4]


class StorageView:
    """What a consumer of the STORAGE events holds; every store and removal checked."""

    def __init__(self) -> None:
        self.held: set[bytes] = set()

    def apply(self, events: list[KVEvent]) -> None:
        for e in events:
            if not isinstance(e, (BlockStored, BlockRemoved)) or e.medium != "STORAGE":
                continue
            for h in e.block_hashes:
                if isinstance(e, BlockStored):
                    assert h not in self.held, f"stored twice, no removal between: {h.hex()}"
                    self.held.add(h)
                else:
                    assert h in self.held, f"removed, never stored (or removed twice): {h.hex()}"
                    self.held.discard(h)


def claimed(cache: akv.HiCache) -> set[bytes]:
    return {
        h
        for e in cache.snapshot_events()
        if isinstance(e, BlockStored) and e.medium == "STORAGE"
        for h in e.block_hashes
    }


async def back_up(cache: akv.HiCache, engine: ManualCopyEngine) -> None:
    r = cache.insert(TOKS, cache.alloc(len(TOKS)))
    engine.complete_all()
    await asyncio.wait_for(cache.flush(), 10)
    cache.release(r)


def evict_all(cache: akv.HiCache) -> None:
    cache.evict(1 << 30, "device")
    cache.evict(1 << 30, "host")


async def test_two_overlapping_drops_retract_a_page_once() -> None:
    store = MemoryStorage()
    engine = ManualCopyEngine()
    view = StorageView()
    async with akv.HiCache(small_config(storage=store), copy_engine=engine) as cache:
        await back_up(cache, engine)
        view.apply(cache.take_events())
        store.gates["remove_tag"].clear()  # the first drop's removal is slow
        first = asyncio.create_task(cache.drop(tiers=("device", "host", "storage")))
        await asyncio.sleep(0.05)
        second = asyncio.create_task(cache.drop(tiers=("storage",)))
        await asyncio.sleep(0.05)
        store.gates["remove_tag"].set()
        await asyncio.wait_for(asyncio.gather(first, second), 10)
        view.apply(cache.take_events())
        assert view.held == claimed(cache) == set()
        cache.check_invariants()


async def test_a_retracted_page_leaves_the_snapshot_too() -> None:
    store = MemoryStorage()
    engine = ManualCopyEngine()
    cfg = small_config(storage=store, prefetch_threshold_tokens=0)
    h2 = akv.page_hashes(TOKS, page_size=2, model=cfg.namespace)[1]
    view = StorageView()
    async with akv.HiCache(cfg, copy_engine=engine) as cache:
        await back_up(cache, engine)
        evict_all(cache)
        gc.collect()  # the first node is gone: its claims are orphaned
        await back_up(cache, engine)  # the same tokens again, backed up again
        keep = cache.match_prefix(TOKS)
        cache.release(keep)  # a released handle the caller still holds keeps the node
        evict_all(cache)
        store.drop(next(k for k in store.contents() if h2.hex() in k))  # the store loses it
        await cache.prefetch(TOKS, policy="wait_complete")
        view.apply(cache.take_events())
        assert h2 not in view.held and view.held == claimed(cache)
        del keep
        gc.collect()
        assert view.held == claimed(cache)
        cache.check_invariants()


async def test_a_recomputed_node_extending_a_claimed_run_announces_only_its_new_pages() -> None:
    """The first page's claim outlived its node; the recomputed two-page node announces the
    second page alone, its parent the claimed first (before: both, the first a second time)."""
    engine = ManualCopyEngine()
    cfg = small_config(storage=MemoryStorage())
    h1, h2 = akv.page_hashes(TOKS, page_size=2, model=cfg.namespace)
    view = StorageView()
    async with akv.HiCache(cfg, copy_engine=engine) as cache:
        r = cache.insert(TOKS[:2], cache.alloc(2))
        engine.complete_all()
        await asyncio.wait_for(cache.flush(), 10)
        cache.release(r)
        view.apply(cache.take_events())
        assert view.held == {h1}
        evict_all(cache)
        await back_up(cache, engine)  # one page more: a fresh node of both pages
        events = cache.take_events()
        stored = [e for e in events if isinstance(e, BlockStored) and e.medium == "STORAGE"]
        assert [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in stored] == [
            ([h2], h1, TOKS[2:])
        ]
        view.apply(events)
        assert view.held == {h1, h2} == claimed(cache)
        cache.check_invariants()


async def test_a_fetched_node_partly_claimed_announces_only_the_rest() -> None:
    """A prefetch commits three pages of which this stream claims the first (its own backup,
    whose node left the tree); another node stored the others: they are announced once."""
    store = MemoryStorage()
    cfg = small_config(storage=store, prefetch_threshold_tokens=0)
    toks = [*TOKS, 5, 6]
    h1, h2, h3 = akv.page_hashes(toks, page_size=2, model=cfg.namespace)
    async with akv.HiCache(cfg) as other:  # another node stores the whole prompt
        other.release(other.insert(toks, other.alloc(len(toks))))
        await asyncio.wait_for(other.flush(), 10)
    view = StorageView()
    async with akv.HiCache(cfg) as cache:
        cache.release(cache.insert(toks[:2], cache.alloc(2)))
        await asyncio.wait_for(cache.flush(), 10)
        evict_all(cache)
        view.apply(cache.take_events())
        assert view.held == {h1}
        res = await cache.prefetch(toks, policy="wait_complete")
        assert res.hit_tokens == len(toks)
        events = cache.take_events()
        stored = [e for e in events if isinstance(e, BlockStored) and e.medium == "STORAGE"]
        assert [(e.block_hashes, e.parent_block_hash) for e in stored] == [([h2, h3], h1)]
        view.apply(events)
        assert view.held == {h1, h2, h3} == claimed(cache)
        cache.check_invariants()


async def test_a_claim_records_where_its_pages_sit_in_their_sequence() -> None:
    """Each remembered run of stored pages records how many pages precede it in its
    sequence (what orders a snapshot's claims): a node's own offset, and for the head a
    later split makes, the head's; the tree keeps each node's offset (``Node.start``)
    instead of summing its path on every landed backup."""
    engine = ManualCopyEngine()
    toks = list(range(1, 13))  # 6 pages of 2
    async with akv.HiCache(small_config(storage=MemoryStorage()), copy_engine=engine) as cache:
        handles = []
        for end in (4, 8, 12):  # a chain of three nodes, backed up one by one
            handles.append(cache.insert(toks[:end], cache.alloc(end)))
            engine.complete_all()
            await asyncio.wait_for(cache.flush(), 10)
        hashes = akv.page_hashes(toks, page_size=2, model=cache.config.namespace)
        l3 = cache._l3
        assert l3 is not None
        starts = {run.hashes[0]: run.start for run, _ in l3.storage_claims()}
        assert starts == {hashes[0]: 0, hashes[2]: 2, hashes[4]: 4}
        cache.release(handles.pop())
        # a match ending inside the last node splits it: the head is remembered on its own
        split = cache.insert(toks[:10], cache.alloc(10))
        runs = [(run.hashes, run.start) for run, _ in l3.storage_claims()]
        assert ([hashes[4]], 4) in runs  # the head: one page, four before it
        cache.release(split)
        for h in handles:
            cache.release(h)
        cache.check_invariants()
