"""Per-tenant quotas (issue #26): a tenant over its budget evicts its own pages first, a
quota change takes effect at once, a flooding tenant cannot flush another's working set."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

import aiocache_kv as akv
from aiocache_kv.errors import ConfigError, InvalidInputError, InvalidTypeError
from aiocache_kv.quotas import TenantQuota
from aiocache_kv.storage import FileStorage, PageBuffer
from aiocache_kv.storage.keys import storage_key
from tests.conftest import small_config
from tests.test_split_ack import write_kv

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from aiocache_kv.metrics import CacheCollector  # noqa: E402


async def put(
    cache: akv.HiCache, tokens: list[int], tenant: str, *, keep: bool = False, seed: int = 0
) -> akv.InsertResult:
    """Insert ``tokens`` for ``tenant``, wait for the write-through, release unless ``keep``."""
    slots = cache.alloc(len(tokens))
    write_kv(cache, slots, seed)
    r = cache.insert(tokens, slots, tenant=tenant)
    if r.write_through is not None:
        await r.write_through
    if not keep:
        cache.release(r)
    return r


def device_len(cache: akv.HiCache, tokens: list[int], tenant: str) -> int:
    m = cache.match_prefix(tokens, tenant=tenant)
    n = m.device_len
    cache.release(m)
    return n


def seq(i: int, pages: int = 2) -> list[int]:
    return [1000 * i + k for k in range(2 * pages)]  # page_size 2


async def test_over_budget_tenant_evicts_its_own_pages_first() -> None:
    cfg = small_config(tenant_quotas={"a": TenantQuota(device_pages=4)})
    async with akv.HiCache(cfg) as cache:
        for i in range(2):  # b: older than all of a's pages, and unlimited
            await put(cache, seq(100 + i), "b")
        for i in range(3):
            await put(cache, seq(i), "a")
            cache.check_invariants()
        assert cache.tenant_usage("a")["device"] == 4
        assert cache.tenant_usage("b")["device"] == 4
        # a's least recently used sequence went (demoted: it has a host copy), b kept all
        assert [device_len(cache, seq(i), "a") for i in range(3)] == [0, 4, 4]
        assert [device_len(cache, seq(100 + i), "b") for i in range(2)] == [4, 4]
        st = cache.statistics()
        assert st.quota_evictions == {"a": 2}
        assert st.tenant_pages["a"] == {"device": 4, "host": 6}
        cache.check_invariants()


async def test_default_quota_applies_to_tenants_without_their_own() -> None:
    cfg = small_config(
        default_tenant_quota=TenantQuota(device_pages=2),
        tenant_quotas={"vip": TenantQuota()},
    )
    async with akv.HiCache(cfg) as cache:
        for i in range(3):
            await put(cache, seq(i), "")
            await put(cache, seq(10 + i), "vip")
        assert cache.tenant_usage("")["device"] == 2
        assert cache.tenant_usage("vip")["device"] == 6
        assert cache.tenant_quota("x") == TenantQuota(device_pages=2)
        assert cache.tenant_quota("vip") == TenantQuota()
        cache.check_invariants()


async def test_host_budget_deletes_the_tenants_host_only_pages() -> None:
    cfg = small_config(tenant_quotas={"a": TenantQuota(device_pages=2, host_pages=4)})
    async with akv.HiCache(cfg) as cache:
        for i in range(4):
            await put(cache, seq(i), "a")
        await asyncio.sleep(0)  # the pass the demotions scheduled (call_soon) has run
        usage = cache.tenant_usage("a")
        assert usage["device"] <= 2 and usage["host"] <= 4, usage
        cache.check_invariants()


async def test_quota_lowered_while_over_takes_effect_at_once() -> None:
    async with akv.HiCache(small_config()) as cache:
        for i in range(3):
            await put(cache, seq(i), "a")
            await put(cache, seq(10 + i), "b")
        assert cache.tenant_usage("a")["device"] == 6
        assert cache.statistics().tenant_pages == {}  # no quota yet: no ledger
        cache.set_tenant_quota("a", TenantQuota(device_pages=2))
        assert cache.tenant_usage("a")["device"] == 2  # synchronously
        assert device_len(cache, seq(2), "a") == 4  # the most recent stayed
        assert cache.tenant_usage("b")["device"] == 6
        assert cache.statistics().quota_evictions == {"a": 4}
        cache.check_invariants()
        cache.set_tenant_quota("a", None)  # back to no budget: nothing more goes
        await put(cache, seq(3), "a")
        assert cache.tenant_usage("a")["device"] == 4
        cache.check_invariants()


async def test_pinned_pages_are_best_effort_then_go_when_released() -> None:
    cfg = small_config(tenant_quotas={"a": TenantQuota(device_pages=2)})
    async with akv.HiCache(cfg) as cache:
        held = [await put(cache, seq(i), "a", keep=True) for i in range(3)]
        assert cache.tenant_usage("a")["device"] == 6  # pinned: nothing could go
        await put(cache, seq(50), "b")
        # the pool is short: an over-budget tenant's pages go before anyone else's, even
        # b's older ones (released synchronously, before the scheduled pass runs)
        for r in held:
            cache.release(r)
        free = cache.statistics().device.free_pages
        slots = cache.alloc(free + 2)  # needs 2 pages evicted
        assert device_len(cache, seq(50), "b") == 4
        cache.free(slots)
        await asyncio.sleep(0)  # the pass the unpins scheduled (call_soon)
        assert cache.tenant_usage("a")["device"] <= 2
        cache.check_invariants()


async def test_two_tenants_a_flood_does_not_flush_a_working_set_within_quota() -> None:
    seed = random.randrange(1 << 30)

    async def hit_rate(quotas: dict[str, TenantQuota], flood: bool) -> float:
        rng = random.Random(seed)
        cfg = small_config(device_pages=32, host_pages=32, tenant_quotas=quotas)
        async with akv.HiCache(cfg) as cache:
            working = [seq(i) for i in range(6)]  # 12 pages
            hits = total = 0
            fresh = 10_000
            for rnd in range(6):
                order = list(working)
                rng.shuffle(order)
                for toks in order:
                    m = cache.match_prefix(toks, tenant="small")
                    if rnd:  # after a warm-up round
                        hits += m.matched_len
                        total += len(toks)
                    cache.release(m)
                    await put(cache, toks, "small")
                    for _ in range(3 if flood else 0):
                        fresh += 1
                        await put(cache, seq(fresh, pages=4), "flood")
                cache.check_invariants()
            return hits / total

    quotas = {"flood": TenantQuota(device_pages=12, host_pages=12)}
    alone = await hit_rate({}, flood=False)
    flooded = await hit_rate({}, flood=True)
    protected = await hit_rate(quotas, flood=True)
    print(f"hit rates: alone {alone:.3f} flooded {flooded:.3f} with quotas {protected:.3f}")
    assert alone == 1.0, f"seed {seed}"
    assert flooded < 0.5, f"seed {seed}: the flood should hurt without quotas ({flooded})"
    assert protected >= 0.8 * alone, f"seed {seed}: {protected} with quotas vs {alone} alone"


async def test_hostile_quota_inputs_change_nothing() -> None:
    with pytest.raises(InvalidInputError, match="device_pages"):
        TenantQuota(device_pages=-1)
    with pytest.raises(InvalidInputError, match="host_pages"):
        TenantQuota(host_pages=True)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="storage_pages"):
        TenantQuota(storage_pages=1.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="tenant_quotas"):
        small_config(tenant_quotas={"a": 3})
    with pytest.raises(ConfigError, match="tenant_quotas"):
        small_config(tenant_quotas={7: TenantQuota()})
    with pytest.raises(ConfigError, match="default_tenant_quota"):
        small_config(default_tenant_quota={"device_pages": 3})
    async with akv.HiCache(small_config()) as cache:
        await put(cache, seq(0), "a")
        before = cache.statistics()
        with pytest.raises(InvalidTypeError, match="tenant"):
            cache.set_tenant_quota(5, TenantQuota(device_pages=0))  # type: ignore[arg-type]
        with pytest.raises(InvalidTypeError, match="quota"):
            cache.set_tenant_quota("a", {"device_pages": 0})  # type: ignore[arg-type]
        with pytest.raises(InvalidTypeError, match="tenant"):
            cache.tenant_usage(None)  # type: ignore[arg-type]
        after = cache.statistics()
        assert after == before
        assert cache.tenant_usage("unknown") == {"device": 0, "host": 0}
        cache.check_invariants()


async def test_quota_metrics_are_exported() -> None:
    cfg = small_config(tenant_quotas={"a": TenantQuota(device_pages=2)})
    async with akv.HiCache(cfg) as cache:
        registry = prometheus_client.CollectorRegistry()
        CacheCollector(cache, registry=registry)
        for i in range(2):
            await put(cache, seq(i), "a")
        text = prometheus_client.generate_latest(registry).decode()
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        }
        assert samples[("aiocache_kv_quota_evictions_total", (("tenant", "a"),))] == 2
        key = ("aiocache_kv_tenant_pages", (("tenant", "a"), ("tier", "device")))
        assert samples[key] == 2


# ---------------------------------------------------------------------- storage budgets


def _chain(tag: str, n: int, seed: int) -> tuple[list[str], list[str | None]]:
    keys = [storage_key(tag, bytes([seed, i]) * 16) for i in range(n)]
    return keys, [None, *keys[:-1]]


def _bufs(n: int) -> list[PageBuffer]:
    return [PageBuffer.allocate(256) for _ in range(n)]


def test_file_storage_evicts_a_tenants_oldest_pages_over_its_budget(tmp_path: Path) -> None:
    store = FileStorage(tmp_path, capacity_bytes=None)
    store.open()
    store.tag_tenant("ta", "a")
    store.tag_tenant("ta2", "a")  # another model or adapter of the same tenant
    store.tag_tenant("tb", "b")
    store.set_storage_quotas(None, {"a": 3})
    a_keys, a_parents = _chain("ta", 3, 1)
    assert store.put_chain(a_keys, _bufs(3), a_parents) == [True] * 3
    b_keys, b_parents = _chain("tb", 5, 2)
    assert store.put_chain(b_keys, _bufs(5), b_parents) == [True] * 5
    a2_keys, a2_parents = _chain("ta2", 2, 3)
    store.put_chain(a2_keys, _bufs(2), a2_parents)
    # a is over by 2: its oldest chain's ends went, b kept everything
    assert store.tenant_pages("a") == 3 and store.tenant_pages("b") == 5
    assert store.exists(a_keys) == [True, False, False]
    assert sorted(store.take_evicted()) == sorted(a_keys[1:])
    store.check_index()
    store.set_storage_quotas(1, {"b": None})  # a now has the default: at the next put
    assert store.tenant_pages("a") == 3
    store.put_chain(*_chain("tb", 1, 4)[:1], _bufs(1), [None])
    assert store.tenant_pages("a") == 1 and store.tenant_pages("b") == 6
    store.close()
    again = FileStorage(tmp_path, capacity_bytes=None)  # tags come back from the headers
    again.open()
    again.tag_tenant("ta", "a")
    again.tag_tenant("ta2", "a")
    assert again.tenant_pages("a") == 1
    again.check_index()
    again.close()


def test_storage_quota_inputs_are_checked(tmp_path: Path) -> None:
    store = FileStorage(tmp_path)
    with pytest.raises(InvalidInputError, match="-1"):
        store.set_storage_quotas(-1, {})
    with pytest.raises(InvalidInputError, match="'a'"):
        store.set_storage_quotas(None, {"a": 1.5})  # type: ignore[dict-item]
    with pytest.raises(InvalidTypeError):
        store.tag_tenant("t", None)  # type: ignore[arg-type]


async def test_cache_tells_file_storage_its_tenants_budgets(tmp_path: Path) -> None:
    store = FileStorage(tmp_path)
    cfg = small_config(storage=store, tenant_quotas={"a": TenantQuota(storage_pages=4)})
    async with akv.HiCache(cfg) as cache:
        for i in range(4):
            await put(cache, seq(i), "a")
            await put(cache, seq(10 + i), "b")
        await cache.flush()
        assert await asyncio.to_thread(store.tenant_pages, "a") == 4
        assert await asyncio.to_thread(store.tenant_pages, "b") == 8
        assert cache.statistics().evicted_pages_storage == 4
        cache.set_tenant_quota("b", TenantQuota(storage_pages=2))  # at b's next backup
        await put(cache, seq(20), "b")
        await cache.flush()
        assert await asyncio.to_thread(store.tenant_pages, "b") == 2
        cache.check_invariants()
