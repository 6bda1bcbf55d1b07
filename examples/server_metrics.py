"""What ``examples/server.py`` counts itself: requests by outcome, generated tokens, TTFT,
admission wait, returning prompts served from storage and KV events drained."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from aiocache_kv.serving import GenerationResult

__all__ = ["TTFT_BUCKETS", "ServerMetrics"]

TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ServerMetrics:
    """What the server counts itself, in the registry that also holds the cache's collector.

    The cache's own metrics (hits per tier, prompt tokens per source, bytes, latencies, pool
    pages, evictions, storage errors, operations in flight, the event queue) come from
    :class:`aiocache_kv.metrics.CacheCollector` and the engine's from :class:`EngineCollector`,
    registered once the cache and the engine are open.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "aiocache_kv_requests", "Generate requests by outcome.", ["outcome"], registry=registry
        )
        for outcome in ("ok", "bad_request", "error"):
            self.requests.labels(outcome=outcome)
        self.generated_tokens = Counter(
            "aiocache_kv_generated_tokens", "Tokens generated.", registry=registry
        )
        self.ttft = Histogram(
            "aiocache_kv_ttft_seconds",
            "Time to first token, per request.",
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.storage_served = Counter(
            "aiocache_kv_storage_served_requests",
            "Requests whose prompt was served in part from storage (a returning prompt).",
            registry=registry,
        )
        self.queued = Histogram(
            "aiocache_kv_admission_wait_seconds",
            "Time from arrival to joining the engine's batch, while the arrival prefetch runs.",
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.events = Counter(
            "aiocache_kv_events",
            "KV events drained by the server, by type and medium.",
            ["type", "medium"],
            registry=registry,
        )

    def record(self, result: GenerationResult) -> None:
        """Account one finished request (its prompt attribution is the engine's)."""
        self.requests.labels(outcome="ok").inc()
        self.observe(result)

    def observe(self, result: GenerationResult) -> None:
        """:meth:`record` but the request's outcome (a stream counts that once it ends)."""
        self.generated_tokens.inc(len(result.tokens))
        self.ttft.observe(result.ttft)
        self.queued.observe(result.queue_time)
        if result.attribution.storage:
            self.storage_served.inc()
