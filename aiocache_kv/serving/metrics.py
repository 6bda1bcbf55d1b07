"""Prometheus metrics of an engine, read at scrape time (needs ``aiocache_kv[metrics]``).

:class:`EngineCollector` turns one :meth:`Engine.statistics` snapshot per scrape into metric
families named like the cache's (``aiocache_kv_engine_*``; counters end in ``_total``,
latencies are ``_seconds`` histograms).  The prompt tokens by source (device / host /
storage / computed) come from the cache's collector, given the engine's counters::

    registry = CollectorRegistry()
    CacheCollector(cache, registry=registry, prompts=engine.counters.prompt_tokens)
    EngineCollector(engine, registry=registry)

Collect on the loop thread (an aiohttp handler), as for :class:`CacheCollector`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from aiocache_kv.metrics import PREFIX, histogram_buckets, prometheus_core
from aiocache_kv.serving.stats import EngineStatistics

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import CollectorRegistry

    from aiocache_kv.serving.engine import Engine

__all__ = ["EngineCollector"]

E = PREFIX + "engine_"
#: histogram attribute -> (metric name without the prefix, help)
HISTOGRAMS = {
    "queue": ("queue_seconds", "Arrival to joining the batch, per request."),
    "ttft": ("ttft_seconds", "Arrival to the first generated token, per request."),
    "itl": ("inter_token_seconds", "Between consecutive generated tokens of a request."),
    "step": ("step_seconds", "One forward pass of the batch."),
    "batch_size": ("batch_size", "Requests in one forward pass."),
    "tokens_per_step": (
        "tokens_per_step",
        "Tokens (prefill chunks and decodes) in one forward pass.",
    ),
}


class EngineCollector:
    """A ``prometheus_client`` collector over one engine.

    Raises:
        MissingDependencyError: ``prometheus_client`` is not installed.
    """

    def __init__(self, engine: Engine, *, registry: CollectorRegistry | None = None) -> None:
        self._prom = prometheus_core()
        self.engine = engine
        if registry is not None:
            registry.register(self)

    def describe(self) -> Iterator[Metric]:
        """The families without samples (reads nothing: safe on any thread)."""
        yield from self._families(None)

    def collect(self) -> Iterator[Metric]:
        """One snapshot's families (on the loop thread)."""
        yield from self._families(self.engine.statistics())

    def _families(self, st: EngineStatistics | None) -> Iterator[Metric]:
        prom = self._prom
        requests = prom.CounterMetricFamily(
            E + "requests", "Requests by outcome (submitted counts every one).", labels=["outcome"]
        )
        queued = prom.GaugeMetricFamily(E + "requests_now", "Requests by state.", labels=["state"])
        if st is not None:
            for outcome in ("submitted", "finished", "aborted", "failed"):
                requests.add_metric([outcome], getattr(st, outcome))
            for state in ("waiting", "admitting", "running"):
                queued.add_metric([state], getattr(st, state))
        yield requests
        yield queued
        for name, doc in (
            ("steps", "Forward passes."),
            ("generated_tokens", "Tokens generated."),
            ("step_tokens", "Tokens run through the model (prefill chunks and decodes)."),
            ("preemptions", "Requests taken out of the batch for room (they resume)."),
            ("restarts", "Requests re-admitted because a prefix they extended was dropped."),
            (
                "storage_reads_cancelled",
                "Storage reads cancelled for a running request short of rows.",
            ),
            ("inserted_pages", "Pages put into the tree while their requests ran."),
            ("shared_in_flight_tokens", "Prompt tokens reused from another running request."),
        ):
            c = prom.CounterMetricFamily(E + name, doc)
            if st is not None:
                c.add_metric([], getattr(st, name))
            yield c
        for attr, (name, doc) in HISTOGRAMS.items():
            h = prom.HistogramMetricFamily(E + name, doc)
            if st is not None:
                snap = getattr(st, attr)
                h.add_metric([], histogram_buckets(snap), snap.sum)
            yield h
