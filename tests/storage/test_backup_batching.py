"""Backups queued behind busy storage workers are sent together, sized by bytes.

The tier keeps at most ``storage_workers`` backup puts in flight; write acks that arrive
meanwhile queue up and go out as one put of up to ``BACKUP_BATCH_BYTES`` (at least one op a
put).  Each op still gets its own per-page verdicts, and a queued op whose deadline passed
fails without being sent (its lease ends at once).
"""

from __future__ import annotations

import asyncio
import threading

import anyio
import pytest

import aiocache_kv as akv
from aiocache_kv.storage import tier
from aiocache_kv.testing import MemoryStorage
from aiocache_kv.testing.fake_mooncake import FakeMooncakeClient, FakeMooncakeStorage
from aiocache_kv.tree import TierState
from tests.conftest import small_config
from tests.test_split_ack import insert

PROMPTS = [[base + i for i in range(6)] for base in (100, 200, 300, 400)]  # 3 pages each


def config(store: FakeMooncakeStorage, **kw: object) -> akv.CacheConfig:
    return small_config(storage=store, storage_workers=1, storage_retry_seconds=0.0, **kw)


async def entered(client: FakeMooncakeClient) -> None:
    assert await asyncio.to_thread(client.entered["batch_put_from"].wait, 10)


def storage_state(cache: akv.HiCache, tokens: list[int]) -> TierState:
    """The storage state of the node holding ``tokens`` (no match: a hit would back it up)."""
    (node,) = [n for n in cache._tree.walk() if n.key and n.key[0] == tokens[0]]
    return node.storage


@pytest.mark.parametrize("limit", [None, 1])
async def test_queued_backups_share_a_put_and_keep_their_own_verdicts(
    limit: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if limit is not None:  # every op alone: one put per op, as before batching
        monkeypatch.setattr(tier, "BACKUP_BATCH_BYTES", limit)
    client = FakeMooncakeClient()
    client.gates["batch_put_from"].clear()
    store = FakeMooncakeStorage(client)
    async with akv.HiCache(config(store)) as cache:
        handles = [insert(cache, PROMPTS[0], seed=1)]
        await entered(client)  # the only worker is busy with the first backup
        handles += [insert(cache, p, seed=k + 2) for k, p in enumerate(PROMPTS[1:])]
        await asyncio.sleep(0.05)
        assert len(client.put_calls) == 1  # the others wait for the worker, unsent
        # the page in the middle of the third prompt fails, whichever put carries it
        codes = [[0] * 3] + ([[0] * 9] if limit is None else [[0] * 3, [0] * 3, [0] * 3])
        codes[-2 if limit is not None else 1][4 if limit is None else 1] = -1
        client.put_codes = codes
        client.gates["batch_put_from"].set()
        await cache.flush()
        calls = [len(keys) for keys in client.put_calls]
        assert calls == ([3, 3, 3, 3] if limit == 1 else [3, 9])
        stats = cache.statistics()
        assert (stats.backup_pages_ok, stats.backup_pages_failed) == (9, 3)
        states = [storage_state(cache, p) for p in PROMPTS]
        ok, absent = TierState.RESIDENT, TierState.ABSENT
        assert states == [ok, ok, absent, ok]
        for h in handles:
            cache.release(h)
        assert cache.statistics().host.quarantined_pages == 0
        cache.check_invariants()


async def test_queued_backups_are_batched_by_their_pages_bytes_trailers_aside(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two queued backups whose pages make exactly ``BACKUP_BATCH_BYTES`` share one put: the
    72-byte trailer of each page does not push the pair over (two 16 MiB backups of 1 MiB
    pages went out as two puts, each paying the per-call cost)."""
    client = FakeMooncakeClient()
    client.gates["batch_put_from"].clear()
    store = FakeMooncakeStorage(client)
    async with akv.HiCache(config(store)) as cache:
        pool = cache._core.host_pool
        assert pool is not None
        monkeypatch.setattr(tier, "BACKUP_BATCH_BYTES", 2 * 3 * pool.page_bytes)  # 2 prompts
        handles = [insert(cache, PROMPTS[0], seed=1)]
        await entered(client)  # the only worker is busy with the first backup
        handles += [insert(cache, p, seed=k + 2) for k, p in enumerate(PROMPTS[1:])]
        await asyncio.sleep(0.05)
        client.gates["batch_put_from"].set()
        await cache.flush()
        assert [len(keys) for keys in client.put_calls] == [3, 6, 3]
        assert cache.statistics().backup_pages_ok == 12
        for h in handles:
            cache.release(h)
        cache.check_invariants()


async def test_a_backup_queued_past_its_deadline_fails_unsent() -> None:
    client = FakeMooncakeClient()
    client.gates["batch_put_from"].clear()
    store = FakeMooncakeStorage(client)
    async with akv.HiCache(config(store, storage_timeout=0.3)) as cache:
        a = insert(cache, PROMPTS[0], seed=1)
        await entered(client)
        b = insert(cache, PROMPTS[1], seed=2)
        tier_ = cache._l3
        assert tier_ is not None
        for _ in range(500):  # until its write ack queued the backup behind the stuck worker
            if tier_._queued:
                break
            await asyncio.sleep(0.01)
        (queued,) = tier_._queued
        queued.deadline = asyncio.get_running_loop().time()  # due before the worker frees up
        await asyncio.sleep(0.8)  # the first put's deadline passes too, the worker stuck
        stats = cache.statistics()
        assert (stats.backup_pages_ok, stats.backup_pages_failed) == (0, 6)
        assert len(client.put_calls) == 1  # the queued one was never sent
        assert storage_state(cache, PROMPTS[1]) is TierState.ABSENT
        client.gates["batch_put_from"].set()
        await cache.flush()  # the late put returns: its pages are released, never a verdict
        assert cache.statistics().backup_pages_ok == 0
        assert len(client.put_calls) == 1  # and the expired one is never sent late
        for h in (a, b):
            cache.release(h)
        assert cache.statistics().host.quarantined_pages == 0
        cache.check_invariants()


class _TwoAtOnce(FakeMooncakeClient):
    """A fake client whose puts return only once two of them run at the same time."""

    def __init__(self, fail_pair: bool) -> None:
        super().__init__()
        self.both = threading.Barrier(2, timeout=10)
        self.threads: set[int] = set()
        self.fail_pair = fail_pair  # the put of two pages fails its second page

    def batch_put_from(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        self.threads.add(threading.get_ident())
        self.both.wait()
        codes: list[int] = super().batch_put_from(keys, ptrs, sizes)
        return [*codes[:1], -1] if self.fail_pair and len(keys) == 2 else codes


@pytest.mark.parametrize("fail", [False, True])
async def test_one_backup_is_spread_over_idle_workers(
    fail: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With two idle workers a 3-page backup goes out as two puts at once (consecutive
    slices); every page gets its verdict, and a failing slice fails the whole backup (as
    one put would), with every lease returned."""
    monkeypatch.setattr(tier, "BACKUP_PART_BYTES", 1)
    client = _TwoAtOnce(fail_pair=fail)
    store = FakeMooncakeStorage(client)
    cfg = small_config(storage=store, storage_workers=2, storage_retry_seconds=0.0)
    async with akv.HiCache(cfg) as cache:
        h = insert(cache, PROMPTS[0], seed=1)
        await cache.flush()
        assert sorted(len(keys) for keys in client.put_calls) == [1, 2]
        assert len(client.threads) == 2
        stats = cache.statistics()
        if not fail:
            assert (stats.backup_pages_ok, stats.backup_pages_failed) == (3, 0)
            assert storage_state(cache, PROMPTS[0]) is TierState.RESIDENT
        else:
            assert (stats.backup_pages_ok, stats.backup_pages_failed) == (0, 3)
            assert storage_state(cache, PROMPTS[0]) is TierState.ABSENT
        cache.release(h)
        assert cache.statistics().host.quarantined_pages == 0
        cache.check_invariants()


class _OneSliceHangs(FakeMooncakeClient):
    """A fake client whose put of one page waits at a gate; the other slice answers."""

    def __init__(self) -> None:
        super().__init__()
        self.hold = threading.Event()
        self.held = threading.Event()

    def batch_put_from(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        if len(keys) == 1:
            self.held.set()
            assert self.hold.wait(30), "never let go"
        codes: list[int] = super().batch_put_from(keys, ptrs, sizes)
        return codes


async def test_a_slice_past_its_deadline_fails_the_spread_backup_and_keeps_its_pages() -> None:
    """The slices of a spread backup go to the workers directly (no task).  One slice
    answers, the other hangs past the deadline: the backup fails as one put would, its
    host pages (the whole group's) stay leased while the hung worker may still read them, and
    come back once it returns; nothing is stored or claimed."""
    client = _OneSliceHangs()
    store = FakeMooncakeStorage(client)
    cfg = small_config(
        storage=store, storage_workers=2, storage_retry_seconds=0.0, storage_timeout=0.3
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tier, "BACKUP_PART_BYTES", 1)
        async with akv.HiCache(cfg) as cache:
            h = insert(cache, PROMPTS[0], seed=1)
            assert await asyncio.to_thread(client.held.wait, 10)
            await cache.flush()  # returns at the deadline, not when the worker does
            stats = cache.statistics()
            assert (stats.backup_pages_ok, stats.backup_pages_failed) == (0, 3)
            assert storage_state(cache, PROMPTS[0]) is TierState.ABSENT
            cache.release(h)
            cache.evict(1 << 20, "device")
            cache.evict(1 << 20, "host")  # what the hung worker reads is not handed out
            assert cache.statistics().host.quarantined_pages == 3  # the group's pages
            cache.check_invariants()
            client.hold.set()
            await cache.flush()
            for _ in range(100):  # the worker's return reaches the loop
                if cache.statistics().host.quarantined_pages == 0:
                    break
                await asyncio.sleep(0.01)
            assert cache.statistics().host.quarantined_pages == 0
            assert sorted(len(keys) for keys in client.put_calls) == [1, 2]
            cache.check_invariants()


async def test_a_hand_over_that_raises_falls_back_to_the_task_path() -> None:
    """A bug in the direct hand-over (``_send`` raising) must not orphan the group: taken
    off the queue and never sent, its backup would never land and ``flush`` (and closing
    the cache) would wait for it forever.  The task path puts it instead."""
    client = FakeMooncakeClient()
    store = FakeMooncakeStorage(client)
    calls: list[int] = []

    def broken(group: object, pages: object, parts: int) -> bool:
        calls.append(parts)
        raise RuntimeError("a bug in the hand-over")

    with anyio.fail_after(20):  # without the fallback: a hang, failed here
        async with akv.HiCache(config(store)) as cache:
            l3 = cache._l3
            assert l3 is not None
            l3._send = broken  # type: ignore[method-assign]
            h = insert(cache, PROMPTS[0], seed=1)
            await cache.flush()
            assert calls == [1]
            stats = cache.statistics()
            assert (stats.backup_pages_ok, stats.backup_pages_failed) == (3, 0)
            assert storage_state(cache, PROMPTS[0]) is TierState.RESIDENT
            cache.release(h)
            assert cache.statistics().host.quarantined_pages == 0
            cache.check_invariants()


@pytest.mark.parametrize("storage", [True, False])
async def test_page_hashes_are_taken_while_the_write_through_copies(storage: bool) -> None:
    """With a storage tier, the write-through's pages are hashed when the copy is queued
    (the copy runs meanwhile), so the backup its ack starts derives keys without hashing;
    the keys stored are the ones a reader computes.  Without one (and without KV events),
    an insert hashes nothing."""
    from aiocache_kv.bench.storage_paths import storage_keys
    from aiocache_kv.testing import ManualCopyEngine
    from aiocache_kv.tree import radix

    engine = ManualCopyEngine()
    client = FakeMooncakeClient()
    store = FakeMooncakeStorage(client) if storage else None
    cfg = small_config(storage=store, enable_kv_events=False)  # events would hash too
    async with akv.HiCache(cfg, copy_engine=engine) as cache:
        h = insert(cache, PROMPTS[0], seed=1)
        (node,) = [n for n in cache._tree.walk() if n.key and n.key[0] == PROMPTS[0][0]]
        assert (node.hashes is not None) is storage  # before the copy has run
        calls: list[object] = []
        real = radix.chain_hashes
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(radix, "chain_hashes", lambda *a: calls.append(a) or real(*a))
            while engine.pending:
                engine.complete()
            await cache.flush()
        assert calls == []  # the backup hashed nothing
        if storage:
            want = storage_keys(cfg, "", PROMPTS[0])
            assert sorted(client.objects) == sorted(want)
        cache.release(h)
        cache.check_invariants()


class _ShortAnswer(MemoryStorage):
    """A backend whose put answers one verdict fewer than it was given keys."""

    def put(self, keys, buffers, identities=None):  # type: ignore[no-untyped-def]
        return super().put(keys, buffers, identities)[:-1]


@pytest.mark.parametrize("workers", [1, 2])  # one put, or slices handed over directly
async def test_a_put_answering_too_few_verdicts_fails_the_backup(
    workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backend's answer of another length than its keys (a buggy custom backend) is a
    failed put: the backup fails whole (never a verdict given to the wrong page), nothing
    hangs and the cache stays consistent."""
    monkeypatch.setattr(tier, "BACKUP_PART_BYTES", 1)
    cfg = small_config(storage=_ShortAnswer(), storage_workers=workers, storage_retry_seconds=0.0)
    with anyio.fail_after(20):
        async with akv.HiCache(cfg) as cache:
            h = insert(cache, PROMPTS[0], seed=1)
            await cache.flush()
            stats = cache.statistics()
            assert (stats.backup_pages_ok, stats.backup_pages_failed) == (0, 3)
            assert storage_state(cache, PROMPTS[0]) is TierState.ABSENT
            cache.release(h)
            cache.check_invariants()
