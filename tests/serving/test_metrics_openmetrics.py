"""The library's collectors render in OpenMetrics, the format Prometheus negotiates by default,
and ``prometheus_client``'s own OpenMetrics parser reads them back (it refuses two families of
one name: the engine's counter and histogram of tokens per step once shared one)."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.exposition import generate_latest
from prometheus_client.openmetrics.parser import text_string_to_metric_families

import aiocache_kv as akv
from aiocache_kv.metrics import CacheCollector
from aiocache_kv.models import GPT2Spec, build_gpt2
from aiocache_kv.serving import Engine
from aiocache_kv.serving.metrics import EngineCollector
from tests.serving.test_engine import VOCAB, config, toks


@pytest.fixture(scope="module")
def gpt2() -> Any:
    spec = GPT2Spec(n_layer=2, n_head=4, n_embd=64, vocab_size=VOCAB, n_positions=512, seed=3)
    return build_gpt2(spec)


async def test_engine_and_cache_collectors_parse_as_openmetrics(gpt2: Any) -> None:
    async with akv.HiCache(config(gpt2)) as cache, Engine(gpt2, cache) as eng:
        registry = CollectorRegistry()
        EngineCollector(eng, registry=registry)
        CacheCollector(cache, registry=registry)
        await eng.generate(toks(1, 12), max_new_tokens=3)
        text = generate_latest(registry).decode()
    families = list(text_string_to_metric_families(text))
    names = [f.name for f in families]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    by_name = {f.name: f for f in families}
    steps = by_name["aiocache_kv_engine_tokens_per_step"]
    assert steps.type == "histogram"
    count = next(s.value for s in steps.samples if s.name.endswith("_count"))
    assert count == by_name["aiocache_kv_engine_steps"].samples[0].value > 0
