"""aiocache_kv.metrics on a bare HiCache: families, values as data moves, the thread rule."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

import aiocache_kv as akv
from aiocache_kv.errors import MissingDependencyError
from aiocache_kv.telemetry import LatencyHistogram, PromptCounters, attribute
from tests.conftest import small_config
from tests.test_split_ack import insert

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from aiocache_kv.metrics import CacheCollector  # noqa: E402

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(registry: CollectorRegistry) -> tuple[dict[str, str], Samples]:
    """(family -> type, (sample, labels) -> value) of one scrape, parsed back."""
    text = generate_latest(registry).decode()
    types: dict[str, str] = {}
    samples: Samples = {}
    for fam in text_string_to_metric_families(text):
        types[fam.name] = fam.type
        for s in fam.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return types, samples


def val(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def test_latency_histogram_buckets() -> None:
    h = LatencyHistogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 1.0, 3.0):
        h.observe(v)
    snap = h.snapshot()
    assert snap.cumulative == (2, 4, 5)  # a value equal to a bound is inside it (le)
    assert snap.count == 5 and snap.sum == pytest.approx(4.65)
    with pytest.raises(akv.InvalidInputError):
        LatencyHistogram((1.0, 0.5))
    with pytest.raises(akv.InvalidInputError):
        LatencyHistogram(())


def test_attribution_sums_to_the_prompt() -> None:
    # a 32-token page-aligned prompt fully cached on device, page 8: the last page reruns
    a = attribute(32, 24, device=32, host=0, storage=0)
    assert (a.device, a.host, a.storage, a.computed, a.cached) == (24, 0, 0, 8, 24)
    # cut in tier order: device run, then host, then what a prefetch committed
    a = attribute(50, 40, device=16, host=16, storage=16)
    assert (a.device, a.host, a.storage, a.computed) == (16, 16, 8, 10)
    a = attribute(50, 0, device=0, host=0, storage=0)
    assert (a.cached, a.computed) == (0, 50)
    with pytest.raises(akv.InvalidInputError):
        attribute(10, 11, device=0, host=0, storage=0)
    c = PromptCounters()
    c.record(attribute(32, 24, device=32, host=0, storage=0))
    c.record(attribute(10, 0, device=0, host=0, storage=0))
    assert (c.prompts, c.device + c.host + c.storage + c.computed) == (2, 42)


async def test_collector_families_and_values_on_a_bare_cache() -> None:
    async with akv.HiCache(small_config(page_size=4, device_pages=8)) as cache:
        reg = CollectorRegistry()
        prompts = PromptCounters()
        CacheCollector(cache, registry=reg, prompts=prompts, labels={"rank": "0"})
        types, s = scrape(reg)
        assert types["aiocache_kv_hit_tokens"] == "counter"
        assert types["aiocache_kv_pool_pages"] == "gauge"
        assert types["aiocache_kv_load_back_seconds"] == "histogram"
        assert all(("rank", "0") in labels for _, labels in s)
        total = val(s, "aiocache_kv_pool_pages", rank="0", tier="device", state="total")
        assert total == 8
        assert val(s, "aiocache_kv_write_through_seconds_count", rank="0") == 0

        tokens = list(range(100, 116))
        r = insert(cache, tokens)
        assert r.write_through is not None
        await r.write_through
        cache.release(r)
        _, s = scrape(reg)
        assert val(s, "aiocache_kv_write_through_seconds_count", rank="0") == 1
        assert val(s, "aiocache_kv_write_through_seconds_bucket", rank="0", le="+Inf") == 1
        assert val(s, "aiocache_kv_event_queue_depth", rank="0") >= 2  # device + host stored
        d2h = val(s, "aiocache_kv_transfer_bytes_total", rank="0", direction="device_to_host")
        assert d2h == 4 * cache.config.page_bytes

        assert cache.evict(4) == 4
        m = cache.match_prefix(tokens)
        await cache.load_back(m)
        cache.release(m)
        cache.take_events()
        _, s = scrape(reg)
        assert val(s, "aiocache_kv_evicted_pages_total", rank="0", tier="device") == 4
        assert val(s, "aiocache_kv_hit_tokens_total", rank="0", tier="host") == 16
        assert val(s, "aiocache_kv_load_back_seconds_count", rank="0") == 1
        assert val(s, "aiocache_kv_load_back_seconds_sum", rank="0") > 0
        ok = val(
            s, "aiocache_kv_copies_finished_total", rank="0", direction="host_to_device",
            outcome="ok",
        )  # fmt: skip
        assert ok == 1
        assert val(s, "aiocache_kv_event_queue_depth", rank="0") == 0
        assert val(s, "aiocache_kv_match_queries_total", rank="0") == 1

        prompts.record(attribute(17, 16, device=0, host=16, storage=0))
        _, s = scrape(reg)
        assert val(s, "aiocache_kv_prompt_tokens_total", rank="0", source="host") == 16
        assert val(s, "aiocache_kv_prompt_tokens_total", rank="0", source="computed") == 1
        assert val(s, "aiocache_kv_prompts_total", rank="0") == 1


async def test_write_back_latency_and_demotion_count() -> None:
    async with akv.HiCache(small_config(write_policy="write_back")) as cache:
        reg = CollectorRegistry()
        CacheCollector(cache, registry=reg)
        cache.release(insert(cache, [1, 2, 3, 4]))
        assert cache.evict(2) == 0  # staged: demoted when the copy lands
        await cache.flush()
        _, s = scrape(reg)
        assert val(s, "aiocache_kv_write_back_seconds_count") == 1
        assert val(s, "aiocache_kv_write_through_seconds_count") == 0
        assert val(s, "aiocache_kv_evicted_pages_total", tier="device") == 2


async def test_storage_backup_and_prefetch_metrics(tmp_path: Path) -> None:
    tokens = list(range(1, 17))
    cfg = small_config(storage=akv.FileStorage(tmp_path), prefetch_threshold_tokens=2)
    async with akv.HiCache(cfg) as cache:
        reg = CollectorRegistry()
        CacheCollector(cache, registry=reg)
        cache.release(insert(cache, tokens))
        await cache.flush()
        _, s = scrape(reg)
        assert val(s, "aiocache_kv_backup_seconds_count") >= 1
        assert val(s, "aiocache_kv_storage_pages_total", op="backup_ok") == 8
        assert val(s, "aiocache_kv_transfer_bytes_total", direction="host_to_storage") == (
            8 * cache.config.page_bytes
        )
        cache.evict(8)
        cache.evict(8, "host")
        _, s = scrape(reg)
        assert val(s, "aiocache_kv_evicted_pages_total", tier="host") == 8
        res = await cache.prefetch(tokens)
        assert res.hit_tokens == 16
        _, s = scrape(reg)
        assert val(s, "aiocache_kv_prefetch_seconds_count") == 1
        assert val(s, "aiocache_kv_hit_tokens_total", tier="storage") == 16
        assert val(s, "aiocache_kv_transfer_bytes_total", direction="storage_to_host") == (
            8 * cache.config.page_bytes
        )
        assert val(s, "aiocache_kv_storage_errors_total") == 0


async def test_scrape_off_the_loop_thread_raises() -> None:
    async with akv.HiCache(small_config()) as cache:
        reg = CollectorRegistry()
        collector = CacheCollector(cache, registry=reg)
        with pytest.raises(akv.OwnershipError):
            await asyncio.to_thread(generate_latest, reg)
        with pytest.raises(akv.OwnershipError):
            await asyncio.to_thread(cache.statistics)
        names = await asyncio.to_thread(lambda: [m.name for m in collector.describe()])
        assert "aiocache_kv_hit_tokens" in names  # describe reads no cache state


def test_unstarted_cache_scrapes_zeros_and_bad_labels_raise() -> None:
    cache = akv.HiCache(small_config())
    reg = CollectorRegistry()
    CacheCollector(cache, registry=reg)
    _, s = scrape(reg)
    assert val(s, "aiocache_kv_pool_pages", tier="device", state="total") == 0
    with pytest.raises(akv.InvalidInputError):
        CacheCollector(cache, labels={"tier": "x"})
    with pytest.raises(akv.InvalidInputError):
        CacheCollector(cache, labels={"rank": 0})  # type: ignore[dict-item]


def test_without_prometheus_client(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    monkeypatch.setitem(sys.modules, "prometheus_client.core", None)
    with pytest.raises(MissingDependencyError, match=r"aiocache_kv\[metrics\]"):
        CacheCollector(akv.HiCache(small_config()))
    # the package and the module import without it
    code = (
        "import sys; sys.modules['prometheus_client'] = None\n"
        "import aiocache_kv, aiocache_kv.metrics, aiocache_kv.models\n"
        "assert 'prometheus_client.core' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
