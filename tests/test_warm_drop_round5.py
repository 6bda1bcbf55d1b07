"""Warm-up and drop, round 5: a cache closed during ``warm``/``warm_from`` raises
``CacheClosedError`` with nothing of the warm held; a warm-up that finds no host room says so
in ``error``; ``drop(tiers=)`` takes any iterable of tier names.

Interleavings are deterministic: a stalled ``FlakyStorage`` read or the hand-completed copy
engine holds the warm-up where the close starts.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

import aiocache_kv as akv
from aiocache_kv.errors import CacheClosedError, InvalidInputError, InvalidTypeError
from aiocache_kv.lifecycle import Lifecycle
from aiocache_kv.testing import ManualCopyEngine
from tests.conftest import small_config
from tests.test_split_ack import insert
from tests.test_storage_tier import PROMPT, FlakyStorage, cfg, stored_prompt

N = len(PROMPT)  # 16 tokens, 8 pages of 2
OTHER = list(range(500, 508))  # 4 pages

T = TypeVar("T")


def held(cache: akv.HiCache) -> tuple[int, int, int]:
    """What is held now: handles, pinned tree nodes, host pages reserved by prefetches."""
    pinned = sum(1 for n in cache._tree.walk() if n.pins)
    reserved = cache._l3.reserved_pages if cache._l3 is not None else 0
    return len(cache._handles), pinned, reserved


async def closed_meanwhile(cache: akv.HiCache, work: Awaitable[T]) -> tuple[int, int, int]:
    """Await ``work``, which must raise ``CacheClosedError``; what was held when it raised."""
    try:
        await work
    except CacheClosedError as exc:
        now = held(cache)
        assert re.search(r"cache is (closing|closed) \(closed meanwhile\)", str(exc)), exc
        return now
    raise AssertionError("it did not raise CacheClosedError")


async def reserved(cache: akv.HiCache) -> None:
    """Until a prefetch holds host pages (its read is in the store)."""
    for _ in range(400):
        await asyncio.sleep(0.005)
        if cache.statistics().prefetch_reserved_pages:
            return
    raise AssertionError("the prefetch never reserved host pages")


def closed_clean(cache: akv.HiCache) -> None:
    assert cache._state is Lifecycle.CLOSED
    assert held(cache) == (0, 0, 0)
    cache.check_invariants()


# ---------------------------------------------------------------------- closed meanwhile


@pytest.mark.parametrize("tier", ["host", "device"])
async def test_warm_raises_when_the_cache_closes_during_its_storage_read(
    tmp_path: Path, tier: str
) -> None:
    await stored_prompt(tmp_path)
    store = FlakyStorage(tmp_path)
    cache = akv.HiCache(cfg(tmp_path, storage=store, storage_timeout=2.0))
    await cache.start()
    store.stall.clear()  # the warm-up's read hangs in the store
    task = asyncio.create_task(closed_meanwhile(cache, cache.warm(PROMPT, tier=tier, timeout=10)))
    await reserved(cache)
    closing = asyncio.create_task(cache.aclose())
    await asyncio.sleep(0.05)
    assert cache._state is Lifecycle.CLOSING
    store.stall.set()
    assert await task == (0, 0, 0)  # nothing of the warm-up held when it raised
    await closing
    closed_clean(cache)


async def test_warm_raises_when_the_cache_closes_during_its_load_back(tmp_path: Path) -> None:
    await stored_prompt(tmp_path)
    engine = ManualCopyEngine()
    cache = akv.HiCache(cfg(tmp_path), copy_engine=engine)
    await cache.start()
    task = asyncio.create_task(closed_meanwhile(cache, cache.warm(PROMPT, timeout=30)))
    for _ in range(400):
        await asyncio.sleep(0.005)
        if engine.pending:
            break
    assert engine.pending  # the prefetch landed; the load-back's copy is in flight
    assert len(cache._handles) == 1  # the warm-up's match
    # the close completes the copy (ManualCopyEngine.aclose): the load-back returns on a
    # closing cache, and the warm-up lets go of its match before it raises
    closing = asyncio.create_task(cache.aclose())
    handles, pinned, _ = await task
    assert (handles, pinned) == (0, 0)
    await closing
    closed_clean(cache)


@pytest.mark.parametrize("tier", ["host", "device"])
async def test_warm_from_stops_and_raises_when_the_cache_closes(tmp_path: Path, tier: str) -> None:
    await stored_prompt(tmp_path)
    await stored_prompt(tmp_path, OTHER)
    store = FlakyStorage(tmp_path)
    cache = akv.HiCache(cfg(tmp_path, storage=store, storage_timeout=2.0))
    await cache.start()
    store.stall.clear()
    seen: list[tuple[int, int]] = []
    queries = cache.statistics().prefetch_queries
    work = cache.warm_from(
        [PROMPT, OTHER], tier=tier, progress=lambda done, total: seen.append((done, total))
    )
    task = asyncio.create_task(closed_meanwhile(cache, work))
    await reserved(cache)
    assert cache.statistics().prefetch_queries == queries + 1
    closing = asyncio.create_task(cache.aclose())
    await asyncio.sleep(0.05)
    store.stall.set()
    assert await task == (0, 0, 0)
    await closing
    assert seen == []  # no progress reported on a closing cache, no later prompt warmed
    assert cache._core.counters.warms == 1
    closed_clean(cache)


async def test_warm_from_checks_the_cache_before_progress_and_each_prompt(
    tmp_path: Path,
) -> None:
    """A close started by ``progress`` (its task runs at the next prompt's first await)
    ends ``warm_from`` there: the next prompt is not reported done."""
    await stored_prompt(tmp_path)
    await stored_prompt(tmp_path, OTHER)
    cache = akv.HiCache(cfg(tmp_path))
    await cache.start()
    seen: list[tuple[int, int]] = []
    closes: list[asyncio.Task[None]] = []

    def progress(done: int, total: int) -> None:
        seen.append((done, total))
        if done == 1:
            closes.append(asyncio.get_running_loop().create_task(cache.aclose()))

    work = cache.warm_from([PROMPT, OTHER, PROMPT], tier="host", progress=progress)
    with pytest.raises(CacheClosedError, match="meanwhile"):
        await work
    assert seen == [(1, 3)]
    await closes[0]
    closed_clean(cache)


# ---------------------------------------------------------------------- no host room


async def full_host(cache: akv.HiCache) -> akv.InsertResult:
    """Fill the 8 host pages of ``cache`` with pages pinned by the returned insert."""
    r = insert(cache, list(range(600, 616)))
    assert r.write_through is not None
    await r.write_through
    st = cache.statistics()
    assert (st.host.free_pages, st.host.protected_pages) == (0, 8)
    return r


@pytest.mark.parametrize("tier", ["host", "device"])
async def test_warm_that_finds_no_host_room_says_so(tmp_path: Path, tier: str) -> None:
    await stored_prompt(tmp_path)
    async with akv.HiCache(cfg(tmp_path, device_pages=16, host_pages=8)) as cache:
        r = await full_host(cache)
        res = await cache.warm(PROMPT, tier=tier, timeout=5)
        assert (res.device_len, res.host_len, res.storage_tokens, res.timed_out) == (
            0,
            0,
            0,
            False,
        )
        assert res.error is not None and "host pool full" in res.error
        cache.release(r)
        await cache.flush()
        cache.check_invariants()


async def test_no_host_room_still_loads_the_host_part_to_device(tmp_path: Path) -> None:
    """The storage part stops for want of host room; what host holds still goes to device,
    and the result says why the rest did not come."""
    await stored_prompt(tmp_path)
    async with akv.HiCache(cfg(tmp_path, device_pages=16, host_pages=8)) as cache:
        head = insert(cache, PROMPT[:4])  # 2 pages on device and host
        assert head.write_through is not None
        await head.write_through
        cache.release(head)
        await cache.flush()
        r = insert(cache, list(range(600, 612)))  # 6 pages: host is full
        assert r.write_through is not None
        await r.write_through
        cache.evict(100)  # the prompt's head is host-only now
        with cache.match_prefix(PROMPT) as m:
            assert (m.device_len, m.host_len) == (0, 4)
        assert cache.statistics().host.free_pages == 0
        res = await cache.warm(PROMPT, tier="device", timeout=5)
        assert (res.device_len, res.host_len, res.storage_tokens) == (4, 0, 0)
        assert res.error is not None and "host pool full" in res.error
        cache.release(r)
        await cache.flush()
        cache.check_invariants()


async def test_warm_with_room_still_reports_no_error(tmp_path: Path) -> None:
    await stored_prompt(tmp_path)
    async with akv.HiCache(cfg(tmp_path, host_pages=8)) as cache:  # two rounds of 4 pages
        res = await cache.warm(PROMPT, tier="host", timeout=10)
        assert (res.host_len, res.storage_tokens, res.error) == (N, N, None)
        again = await cache.warm(PROMPT, tier="host", timeout=10)  # all cached: nothing to do
        assert (again.host_len, again.storage_tokens, again.error) == (N, 0, None)


# ---------------------------------------------------------------------- drop(tiers=)


class Names:
    """An iterable that is no collection."""

    def __init__(self, *names: str) -> None:
        self.names = names

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)


async def test_drop_takes_any_iterable_of_tier_names() -> None:
    engine = ManualCopyEngine()
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        makers = [
            lambda: iter(["device", "host"]),
            lambda: {"device": 1, "host": 2}.keys(),
            lambda: (t for t in ("device", "host")),
            lambda: Names("device", "host", "storage"),
            lambda: map(str, ["device", "host"]),
            lambda: {"device": 1, "host": 2},  # a mapping iterates its keys
            lambda: iter([akv.Tier.DEVICE, "host"]),
        ]
        for i, make in enumerate(makers):
            tokens = [1000 + 10 * i + k for k in range(4)]
            r = insert(cache, tokens, seed=i)
            engine.complete_all()
            await cache.flush()
            cache.release(r)
            assert cache.cached_len(tokens) == 4
            res = await cache.drop(tokens, tiers=make())  # type: ignore[arg-type]
            assert (res.nodes, res.device_pages, res.host_pages) == (1, 1, 1), i
            assert cache.cached_len(tokens) == 2
        cache.check_invariants()


async def test_drop_tiers_refusals_name_the_culprit_and_change_nothing() -> None:
    engine = ManualCopyEngine()
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        r = insert(cache, [1, 2, 3, 4])
        engine.complete_all()
        await cache.flush()
        cache.release(r)
        before = cache.statistics()
        bad: list[tuple[object, type[Exception], str]] = [
            ("device", InvalidTypeError, "str"),
            (b"device", InvalidTypeError, "bytes"),
            (5, InvalidTypeError, "int"),
            (None, InvalidTypeError, "None"),
            ([["device"], "host"], InvalidTypeError, r"\['device'\]"),
            ((t for t in (["device"], "host")), InvalidTypeError, r"\['device'\]"),
            ([{"host"}, "device"], InvalidTypeError, "set"),
            (["device", 2], InvalidTypeError, "2"),
            ([b"host", "device"], InvalidTypeError, "b'host'"),
            (iter(["gpu", "host"]), InvalidInputError, "gpu"),
            (iter([]), InvalidInputError, "at least one"),
            ((t for t in ["device"]), InvalidInputError, "together"),
        ]
        for tiers, err, match in bad:
            with pytest.raises(err, match=match) as info:
                await cache.drop([1, 2, 3, 4], tiers=tiers)  # type: ignore[arg-type]
            assert type(info.value) is err, (tiers, info.value)
            assert cache.statistics() == before
            assert cache.cached_len([1, 2, 3, 4]) == 4
        cache.check_invariants()
