"""Hard pins with expiry: ``cache.pin(tokens, ttl=, tier=)`` / ``cache.unpin(pin)`` (#26).

A pin keeps the prefix resident in its tier now (device: the device run, host: the host run)
until unpin or its ttl; the pinned pages of a tier are capped; bad input changes nothing; a
pin expiring during a load-back of its nodes is harmless; closing releases every pin.
"""

from __future__ import annotations

import asyncio
import math

import pytest

import aiocache_kv as akv
from aiocache_kv.testing import ManualCopyEngine
from tests.conftest import small_config
from tests.test_split_ack import insert

try:  # imported here, not on the loop: its import reads /proc
    import prometheus_client
except ImportError:  # pragma: no cover - the metrics extra is a dev dependency
    prometheus_client = None  # type: ignore[assignment]

P = 2  # small_config's page size


def toks(start: int, pages: int) -> list[int]:
    return list(range(start, start + pages * P))


async def cached(cache: akv.HiCache, tokens: list[int]) -> akv.InsertResult:
    """Insert ``tokens``, wait for its write-through, release: an idle, host-backed prefix."""
    r = insert(cache, tokens)
    if r.write_through is not None:
        await r.write_through
    cache.release(r)
    return r


def state(cache: akv.HiCache) -> tuple[object, ...]:
    """What a failed call must leave alone."""
    st = cache.statistics()
    return (
        st.device,
        st.host,
        st.nodes,
        st.namespaces,
        st.active_pins,
        st.pinned_pages_device,
        st.pinned_pages_host,
        st.pins_created,
        [(n.pins, n.host_pins, len(n.key)) for n in cache._tree.walk()],
    )


async def test_device_pin_keeps_pages_under_eviction_until_unpinned() -> None:
    async with akv.HiCache(small_config(device_pages=16, host_pages=0)) as cache:
        a = toks(100, 4)
        await cached(cache, a)
        pin = cache.pin([*a, 7], ttl=60)  # an unaligned tail is not pinned
        assert (pin.tier, pin.pinned_len, pin.pages) == (akv.Tier.DEVICE, 8, 4)
        assert pin.state is akv.PinState.ACTIVE
        st = cache.statistics()
        assert (st.active_pins, st.pinned_pages_device, st.pinned_pages_host) == (1, 4, 0)
        assert st.device.protected_pages == 4 and st.device.evictable_pages == 0
        assert cache.evict(100) == 0  # nothing evictable
        with pytest.raises(akv.CapacityError):
            cache.alloc(13 * P)  # 12 free + 0 evictable
        cache.check_invariants()
        assert cache.unpin(pin) is True
        assert pin.state is akv.PinState.RELEASED
        st = cache.statistics()
        assert (st.active_pins, st.pinned_pages_device, st.pins_released) == (0, 0, 1)
        assert cache.evict(100) == 4
        cache.check_invariants()


async def test_host_pin_keeps_host_copy_and_lets_device_copy_go() -> None:
    async with akv.HiCache(small_config(device_pages=16, host_pages=16)) as cache:
        a = toks(100, 4)
        await cached(cache, a)
        pin = cache.pin(a, ttl=60, tier="host")
        assert (pin.tier, pin.pinned_len) == (akv.Tier.HOST, 8)
        st = cache.statistics()
        assert (st.pinned_pages_device, st.pinned_pages_host) == (0, 4)
        assert st.host.protected_pages == 4 and st.host.evictable_pages == 0
        assert st.device.evictable_pages == 4  # a host pin keeps no device memory
        assert cache.evict(100) == 4  # demoted: the host copy stays
        cache.check_invariants()
        assert cache.evict(100, "host") == 0  # host-pinned: no host victim
        assert cache.cached_len(a) == 8
        # host pressure from another prompt evicts around the pinned pages
        for i in range(6):
            await cached(cache, toks(1000 + 100 * i, 2))
            cache.evict(100)
        assert cache.cached_len(a) == 8
        cache.check_invariants()
        cache.unpin(pin)
        st = cache.statistics()
        assert st.pinned_pages_host == 0 and st.host.protected_pages == 0
        assert cache.evict(100, "host") >= 4
        assert cache.cached_len(a) == 0
        cache.check_invariants()


async def test_pin_covers_only_the_run_resident_in_its_tier() -> None:
    async with akv.HiCache(small_config(device_pages=16, host_pages=16)) as cache:
        a, tail = toks(100, 2), toks(300, 3)
        await cached(cache, a + tail)
        cache.release(cache.match_prefix(a))  # split at a's end
        assert cache.evict(3) == 3  # the tail (a device leaf) is demoted: host only
        dev = cache.pin(a + tail, ttl=5)
        host = cache.pin(a + tail, ttl=5, tier="host")
        assert (dev.pinned_len, dev.pages) == (len(a), 2)
        assert (host.pinned_len, host.pages) == (len(a + tail), 5)
        st = cache.statistics()
        assert (st.pinned_pages_device, st.pinned_pages_host) == (2, 5)
        cache.check_invariants()
        cache.unpin(dev)
        assert cache.evict(100) == 2  # a's device copy may go now; the host pin stays
        with pytest.raises(akv.NotCachedError, match="on device"):
            cache.pin(a + tail, ttl=5)  # nothing of it on device any more
        assert cache.evict(100, "host") == 0
        cache.unpin(host)
        cache.check_invariants()


async def test_pin_splits_where_the_prompt_ends_mid_node() -> None:
    async with akv.HiCache(small_config(device_pages=16, host_pages=16)) as cache:
        a = toks(100, 6)
        await cached(cache, a)
        pin = cache.pin(a[: 2 * P], ttl=30)
        assert pin.pinned_len == 2 * P
        assert cache.statistics().pinned_pages_device == 2
        assert cache.evict(100) == 4  # the tail of the node went, the pinned head stayed
        cache.check_invariants()
        # an insert that splits the pinned node again keeps the pin on both fragments
        await cached(cache, a[:P] + toks(900, 2))
        cache.check_invariants()
        assert cache.statistics().pinned_pages_device == 2
        cache.unpin(pin)
        cache.check_invariants()
        host = cache.pin(a[: 2 * P], ttl=30, tier="host")
        await cached(cache, a[:P] + toks(950, 1))  # splits under a host pin
        cache.check_invariants()
        cache.evict(100)
        cache.evict(100, "host")
        assert cache.cached_len(a) == 2 * P
        cache.unpin(host)
        cache.check_invariants()


async def test_ttl_expiry_releases_and_wakes_a_capacity_waiter() -> None:
    async with akv.HiCache(small_config(device_pages=8, host_pages=0)) as cache:
        a = toks(100, 4)
        await cached(cache, a)
        held = cache.alloc(4 * P)  # the rest of the pool
        pin = cache.pin(a, ttl=0.05)
        waiter = asyncio.ensure_future(cache.alloc_wait(2 * P, timeout=10))
        await asyncio.sleep(0)
        assert not waiter.done()  # pinned: nothing evictable
        assert await asyncio.wait_for(pin.wait(), 5) is akv.PinState.EXPIRED
        slots = await asyncio.wait_for(waiter, 5)  # the expiry's unpin woke the line
        assert slots.numel() == 2 * P
        st = cache.statistics()
        assert (st.active_pins, st.pins_expired, st.pinned_pages_device) == (0, 1, 0)
        assert cache.unpin(pin) is False  # expired: nothing to do, twice as well
        assert cache.unpin(pin) is False
        cache.free(slots)
        cache.free(held)
        cache.check_invariants()


async def test_one_timer_for_the_earliest_deadline() -> None:
    async with akv.HiCache(small_config(device_pages=16, host_pages=16)) as cache:
        a, b, c = toks(100, 2), toks(200, 2), toks(300, 2)
        for t in (a, b, c):
            await cached(cache, t)
        loop = asyncio.get_running_loop()
        late = cache.pin(a, ttl=60)
        hard = cache._core.hard_pins
        first = hard._timer_at
        assert first == late.expires_at
        soon = cache.pin(b, ttl=0.03)  # earlier: the timer is re-armed
        assert hard._timer_at == soon.expires_at < first
        mid = cache.pin(c, ttl=30)  # later: the timer stays
        assert hard._timer_at == soon.expires_at
        cache.check_invariants()
        assert await asyncio.wait_for(soon.wait(), 5) is akv.PinState.EXPIRED
        assert loop.time() >= soon.expires_at
        assert hard._timer_at == mid.expires_at  # re-armed for the next one
        assert late.state is mid.state is akv.PinState.ACTIVE
        cache.unpin(mid)
        cache.check_invariants()
        cache.unpin(late)
        assert hard._timer is None and math.isinf(hard._timer_at)  # nothing left to expire
        # many pins and unpins do not grow the heap without bound
        for _ in range(300):
            cache.unpin(cache.pin(a, ttl=60))
        assert len(hard._heap) <= 2 * len(hard) + 65
        cache.check_invariants()


async def test_cap_refuses_a_pin_beyond_the_fraction_and_changes_nothing() -> None:
    cfg = small_config(device_pages=16, host_pages=16, max_pinned_fraction=0.5)
    async with akv.HiCache(cfg) as cache:
        a, b = toks(100, 6), toks(300, 4)
        await cached(cache, a)
        await cached(cache, b)
        pa = cache.pin(a, ttl=30)
        again = cache.pin(a, ttl=30)  # the same pages: counted once
        assert cache.statistics().pinned_pages_device == 6
        before = state(cache)
        with pytest.raises(akv.PinLimitError, match="cap of 8") as info:
            cache.pin(b, ttl=30)
        assert isinstance(info.value, akv.CapacityError)
        assert state(cache) == before
        part = cache.pin(b[: 2 * P], ttl=30)  # 2 more pages fit exactly
        assert cache.statistics().pinned_pages_device == 8
        with pytest.raises(akv.PinLimitError):
            cache.pin(b, ttl=30)
        # host pins have their own cap (of the host pool)
        hb = cache.pin(b, ttl=30, tier="host")
        assert cache.statistics().pinned_pages_host == 4
        cache.check_invariants()
        for pin in (pa, again, part, hb):
            cache.unpin(pin)
        assert cache.statistics().pinned_pages_device == 0
        cache.check_invariants()
    with pytest.raises(akv.ConfigError):
        small_config(max_pinned_fraction=0)
    with pytest.raises(akv.ConfigError):
        small_config(max_pinned_fraction=1.5)
    with pytest.raises(akv.ConfigError):
        small_config(max_pin_ttl=math.nan)


async def test_hostile_input_raises_typed_errors_with_nothing_changed() -> None:
    async with akv.HiCache(small_config(max_pin_ttl=100.0)) as cache:
        a = toks(100, 2)
        await cached(cache, a)
        before = state(cache)
        bad_ttls: list[object] = [0, -1, math.nan, math.inf, -math.inf, 101, 1e300, True, "5"]
        for ttl in bad_ttls:
            with pytest.raises(akv.InvalidInputError):
                cache.pin(a, ttl=ttl)  # type: ignore[arg-type]
        for tier in ("storage", akv.Tier.STORAGE, "gpu", "", "DEVICE"):
            with pytest.raises(akv.InvalidInputError):
                cache.pin(a, ttl=1, tier=tier)
        for tier_t in (None, 1, b"device"):
            with pytest.raises(akv.InvalidTypeError):
                cache.pin(a, ttl=1, tier=tier_t)  # type: ignore[arg-type]
        for tokens in ([], [-1, 2], [1.5, 2], "ab", [2**63, 1]):
            with pytest.raises((akv.InvalidInputError, akv.InvalidTypeError)):
                cache.pin(tokens, ttl=1)  # type: ignore[arg-type]
        with pytest.raises(akv.InvalidTypeError):
            cache.pin(a, ttl=1, tenant=5)  # type: ignore[arg-type]
        # a prefix not cached: typed error, and no namespace is created for it
        with pytest.raises(akv.NotCachedError, match="none of the 4"):
            cache.pin(toks(700, 2), ttl=1)
        with pytest.raises(akv.NotCachedError):
            cache.pin(a, ttl=1, tenant="someone-else")
        with pytest.raises(akv.NotCachedError):
            cache.pin([100], ttl=1)  # less than a page
        assert state(cache) == before
        with pytest.raises(akv.InvalidTypeError):
            cache.unpin("pin")  # type: ignore[arg-type]
        pin = cache.pin(a, ttl=1)
        cache.unpin(pin)
        with pytest.raises(akv.HandleError, match="released"):
            cache.unpin(pin)
        async with akv.HiCache(small_config()) as other:
            await cached(other, a)
            theirs = other.pin(a, ttl=1)
            with pytest.raises(akv.HandleError, match="another cache"):
                cache.unpin(theirs)
            other.unpin(theirs)
        cache.check_invariants()


async def test_host_pin_expiring_during_a_load_back_of_its_nodes(engine: ManualCopyEngine) -> None:
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        a = toks(100, 4)
        r = insert(cache, a)
        engine.complete_all()
        assert r.write_through is not None
        await r.write_through
        cache.release(r)
        assert cache.evict(100) == 4  # a: host only
        pin = cache.pin(a, ttl=0.03, tier="host")
        m = cache.match_prefix(a)
        load = asyncio.ensure_future(cache.load_back(m))
        await asyncio.sleep(0)
        assert engine.pending  # the copy is in flight: a's node is device-FILLING
        cache.check_invariants()
        assert await asyncio.wait_for(pin.wait(), 5) is akv.PinState.EXPIRED
        cache.check_invariants()  # the pages stay protected by the copy in flight
        cache.release(m)  # the copy still lands, owned by the tree
        cache.check_invariants()
        engine.complete_all()
        with pytest.raises(akv.HandleError):  # released while loading: it stops waiting
            await asyncio.wait_for(load, 5)
        cache.check_invariants()
        st = cache.statistics()
        assert st.device.evictable_pages == 4 and st.host.evictable_pages == 4
        assert cache.evict(100) == 4 and cache.evict(100, "host") == 4
        cache.check_invariants()


async def test_device_pin_expiring_during_a_failed_load_below_it(engine: ManualCopyEngine) -> None:
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        a, tail = toks(100, 2), toks(300, 2)
        r = insert(cache, a + tail)
        engine.complete_all()
        assert r.write_through is not None
        await r.write_through
        cache.release(r)
        m = cache.match_prefix(a)
        cache.release(m)  # split at a's end
        hold = cache.match_prefix(a)  # keeps a on device while the tail is demoted
        assert cache.evict(2) == 2
        cache.release(hold)
        pin = cache.pin(a + tail, ttl=0.03)  # the device run: a
        assert pin.pinned_len == len(a)
        m = cache.match_prefix(a + tail)
        load = asyncio.ensure_future(cache.load_back(m))
        await asyncio.sleep(0)
        assert await asyncio.wait_for(pin.wait(), 5) is akv.PinState.EXPIRED
        cache.check_invariants()
        engine.fail()
        with pytest.raises(akv.TransferError):
            await asyncio.wait_for(load, 5)
        cache.release(m)
        cache.check_invariants()
        assert cache.statistics().device.protected_pages == 0


async def test_aclose_releases_every_pin_and_cancels_the_timer() -> None:
    cache = akv.HiCache(small_config())
    await cache.start()
    a, b = toks(100, 2), toks(200, 2)
    await cached(cache, a)
    await cached(cache, b)
    p1 = cache.pin(a, ttl=0.05)
    p2 = cache.pin(b, ttl=60, tier="host")
    waiting = asyncio.ensure_future(p2.wait())
    await asyncio.sleep(0)
    cache.check_invariants()
    await cache.aclose()
    assert p1.state is p2.state is akv.PinState.RELEASED
    assert await asyncio.wait_for(waiting, 1) is akv.PinState.RELEASED
    hard = cache._core.hard_pins
    assert len(hard) == 0 and hard._timer is None
    await asyncio.sleep(0.08)  # past p1's deadline: no timer fires on a closed cache
    assert hard.counters.pins_expired == 0
    assert all(n.pins == 0 and n.host_pins == 0 for n in cache._tree.walk())
    with pytest.raises(akv.CacheClosedError):
        cache.unpin(p1)
    with pytest.raises(akv.CacheClosedError):
        cache.pin(a, ttl=1)


async def test_pins_refused_with_tensor_parallelism() -> None:
    from aiocache_kv.distributed.coordinator import AgreedCoordinator

    async with akv.HiCache(small_config()) as cache:
        a = toks(100, 2)
        await cached(cache, a)
        before = state(cache)
        core = cache._core
        real = core.coordinator
        core.coordinator = object.__new__(AgreedCoordinator)  # deferred = True
        try:
            with pytest.raises(akv.InvalidInputError, match="tensor parallelism"):
                cache.pin(a, ttl=1)
        finally:
            core.coordinator = real
        assert state(cache) == before


async def test_pin_metrics() -> None:
    if prometheus_client is None:
        pytest.skip("prometheus_client is not installed")
    from prometheus_client.parser import text_string_to_metric_families

    from aiocache_kv.metrics import CacheCollector

    async with akv.HiCache(small_config()) as cache:
        reg = prometheus_client.CollectorRegistry()
        CacheCollector(cache, registry=reg)
        a, b = toks(100, 3), toks(200, 2)
        await cached(cache, a)
        await cached(cache, b)
        cache.pin(a, ttl=60)
        hb = cache.pin(b, ttl=60, tier="host")
        short = cache.pin(b, ttl=0.01)
        await asyncio.wait_for(short.wait(), 5)
        cache.unpin(hb)
        text = prometheus_client.generate_latest(reg).decode()
        got = {
            (s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        }
        assert got[("aiocache_kv_pinned_pages", frozenset({("tier", "device")}))] == 3
        assert got[("aiocache_kv_pinned_pages", frozenset({("tier", "host")}))] == 0
        assert got[("aiocache_kv_pins_active", frozenset())] == 1
        assert got[("aiocache_kv_pins_total", frozenset())] == 3
        assert got[("aiocache_kv_pins_ended_total", frozenset({("outcome", "expired")}))] == 1
        assert got[("aiocache_kv_pins_ended_total", frozenset({("outcome", "released")}))] == 1


async def test_release_if_ends_the_pins_over_given_nodes() -> None:
    """What a purge uses before it removes nodes: every pin whose path meets them ends."""
    async with akv.HiCache(small_config()) as cache:
        a, b = toks(100, 2), toks(200, 2)
        await cached(cache, a)
        await cached(cache, b)
        pa = cache.pin(a, ttl=60)
        pb = cache.pin(b, ttl=60, tier="host")
        hard = cache._core.hard_pins
        assert hard.release_if(lambda node: node.key[0] == 200) == 1
        assert pb.state is akv.PinState.RELEASED and pa.state is akv.PinState.ACTIVE
        cache.check_invariants()
        assert hard.release_if(lambda node: False) == 0
        cache.unpin(pa)
        cache.check_invariants()


class _HashRaises(str):
    """A tier name whose own ``__hash__`` and ``__repr__`` raise (a hostile ``str``
    subclass)."""

    def __hash__(self) -> int:
        raise RuntimeError("the subclass's own hash was asked")

    def __repr__(self) -> str:
        raise RuntimeError("the subclass's own repr was asked")

    __eq__ = str.__eq__


async def test_tier_given_as_a_str_subclass_is_read_as_its_name() -> None:
    """pin, warm and evict look a tier name up by its characters, as drop does: the
    subclass's own hash never runs (before, its exception escaped untyped)."""
    async with akv.HiCache(small_config(max_pin_ttl=100.0)) as cache:
        a = toks(100, 2)
        await cached(cache, a)
        pin = cache.pin(a, ttl=1, tier=_HashRaises("device"))
        assert pin.tier is akv.Tier.DEVICE
        cache.unpin(pin)
        res = await cache.warm(a, tier=_HashRaises("host"))
        assert res.tokens == len(a)
        assert cache.evict(0, tier=_HashRaises("device")) == 0
        with pytest.raises(akv.InvalidInputError, match="'gpu'"):
            cache.pin(a, ttl=1, tier=_HashRaises("gpu"))
        with pytest.raises(akv.InvalidInputError, match="'storage'"):
            cache.evict(1, tier=_HashRaises("storage"))
        with pytest.raises(akv.InvalidInputError, match="'gpu'"):
            await cache.drop(a, tiers=[_HashRaises("gpu")])
        cache.check_invariants()
