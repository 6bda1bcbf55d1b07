"""The split-safe write-through ack (FAILURES.md: events lost when a node splits before ack)."""

from __future__ import annotations

import itertools

import torch

import aiocache_kv as akv
from aiocache_kv.testing import ManualCopyEngine
from aiocache_kv.tree import TierState
from tests.conftest import small_config


def write_kv(cache: akv.HiCache, slots: torch.Tensor, seed: int) -> list[torch.Tensor]:
    """Fill ``slots`` in every layer with seeded values; return them per layer (K then V)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for layer in range(cache.config.num_layers):
        k, v = cache.device_kv(layer)
        for buf in (k, v):
            vals = torch.randn((slots.numel(), *buf.shape[1:]), generator=g)
            buf[slots.to(buf.device)] = vals.to(buf.device)  # a CUDA pool too
            out.append(vals)
    return out


def insert(cache: akv.HiCache, tokens: list[int], seed: int = 0) -> akv.InsertResult:
    slots = cache.alloc(len(tokens))
    write_kv(cache, slots, seed)
    return cache.insert(tokens, slots)


def cpu_stored(events: list[akv.KVEvent]) -> list[akv.BlockStored]:
    return [e for e in events if isinstance(e, akv.BlockStored) and e.medium == "CPU"]


def node_at(cache: akv.HiCache, tokens: list[int]) -> akv.MatchResult:
    return cache.match_prefix(tokens)


async def test_split_before_ack_publishes_every_fragment(engine: ManualCopyEngine) -> None:
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        r1 = insert(cache, [1, 2, 3, 4], seed=1)
        assert r1.write_through is not None and not r1.write_through.done()
        r2 = insert(cache, [1, 2, 5, 6], seed=2)  # splits [1,2,3,4] before its ack
        assert cpu_stored(cache.take_events()) == []  # no CPU event before any ack
        cache.check_invariants()
        await_task = r1.write_through
        engine.complete_all()
        await cache.flush()
        await await_task
        events = cpu_stored(cache.take_events())
        first = [e for e in events if e.token_ids in ([1, 2], [3, 4])]
        assert [e.token_ids for e in first] == [[1, 2], [3, 4]]
        assert first[0].parent_block_hash is None
        assert first[1].parent_block_hash == first[0].block_hashes[-1]
        # the second insert's own page hangs off the first fragment too
        (second,) = [e for e in events if e.token_ids == [5, 6]]
        assert second.parent_block_hash == first[0].block_hashes[-1]
        cache.check_invariants()
        # both fragments are host-resident and unpinned by the ack (only handles pin them)
        cache.release(r1)
        cache.release(r2)
        for node in cache._tree.walk():
            assert node.host is TierState.RESIDENT
            assert node.pins == 0
        assert cache.statistics().device.protected_pages == 0
        # every fragment is really on host: evict device and read back from host
        assert cache.evict(100) == 3
        m = cache.match_prefix([1, 2, 3, 4])
        assert (m.device_len, m.host_len) == (0, 4)
        cache.release(m)


async def test_device_pin_held_until_ack(engine: ManualCopyEngine) -> None:
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        r = insert(cache, [1, 2, 3, 4])
        cache.release(r)
        # unpinned, but the write-through is pending: the device copy cannot be evicted
        assert cache.statistics().device.protected_pages == 2
        assert cache.evict(100) == 0
        engine.complete_all()
        await cache.flush()
        assert cache.statistics().device.evictable_pages == 2
        assert cache.evict(100) == 2
        cache.check_invariants()


async def test_nested_splits_before_ack(engine: ManualCopyEngine) -> None:
    # 32 pages: each unreleased result retains its own copies of the shared prefix
    async with akv.HiCache(small_config(page_size=1, device_pages=32), copy_engine=engine) as cache:
        r1 = insert(cache, [1, 2, 3, 4, 5, 6])
        r2 = insert(cache, [1, 2, 3, 4, 9])  # split at 4
        r3 = insert(cache, [1, 2, 8])  # split the head fragment again at 2
        r4 = insert(cache, [1, 2, 3, 4, 5, 7])  # split the tail fragment at 5
        cache.check_invariants()
        assert cpu_stored(cache.take_events()) == []
        first_op = engine.pending[0]
        assert first_op is not None
        engine.complete(0)  # the first insert's ack only
        events = cpu_stored(cache.take_events())
        assert [e.token_ids for e in events] == [[1, 2], [3, 4], [5], [6]]
        for a, b in itertools.pairwise(events):
            assert b.parent_block_hash == a.block_hashes[-1]
        engine.complete_all()
        await cache.flush()
        rest = sorted(e.token_ids for e in cpu_stored(cache.take_events()))
        assert rest == [[7], [8], [9]]
        for r in (r1, r2, r3, r4):
            cache.release(r)
        for node in cache._tree.walk():
            assert node.host is TierState.RESIDENT and node.op is None
        cache.check_invariants()


async def test_several_pending_acks_complete_out_of_order(engine: ManualCopyEngine) -> None:
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        rs = [insert(cache, [1, 2, 3, 4]), insert(cache, [1, 2, 3, 4, 5, 6])]
        rs.append(insert(cache, [1, 2, 7, 8]))
        assert len(engine.pending) == 3
        engine.complete(2)
        engine.complete(0)
        cache.check_invariants()
        engine.complete(0)
        await cache.flush()
        events = cpu_stored(cache.take_events())
        assert sorted(e.token_ids for e in events) == [[1, 2], [3, 4], [5, 6], [7, 8]]
        by_tokens = {tuple(e.token_ids): e for e in events}
        assert by_tokens[(3, 4)].parent_block_hash == by_tokens[(1, 2)].block_hashes[-1]
        assert by_tokens[(7, 8)].parent_block_hash == by_tokens[(1, 2)].block_hashes[-1]
        assert by_tokens[(5, 6)].parent_block_hash == by_tokens[(3, 4)].block_hashes[-1]
        for r in rs:
            cache.release(r)
        cache.check_invariants()


async def test_failed_ack_rolls_back_every_fragment(engine: ManualCopyEngine) -> None:
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        r1 = insert(cache, [1, 2, 3, 4])
        r2 = insert(cache, [1, 2, 5, 6])
        engine.fail(0)
        cache.check_invariants()
        assert r1.write_through is not None
        try:
            await r1.write_through
        except akv.TransferError:
            pass
        else:  # pragma: no cover - the assertion below explains
            raise AssertionError("a failed write-through must not be reported as success")
        stats = cache.statistics()
        assert stats.write_through_failed == 1
        # the fragments of the failed insert are device-only again; nothing half-committed
        m = cache.match_prefix([1, 2, 3, 4])
        assert m.device_len == 4
        assert [n.host for n in cache._tree.path(m.node)] == [TierState.ABSENT] * 2
        engine.complete_all()
        await cache.flush()
        for h in (r1, r2, m):
            cache.release(h)
        cache.check_invariants()


def cpu_view_is_a_tree(events: list[akv.KVEvent]) -> set[int]:
    """Replay the CPU events as a consumer would; assert every stored block's parent is
    known on CPU and every removed block was stored.  The CPU hashes at the end."""
    known: set[int] = set()
    for e in events:
        if isinstance(e, akv.BlockStored) and e.medium == "CPU":
            parent = e.parent_block_hash
            assert parent is None or parent in known, f"CPU parent {parent} never stored: {e}"
            known |= set(e.block_hashes)
        elif isinstance(e, akv.BlockRemoved) and e.medium == "CPU":
            assert set(e.block_hashes) <= known, f"CPU removal of unknown blocks: {e}"
            known -= set(e.block_hashes)
    return known


async def test_cpu_child_of_a_failed_parent_is_not_announced(engine: ManualCopyEngine) -> None:
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        r1 = insert(cache, [1, 2, 3, 4])
        r2 = insert(cache, [1, 2, 3, 4, 5, 6])  # its copy covers only [5, 6]
        engine.fail(0)  # the parent's write-through fails
        engine.complete(0)  # the child's lands: host-resident below a device-only parent
        await cache.flush()
        events = cache.take_events()
        assert cpu_stored(events) == []  # naming the parent would name a block not on CPU
        for r in (r1, r2):
            cache.release(r)
        cache.check_invariants()
    events += cache.take_events()  # close: BlockRemoved for what each medium held
    assert cpu_view_is_a_tree(events) == set()


async def test_cpu_child_landing_first_is_announced_after_its_parent(
    engine: ManualCopyEngine,
) -> None:
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        r1 = insert(cache, [1, 2, 3, 4])
        r2 = insert(cache, [1, 2, 3, 4, 5, 6])
        engine.complete(1)  # the child lands first: held back
        assert cpu_stored(cache.take_events()) == []
        engine.complete(0)  # then the parent: both announced, parent first
        await cache.flush()
        events = cache.take_events()
        assert [e.token_ids for e in cpu_stored(events)] == [[1, 2, 3, 4], [5, 6]]
        known = cpu_view_is_a_tree(events)
        assert len(known) == 3
        for r in (r1, r2):
            cache.release(r)
        cache.check_invariants()
