"""Mooncake prefetches read ahead of, or instead of, their existence check.

``MooncakeStorage.read_ahead``: a read of a missing key costs what asking costs, so the tier
starts reading the whole run at once (one pool, one rank, two workers).  Where every page
asked for is reserved, the reads are the check: the first page that does not read intact
ends the run, no batch past it starts, and ``batch_is_exist`` runs only for the pages past a
short run whose claims must be judged.  Otherwise the check runs beside the reads (see
``test_prefetch_reservation.py``).
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Sequence

import pytest

import aiocache_kv as akv
from aiocache_kv.storage.prefetch import PrefetchResult, PrefetchStatus
from aiocache_kv.testing.fake_mooncake import FakeMooncakeClient, FakeMooncakeStorage
from tests.conftest import small_config
from tests.test_split_ack import insert

PROMPT = list(range(500, 516))  # 8 pages of 2 tokens


def config(store: FakeMooncakeStorage, **kw: object) -> akv.CacheConfig:
    opts: dict[str, object] = dict(
        storage=store,
        storage_workers=2,
        storage_retry_seconds=0.0,
        prefetch_policy="wait_complete",
        prefetch_threshold_tokens=0,
        prefetch_batch_pages=2,
    )
    opts.update(kw)
    return small_config(**opts)


async def stored_cold(cache: akv.HiCache, client: FakeMooncakeClient) -> list[str]:
    """Back PROMPT up, empty the tree; returns its 8 KV keys in page order."""
    cache.release(insert(cache, PROMPT, seed=3))
    await cache.flush()
    (keys,) = client.put_calls
    assert len(keys) == 8
    cache.evict(1 << 30)
    cache.evict(1 << 30, "host")
    m = cache.match_prefix(PROMPT)
    assert m.matched_len == 0
    cache.release(m)
    client.log.clear()
    return keys


def got_keys(client: FakeMooncakeClient) -> list[str]:
    return [k for name, keys in client.log if name == "batch_get_into" for k in keys]


async def host_hit_and_nothing_held(cache: akv.HiCache, host_len: int) -> None:
    """The prompt's first ``host_len`` tokens are on host; once flushed, no page is still
    quarantined for a read, and the invariants hold."""
    m = cache.match_prefix(PROMPT)
    assert m.host_len == host_len
    cache.release(m)
    await cache.flush()
    assert cache.statistics().host.quarantined_pages == 0
    cache.check_invariants()


async def until(cond: object, what: str) -> None:
    for _ in range(1000):
        if callable(cond) and cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


class HoldingClient(FakeMooncakeClient):
    """Holds a read whose first key is in ``holds`` until its event is set; records the
    first key of every read that started."""

    def __init__(self) -> None:
        super().__init__()
        self.holds: dict[str, threading.Event] = {}
        self.started: list[str] = []

    def batch_get_into(
        self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        with self.lock:
            self.started.append(keys[0])
        hold = self.holds.get(keys[0])
        if hold is not None:
            assert hold.wait(30), "hold never released"
        return super().batch_get_into(keys, ptrs, sizes)


async def miss_at_3_holding(
    cache: akv.HiCache, client: HoldingClient, *held: int
) -> tuple[list[str], list[threading.Event], asyncio.Future[PrefetchResult]]:
    """PROMPT stored cold, page 3 dropped from the store, the reads of the batches that
    start at pages ``held`` held; a prefetch started.  Returns the keys, the holds' events
    and the prefetch."""
    keys = await stored_cold(cache, client)
    del client.objects[keys[3]]
    client.started.clear()
    events = [threading.Event() for _ in held]
    client.holds.update({keys[page]: e for page, e in zip(held, events, strict=True)})
    return keys, events, asyncio.ensure_future(cache.prefetch(PROMPT))


async def test_with_every_page_reserved_the_reads_are_the_check() -> None:
    """Every page fits the reservation: no existence check at all, the reads answer it;
    every page is committed and counted as a storage hit."""
    client = FakeMooncakeClient()
    store = FakeMooncakeStorage(client)
    async with akv.HiCache(config(store)) as cache:
        keys = await stored_cold(cache, client)
        before = cache.statistics().prefetch_storage_hit_tokens
        res = await cache.prefetch(PROMPT)
        assert res.status is PrefetchStatus.COMPLETE
        assert (res.storage_hit_tokens, res.hit_tokens) == (len(PROMPT), len(PROMPT))
        assert cache.statistics().prefetch_storage_hit_tokens - before == len(PROMPT)
        assert client.calls["batch_is_exist"] == 0
        assert sorted(got_keys(client)) == sorted(keys)
        await host_hit_and_nothing_held(cache, len(PROMPT))


async def test_a_missing_page_ends_the_run_and_no_batch_past_it_starts() -> None:
    """Page 3 is missing; 2-page batches, two workers taking them in turn.  One worker is
    held inside the read of pages 0-1; the other reads 2-3 (the miss), then stops, or takes
    4-5 (held too) if it got there before the miss's report reached the loop.  Once the
    report is in, no batch past the run starts (pages 6-7 are never read: without the stop
    one worker would take them), and exactly the run 0-2 is committed.  The
    pages past the run were claimed (the node that stored them left the tree): one
    existence check of those pages alone judges the claims."""
    client = HoldingClient()
    store = FakeMooncakeStorage(client)
    async with akv.HiCache(config(store)) as cache:
        keys, (first, past), task = await miss_at_3_holding(cache, client, 0, 4)
        await until(lambda: {keys[0], keys[2]} <= set(client.started), "reads")
        for _ in range(50):  # the miss's report reaches the loop
            await asyncio.sleep(0.002)
        assert client.started[-1] in (keys[2], keys[4])
        first.set()
        past.set()
        res = await task
        assert (res.status, res.storage_hit_tokens, res.hit_tokens) == (
            PrefetchStatus.COMPLETE,
            6,
            6,
        )
        assert keys[6] not in client.started
        assert [k for name, k in client.log if name == "batch_is_exist"] == [keys[3:]]
        assert all(k in client.objects for k in keys[4:])  # nobody took them for vanished
        await host_hit_and_nothing_held(cache, 6)


async def test_the_wait_ends_when_the_run_is_in_not_when_every_worker_returned() -> None:
    """Page 3 is missing.  One worker reads pages 0-1 and takes 4-5, whose read hangs; the
    other's read of 2-3 (the miss) is held until then.  Once 2-3 is reported, every batch
    of the run is in: the prefetch returns with pages 0-2 while the read past the run still
    hangs, and that read's 2 pages stay quarantined until it returns."""
    client = HoldingClient()
    store = FakeMooncakeStorage(client)
    async with akv.HiCache(config(store, storage_timeout=30.0)) as cache:
        keys, (miss, past), task = await miss_at_3_holding(cache, client, 2, 4)
        try:
            await until(lambda: keys[4] in client.started, "the read past the run")
            miss.set()
            res = await asyncio.wait_for(task, 5)
            assert (res.status, res.hit_tokens) == (PrefetchStatus.COMPLETE, 6)
            assert cache.statistics().host.quarantined_pages == 2
        finally:
            miss.set()
            past.set()
        await host_hit_and_nothing_held(cache, 6)


async def test_a_page_read_intact_past_a_corrupt_one_is_never_committed() -> None:
    """Page 3 is corrupt: its read drops it from the store and ends the run, while pages
    after it may be read intact meanwhile; only the run 0-2 is committed and counted."""
    client = FakeMooncakeClient()
    store = FakeMooncakeStorage(client)
    async with akv.HiCache(config(store)) as cache:
        keys = await stored_cold(cache, client)
        obj = bytearray(client.objects[keys[3]])
        obj[-5] ^= 0x40  # in the trailer: the read checks it (the payload, at load-back)
        client.objects[keys[3]] = bytes(obj)
        res = await cache.prefetch(PROMPT)
        assert (res.status, res.storage_hit_tokens, res.hit_tokens) == (
            PrefetchStatus.COMPLETE,
            6,
            6,
        )
        assert keys[3] not in client.objects  # the read removed the corrupt page
        assert store.statistics().corrupt == 1
        await host_hit_and_nothing_held(cache, 6)
        m = cache.match_prefix(PROMPT)
        assert m.host_len == 6  # nothing past the corrupt page, though 4-7 may have landed
        cache.release(m)


async def test_claims_past_a_short_run_are_checked_for_those_pages_only() -> None:
    """Events on, the node left the tree (its claims orphaned), and the store lost pages 2
    and 5 silently: the reads end the run at page 2; one existence check of pages 2-7 alone
    finds 2 and 5 gone, and their ``BlockRemoved(STORAGE)`` is published once."""
    client = FakeMooncakeClient()
    store = FakeMooncakeStorage(client)
    async with akv.HiCache(config(store, enable_kv_events=True)) as cache:
        keys = await stored_cold(cache, client)
        stored = [
            h
            for e in cache.take_events()
            if isinstance(e, akv.BlockStored) and e.medium == "STORAGE"
            for h in e.block_hashes
        ]
        assert len(stored) == 8
        del client.objects[keys[2]]
        del client.objects[keys[5]]
        res = await cache.prefetch(PROMPT)
        assert res.hit_tokens == 4
        checks = [k for name, k in client.log if name == "batch_is_exist"]
        assert checks == [keys[2:]]
        removed = [
            h
            for e in cache.take_events()
            if isinstance(e, akv.BlockRemoved) and e.medium == "STORAGE"
            for h in e.block_hashes
        ]
        assert removed == [stored[2], stored[5]]
        await host_hit_and_nothing_held(cache, 4)


async def test_a_read_that_raises_leaves_the_result_partial() -> None:
    """A read that raises tells nothing of its pages: the run is not cut there, the pages
    before it are committed, and the result is partial (storage may have had more)."""
    client = FakeMooncakeClient()
    store = FakeMooncakeStorage(client)
    async with akv.HiCache(config(store, prefetch_batch_pages=4, storage_workers=2)) as cache:
        keys = await stored_cold(cache, client)
        real = client.batch_get_into

        def flaky(ks: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
            if ks[0] == keys[4]:
                raise RuntimeError("transfer failed")
            return real(ks, ptrs, sizes)

        client.batch_get_into = flaky  # type: ignore[method-assign]
        res = await cache.prefetch(PROMPT)
        assert (res.status, res.storage_hit_tokens, res.hit_tokens) == (
            PrefetchStatus.PARTIAL,
            16,
            8,
        )
        assert res.error is not None and "transfer failed" in res.error
        await host_hit_and_nothing_held(cache, 8)


async def test_a_miss_commits_nothing_and_returns_every_page() -> None:
    client = FakeMooncakeClient()
    store = FakeMooncakeStorage(client)
    async with akv.HiCache(config(store)) as cache:
        keys = await stored_cold(cache, client)
        for k in keys:
            del client.objects[k]
        res = await cache.prefetch(PROMPT)
        assert (res.status, res.hit_tokens) == (PrefetchStatus.MISS, 0)
        await cache.flush()
        st = cache.statistics()
        assert st.host.quarantined_pages == 0 and st.prefetch_reserved_pages == 0
        cache.check_invariants()


async def test_without_read_ahead_the_reads_wait_for_the_check() -> None:
    """The other backends' order is unchanged: no read before the check answered."""
    client = FakeMooncakeClient()
    store = FakeMooncakeStorage(client)
    store.read_ahead = False
    async with akv.HiCache(config(store)) as cache:
        await stored_cold(cache, client)
        client.gates["batch_is_exist"].clear()
        task = asyncio.ensure_future(cache.prefetch(PROMPT))
        assert await asyncio.to_thread(client.entered["batch_is_exist"].wait, 10)
        await asyncio.sleep(0.05)
        assert client.calls["batch_get_into"] == 0
        client.gates["batch_is_exist"].set()
        assert (await task).hit_tokens == len(PROMPT)


class FaultyClient(HoldingClient):
    """Reads of a batch holding a key in ``raising`` raise (the whole batch fails)."""

    def __init__(self) -> None:
        super().__init__()
        self.raising: set[str] = set()

    def batch_get_into(
        self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        if self.raising & set(keys):
            with self.lock:
                self.log.append(("raised", list(keys)))
            raise RuntimeError("transfer failed")
        return super().batch_get_into(keys, ptrs, sizes)


@pytest.mark.parametrize("seed", range(16))
async def test_seeded_faults_commit_exactly_the_run_before_the_first(seed: int) -> None:
    """Random batch sizes, worker counts and per-page faults (missing, a corrupt trailer, a
    read that raises for its whole batch): exactly the pages before the first fault seen
    are committed (a missing or corrupt page in a batch that was read; a raising batch
    counts from its first page, and only inside the run), the status says why, nothing
    stays quarantined, and the invariants hold."""
    rng = random.Random(seed)
    client = FaultyClient()
    store = FakeMooncakeStorage(client)
    opts = dict(prefetch_batch_pages=rng.choice([1, 2, 3, 4]), storage_workers=rng.choice([2, 3]))
    async with akv.HiCache(config(store, **opts)) as cache:
        keys = await stored_cold(cache, client)
        kinds = rng.choices(["ok", "missing", "corrupt", "raise"], [6, 1, 1, 1], k=len(keys))
        for key, kind in zip(keys, kinds, strict=True):
            if kind == "missing":
                del client.objects[key]
            elif kind == "corrupt":
                obj = bytearray(client.objects[key])
                obj[-3] ^= 0x10
                client.objects[key] = bytes(obj)
            elif kind == "raise":
                client.raising.add(key)
        client.log.clear()
        res = await cache.prefetch(PROMPT)
        read = {k for name, ks in client.log if name == "batch_get_into" for k in ks}
        bad = [j for j, kind in enumerate(kinds) if kind in ("missing", "corrupt")]
        first_bad = min((j for j in bad if keys[j] in read), default=len(keys))
        raised = [keys.index(ks[0]) for name, ks in client.log if name == "raised"]
        first_raise = min((a for a in raised if a < first_bad), default=None)
        want = first_bad if first_raise is None else first_raise
        note = f"seed {seed}: {kinds} {opts}"
        assert res.hit_tokens == 2 * want, note
        if first_raise is not None:
            assert res.status in (PrefetchStatus.PARTIAL, PrefetchStatus.FAILED), note
        elif want == 0:
            assert res.status is PrefetchStatus.MISS, note
        else:
            assert res.status is PrefetchStatus.COMPLETE, note
        await host_hit_and_nothing_held(cache, 2 * want)
