"""OpenTelemetry spans around prefetch, load-back and backup, recorded by the real SDK."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import aiocache_kv as akv
from aiocache_kv import tracing
from aiocache_kv.storage import FileStorage
from tests.conftest import small_config
from tests.test_split_ack import insert

_EXPORTER = InMemorySpanExporter()


@pytest.fixture(scope="module", autouse=True)
def provider() -> None:
    """One SDK provider for the process (OpenTelemetry allows setting it once)."""
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        tp = TracerProvider()
        tp.add_span_processor(SimpleSpanProcessor(_EXPORTER))
        trace.set_tracer_provider(tp)


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    _EXPORTER.clear()
    yield _EXPORTER
    _EXPORTER.clear()


def cfg(path: Path) -> akv.CacheConfig:
    return small_config(
        storage=FileStorage(path, capacity_bytes=None),
        prefetch_threshold_tokens=0,
        prefetch_policy="wait_complete",
        host_pages=32,
    )


async def test_a_request_trace_shows_its_cache_steps(
    tmp_path: Path, spans: InMemorySpanExporter
) -> None:
    prompt = list(range(30, 38))  # 4 pages of 2
    async with akv.HiCache(cfg(tmp_path)) as cache:
        cache.release(insert(cache, prompt))
        await cache.flush()
    backups = [s for s in spans.get_finished_spans() if s.name == "aiocache_kv.backup"]
    assert len(backups) == 1 and backups[0].attributes is not None
    assert backups[0].attributes["aiocache_kv.pages"] == 4
    assert backups[0].attributes["aiocache_kv.pages_ok"] == 4
    spans.clear()
    tracer = trace.get_tracer("serving-loop")
    async with akv.HiCache(cfg(tmp_path)) as cache:  # a fresh node: storage -> host -> device
        with tracer.start_as_current_span("request") as request:
            res = await cache.prefetch(prompt)
            with cache.match_prefix(prompt) as m:
                await cache.load_back(m)
                assert m.device_len == 8
    by_name = {s.name: s for s in spans.get_finished_spans()}
    assert {"request", "aiocache_kv.prefetch", "aiocache_kv.load_back"} <= set(by_name)
    req_id = request.get_span_context().span_id
    for name in ("aiocache_kv.prefetch", "aiocache_kv.load_back"):
        parent = by_name[name].parent
        assert parent is not None and parent.span_id == req_id, name
    pf = by_name["aiocache_kv.prefetch"].attributes
    assert pf is not None
    assert pf["aiocache_kv.hit_tokens"] == res.hit_tokens == 8
    assert pf["aiocache_kv.status"] == "complete"
    lb = by_name["aiocache_kv.load_back"].attributes
    assert lb is not None and lb["aiocache_kv.pages"] == 4


async def test_a_failed_load_back_marks_its_span(spans: InMemorySpanExporter) -> None:
    engine = akv.testing.ManualCopyEngine()
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        r = insert(cache, [1, 2, 3, 4])
        engine.complete_all()
        await cache.flush()
        cache.release(r)
        assert cache.evict(2, tier="device") == 2  # demoted: host only
        with cache.match_prefix([1, 2, 3, 4]) as m:
            task = asyncio.ensure_future(cache.load_back(m))
            await asyncio.sleep(0)
            engine.fail(0)
            with pytest.raises(akv.TransferError):
                await task
    (lb,) = [s for s in spans.get_finished_spans() if s.name == "aiocache_kv.load_back"]
    assert not lb.status.is_ok and lb.events and lb.events[0].name == "exception"


async def test_without_opentelemetry_nothing_breaks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spans: InMemorySpanExporter
) -> None:
    monkeypatch.setattr(tracing, "_otel", None)
    assert not tracing.enabled()
    async with akv.HiCache(cfg(tmp_path)) as cache:
        cache.release(insert(cache, [1, 2, 3, 4]))
        await cache.flush()
        res = await cache.prefetch([1, 2, 3, 4, 5, 6])
        assert res.cached_tokens == 4
    assert spans.get_finished_spans() == ()


def test_no_span_is_made_without_a_tracer_provider(monkeypatch: pytest.MonkeyPatch) -> None:
    """Until the application sets a provider, OpenTelemetry's proxy would hand out
    non-recording spans: nothing would be recorded, so the cache makes none (it is on the
    loop, per backup and prefetch).  Once a provider is set, spans are made again."""
    with tracing.span("aiocache_kv.test", pages=1) as sp:
        assert sp is not tracing._NO_SPAN  # the module's SDK provider is set
    monkeypatch.setattr(tracing._otel, "get_tracer_provider", trace.ProxyTracerProvider)
    with tracing.span("aiocache_kv.test", pages=1) as sp:
        assert sp is tracing._NO_SPAN
