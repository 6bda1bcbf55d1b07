"""Warm-up: ``await cache.warm(tokens, tier=, timeout=)`` and ``warm_from`` (#26).

A fresh cache over the same FileStorage directory warms a prompt to host, or on to device,
bit-identical; a timeout or a cancellation cuts it short with nothing leaked (no pin, no
reserved page, every quarantined page back once the store lets go); ``warm_from`` reports
progress; bad input changes nothing.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest

import aiocache_kv as akv
from aiocache_kv.testing import ManualCopyEngine
from tests.conftest import small_config
from tests.test_cache import read_kv
from tests.test_storage_tier import PROMPT, FlakyStorage, cfg, stored_prompt

N = len(PROMPT)  # 16 tokens, 8 pages of 2


def idle(cache: akv.HiCache) -> None:
    """Nothing held: no handle, no pin, no reservation, nothing protected."""
    st = cache.statistics()
    assert len(cache._handles) == 0 and st.active_pins == 0
    assert st.prefetch_reserved_pages == 0
    assert st.device.protected_pages == 0 and st.host.protected_pages == 0
    cache.check_invariants()


def loaded_kv(cache: akv.HiCache, tokens: list[int]) -> list[object]:
    with cache.match_prefix(tokens) as m:
        assert m.device_len == len(tokens)
        return read_kv(cache, m.device_indices)


async def test_warm_to_host_then_device_in_a_fresh_cache(tmp_path: Path) -> None:
    kv = await stored_prompt(tmp_path)
    # the prefetch threshold does not apply to a warm-up: short prompts warm too
    async with akv.HiCache(cfg(tmp_path, prefetch_threshold_tokens=1000)) as cache:
        assert cache.cached_len(PROMPT) == 0
        res = await cache.warm(PROMPT, tier="host", timeout=10)
        assert (res.tokens, res.device_len, res.host_len) == (N, 0, N)
        assert (res.storage_tokens, res.timed_out, res.error) == (N, False, None)
        assert res.cached_len == N
        idle(cache)
        again = await cache.warm([*PROMPT, 1], tier="device")  # the tail is not a page
        assert (again.tokens, again.device_len, again.host_len, again.storage_tokens) == (
            N,
            N,
            0,
            0,
        )
        idle(cache)
        got = loaded_kv(cache, PROMPT)
        for a, b in zip(got, kv, strict=True):
            assert a.equal(b)  # type: ignore[attr-defined]
        st = cache.statistics()
        assert (st.warms, st.warms_cut_short, st.warm_storage_tokens) == (2, 0, N)
        assert st.match_queries == 1  # warm-ups are not counted as requests' matches


async def test_warm_straight_to_device_in_rounds_of_half_the_host_pool(tmp_path: Path) -> None:
    kv = await stored_prompt(tmp_path)
    # 8 host pages: one prefetch reserves at most 4, so the warm-up takes two rounds
    async with akv.HiCache(cfg(tmp_path, host_pages=8)) as cache:
        res = await cache.warm(PROMPT, timeout=10)
        assert (res.device_len, res.host_len, res.storage_tokens) == (N, 0, N)
        assert cache.statistics().prefetch_queries == 2
        idle(cache)
        for a, b in zip(loaded_kv(cache, PROMPT), kv, strict=True):
            assert a.equal(b)  # type: ignore[attr-defined]


async def test_warm_without_storage_loads_host_pages_back() -> None:
    async with akv.HiCache(small_config()) as cache:
        tokens = list(range(100, 108))
        r = cache.insert(tokens, cache.alloc(8))
        assert r.write_through is not None
        await r.write_through
        cache.release(r)
        assert cache.evict(100) == 4
        res = await cache.warm(tokens)
        assert (res.device_len, res.host_len, res.storage_tokens) == (8, 0, 0)
        idle(cache)
        namespaces = cache.statistics().namespaces
        miss = await cache.warm([1, 2, 3, 4], tenant="nobody", timeout=1)
        assert (miss.device_len, miss.host_len, miss.timed_out) == (0, 0, False)
        assert cache.statistics().namespaces == namespaces  # no root left behind
        idle(cache)


async def test_timeout_on_a_stalled_store_returns_partial_and_leaks_nothing(
    tmp_path: Path,
) -> None:
    await stored_prompt(tmp_path)
    store = FlakyStorage(tmp_path)
    async with akv.HiCache(cfg(tmp_path, storage=store, storage_timeout=5.0)) as cache:
        store.stall.clear()  # reads hang until released
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        res = await cache.warm(PROMPT, timeout=0.2)
        assert 0.2 <= loop.time() - t0 < 2.0  # bounded by the timeout, not the storage deadline
        assert res.timed_out and res.error is None
        assert (res.device_len, res.host_len, res.storage_tokens) == (0, 0, 0)
        st = cache.statistics()
        assert (st.warms, st.warms_cut_short) == (1, 1)
        assert st.host.quarantined_pages == 8  # the stuck reads still own their pages
        idle(cache)
        store.stall.set()
        await cache.flush()
        st = cache.statistics()
        assert st.host.quarantined_pages == 0 and st.host.free_pages == st.host.total_pages
        assert cache.cached_len(PROMPT) == 0  # a late read is never a hit
        idle(cache)


async def test_cancelled_warm_leaks_nothing(tmp_path: Path) -> None:
    await stored_prompt(tmp_path)
    store = FlakyStorage(tmp_path)
    async with akv.HiCache(cfg(tmp_path, storage=store)) as cache:
        store.stall.clear()
        task = asyncio.create_task(cache.warm(PROMPT, timeout=30))
        for _ in range(400):
            await asyncio.sleep(0.005)
            if cache.statistics().prefetch_reserved_pages:
                break
        assert cache.statistics().prefetch_reserved_pages == 8
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert cache.statistics().warms_cut_short == 1
        idle(cache)
        store.stall.set()
        await cache.flush()
        assert cache.statistics().host.quarantined_pages == 0
        idle(cache)


async def test_cut_short_during_the_load_back_the_copies_land_in_the_tree(
    tmp_path: Path,
) -> None:
    await stored_prompt(tmp_path)
    engine = ManualCopyEngine()
    async with akv.HiCache(cfg(tmp_path), copy_engine=engine) as cache:
        task = asyncio.create_task(cache.warm(PROMPT, timeout=30))
        for _ in range(400):
            await asyncio.sleep(0.005)
            if engine.pending:
                break
        assert engine.pending  # the prefetch landed; the load-back's copy is in flight
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len(cache._handles) == 0
        cache.check_invariants()  # the nodes are device-FILLING, owned by the copy
        engine.complete_all()
        await cache.flush()
        idle(cache)
        with cache.match_prefix(PROMPT) as m:
            assert m.device_len == N  # the copy landed and the tree owns it

        # a timeout while waiting for device room: the load gives up, nothing is taken
        assert cache.evict(100) == 8
        held = cache.alloc(cache.statistics().device.free_pages * 2)
        res = await cache.warm(PROMPT, timeout=0.05)
        assert res.timed_out and (res.device_len, res.host_len) == (0, N)
        assert len(cache._waiters) == 0
        cache.free(held)
        idle(cache)


async def test_warm_from_reports_progress_and_checks_every_prompt_first(
    tmp_path: Path,
) -> None:
    await stored_prompt(tmp_path)
    other = list(range(500, 508))
    await stored_prompt(tmp_path, other)
    async with akv.HiCache(cfg(tmp_path)) as cache:
        seen: list[tuple[int, int]] = []
        with pytest.raises(akv.InvalidInputError, match=r"prompts\[1\]"):
            await cache.warm_from([PROMPT, [], other])
        with pytest.raises(akv.InvalidTypeError, match=r"prompts\[0\]"):
            await cache.warm_from([["x"]])
        with pytest.raises(akv.InvalidTypeError):
            await cache.warm_from("abc")  # type: ignore[arg-type]
        with pytest.raises(akv.InvalidTypeError):
            await cache.warm_from([PROMPT], progress=5)  # type: ignore[arg-type]
        assert cache.statistics().warms == 0  # nothing warmed on bad input
        results = await cache.warm_from(
            (p for p in (PROMPT, [9999, 9998], other)),
            tier="host",
            timeout_each=10,
            progress=lambda done, total: seen.append((done, total)),
        )
        assert seen == [(1, 3), (2, 3), (3, 3)]
        assert [r.host_len for r in results] == [N, 0, len(other)]
        assert [r.storage_tokens for r in results] == [N, 0, len(other)]
        idle(cache)


async def test_hostile_input_changes_nothing(tmp_path: Path) -> None:
    async with akv.HiCache(cfg(tmp_path)) as cache:
        for timeout in (-1, math.nan, math.inf, True, "1"):
            with pytest.raises(akv.InvalidInputError):
                await cache.warm(PROMPT, timeout=timeout)  # type: ignore[arg-type]
            with pytest.raises(akv.InvalidInputError):
                await cache.warm_from([PROMPT], timeout_each=timeout)  # type: ignore[arg-type]
        for tier in ("storage", akv.Tier.STORAGE, "gpu"):
            with pytest.raises(akv.InvalidInputError):
                await cache.warm(PROMPT, tier=tier)
        for bad in ([], [-1], "ab", None):
            with pytest.raises((akv.InvalidInputError, akv.InvalidTypeError)):
                await cache.warm(bad)  # type: ignore[arg-type]
        with pytest.raises(akv.InvalidTypeError):
            await cache.warm(PROMPT, lora=3)  # type: ignore[arg-type]
        st = cache.statistics()
        assert (st.warms, st.prefetch_queries, st.nodes, st.namespaces) == (0, 0, 0, 0)
        idle(cache)
    with pytest.raises(akv.CacheClosedError):
        await cache.warm(PROMPT)
