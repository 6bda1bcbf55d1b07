"""Mooncake prefetches read beside their existence check.

``MooncakeStorage.read_ahead``: a read of a missing key costs what asking costs, so the tier
starts reading the whole run together with ``batch_is_exist`` (one pool, one rank, two
workers); only pages inside the leading run the check reports count, whenever their read
lands, and batches past the run are not started once it is known.
"""

from __future__ import annotations

import asyncio

import aiocache_kv as akv
from aiocache_kv.storage.prefetch import PrefetchStatus
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


async def test_reads_start_while_the_existence_check_is_held() -> None:
    """The check is held at its gate: the reads are already in the store (without read-ahead
    they would wait for its answer and this would time out); everything is committed."""
    client = FakeMooncakeClient()
    store = FakeMooncakeStorage(client)
    async with akv.HiCache(config(store)) as cache:
        await stored_cold(cache, client)
        client.gates["batch_is_exist"].clear()
        task = asyncio.ensure_future(cache.prefetch(PROMPT))
        assert await asyncio.to_thread(client.entered["batch_get_into"].wait, 10)
        assert client.calls["batch_is_exist"] == 1 and not task.done()
        client.gates["batch_is_exist"].set()
        res = await task
        assert res.status is PrefetchStatus.COMPLETE and res.hit_tokens == len(PROMPT)
        await host_hit_and_nothing_held(cache, len(PROMPT))


async def test_only_the_leading_run_counts_and_reads_past_it_stop() -> None:
    """Page 3 is missing: the run is pages 0-2.  The reads are held until the check's answer
    reached the loop; then no batch past the run starts (pages 4-7 are never read), page 3's
    miss is no vanished page, and exactly the run is committed."""
    client = FakeMooncakeClient()
    store = FakeMooncakeStorage(client)
    async with akv.HiCache(config(store)) as cache:
        keys = await stored_cold(cache, client)
        del client.objects[keys[3]]
        client.gates["batch_get_into"].clear()
        before = cache.statistics().prefetch_storage_hit_tokens
        task = asyncio.ensure_future(cache.prefetch(PROMPT))
        await until(
            lambda: cache.statistics().prefetch_storage_hit_tokens > before, "the check's answer"
        )
        client.gates["batch_get_into"].set()
        res = await task
        assert (res.status, res.storage_hit_tokens, res.hit_tokens) == (
            PrefetchStatus.COMPLETE,
            6,
            6,
        )
        assert not set(got_keys(client)) & set(keys[4:])
        assert all(k in client.objects for k in keys[4:])  # nobody took them for vanished
        await host_hit_and_nothing_held(cache, 6)


async def test_a_page_read_past_the_run_is_never_committed() -> None:
    """The check says page 3 is absent while the store has it (it landed meanwhile): the
    read-ahead may read it and the pages after it intact, yet only the run 0-2 counts."""
    client = FakeMooncakeClient()
    store = FakeMooncakeStorage(client)
    async with akv.HiCache(config(store)) as cache:
        await stored_cold(cache, client)
        client.exist_codes = [[1, 1, 1, 0, 1, 1, 1, 1]]
        client.gates["batch_is_exist"].clear()  # every read lands before the answer
        task = asyncio.ensure_future(cache.prefetch(PROMPT))
        await until(lambda: client.calls["batch_get_into"] >= 4, "every read")
        client.gates["batch_is_exist"].set()
        res = await task
        assert (res.storage_hit_tokens, res.hit_tokens) == (6, 6)
        await host_hit_and_nothing_held(cache, 6)


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
