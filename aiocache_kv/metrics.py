"""Prometheus metrics of a cache, read at scrape time (needs ``aiocache_kv[metrics]``).

:class:`CacheCollector` is a ``prometheus_client`` collector: every scrape takes one
:meth:`~aiocache_kv.HiCache.statistics` snapshot and turns it into counters, gauges and
histograms.  Nothing is added to the cache's hot path: the counters are the ones the cache
keeps anyway, and the latency histograms are fixed-bucket arrays the cache fills when an
operation ends (:mod:`aiocache_kv.telemetry`).

Collect on the loop thread.  The snapshot reads loop-owned state, so a scrape from any other
thread (e.g. ``prometheus_client.start_http_server``'s) raises ``OwnershipError``.  Serve
``/metrics`` from a handler on the cache's loop instead::

    registry = CollectorRegistry()
    CacheCollector(cache, registry=registry, prompts=lm.prompt_tokens)

    async def metrics(request):  # an aiohttp handler: runs on the loop
        return web.Response(body=generate_latest(registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

Exported (every name starts with ``aiocache_kv_``; counters end in ``_total``, latencies are
``_seconds`` histograms, bytes ``_bytes_total``): hit tokens per tier, prompt tokens per
source (when the serving loop's :class:`~aiocache_kv.telemetry.PromptCounters` are given),
bytes per direction, copies, storage pages and errors, evictions per tier (and per tenant for
its quota, with its pages per tier, when quotas are configured), pool pages per tier
and state, operations in flight, the KV event queue, and load-back / write-through /
write-back / backup / prefetch latency.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from aiocache_kv.errors import InvalidInputError, MissingDependencyError
from aiocache_kv.stats import CacheStatistics, TierStatistics
from aiocache_kv.telemetry import HistogramSnapshot, PromptCounters

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import CollectorRegistry

    from aiocache_kv.cache import HiCache

PREFIX = "aiocache_kv_"
#: a Prometheus label name (names starting with ``__`` are reserved, refused apart)
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
#: ``statistics().latency`` key -> histogram name (without the prefix)
LATENCY_METRICS = {
    "load_back": ("load_back_seconds", "A load-back copy (host -> device), submit to applied."),
    "write_through": (
        "write_through_seconds",
        "A write-through copy (device -> host), submit to applied.",
    ),
    "write_back": (
        "write_back_seconds",
        "A write-back staging copy of an eviction victim (device -> host), submit to applied.",
    ),
    "backup": ("backup_seconds", "A storage backup (host -> storage), start to applied."),
    "prefetch": (
        "prefetch_seconds",
        "A prefetch that went to storage (storage -> host), reservation to commit.",
    ),
}
POOL_STATES = ("total", "free", "held", "evictable", "protected", "quarantined", "retained")


def prometheus_core() -> Any:
    """``prometheus_client.core``, imported on first use.

    Raises:
        MissingDependencyError: ``prometheus_client`` is not installed.
    """
    try:
        import prometheus_client.core as core
    except ImportError as exc:
        raise MissingDependencyError(
            "aiocache_kv.metrics needs prometheus_client: pip install 'aiocache_kv[metrics]'"
        ) from exc
    return core


class CacheCollector:
    """A ``prometheus_client`` collector over one :class:`~aiocache_kv.HiCache`.

    Args:
        cache: the cache to report (started or not: an unstarted cache reports zeros).
        prompts: the serving loop's prompt attribution (e.g. ``CachedLM.prompt_tokens``);
            without it ``aiocache_kv_prompt_tokens_total`` is not exported.
        labels: constant labels added to every sample, e.g. ``{"rank": "0"}``.  A registry
            holds one collector (two would export the same families, which the registry
            refuses): give each cache its own registry.
        registry: register into this ``CollectorRegistry`` at once.

    Raises:
        MissingDependencyError: ``prometheus_client`` is not installed.
        InvalidInputError: a label name that is not a string, not a valid Prometheus label
            name (``[a-zA-Z_][a-zA-Z0-9_]*``, not starting with ``__``), or clashes with the
            metrics' own (``tenant`` included); a value that is not a string.
    """

    def __init__(
        self,
        cache: HiCache,
        *,
        prompts: PromptCounters | None = None,
        labels: Mapping[str, str] | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self._prom = prometheus_core()
        self.cache = cache
        self.prompts = prompts
        self.labels = dict(labels or {})
        reserved = {"tier", "state", "source", "direction", "outcome", "op", "kind", "le"}
        reserved |= {"tenant", "quantile"}
        bad = [
            k
            for k in self.labels
            if not isinstance(k, str)
            or k in reserved
            or not _LABEL_NAME.fullmatch(k)
            or k.startswith("__")
        ]
        if bad or not all(isinstance(v, str) for v in self.labels.values()):
            raise InvalidInputError(
                f"labels must map str to str, names matching {_LABEL_NAME.pattern} (not "
                f"starting with '__') and not using {sorted(reserved)}: bad {bad!r} in "
                f"{self.labels!r}"
            )
        if registry is not None:
            registry.register(self)

    # ------------------------------------------------------------------ prometheus_client API

    def describe(self) -> Iterator[Metric]:
        """The metric families without samples (reads no cache state: safe on any thread)."""
        yield from self._families(None)

    def collect(self) -> Iterator[Metric]:
        """One snapshot's metric families (on the loop thread: ``OwnershipError`` elsewhere)."""
        yield from self._families(self.cache.statistics())

    # ------------------------------------------------------------------ families

    def _families(self, st: CacheStatistics | None) -> Iterator[Metric]:
        prom = self._prom
        const = list(self.labels)
        cvals = list(self.labels.values())
        cfg = self.cache.config
        payload = cfg.page_bytes + sum(c.page_bytes for c in cfg.components)

        def family(
            kind: str, name: str, doc: str, label: str | None, samples: list[tuple[str, int]]
        ) -> Metric:
            cls = prom.CounterMetricFamily if kind == "counter" else prom.GaugeMetricFamily
            names = const + ([label] if label else [])
            fam = cls(PREFIX + name, doc, labels=names)
            if st is not None:
                for value_label, value in samples:
                    fam.add_metric(cvals + ([value_label] if label else []), value)
            metric: Metric = fam
            return metric

        def one(kind: str, name: str, doc: str, value: int) -> Metric:
            return family(kind, name, doc, None, [("", value)])

        s = st if st is not None else _ZERO
        yield one("counter", "match_queries", "match_prefix calls.", s.match_queries)
        yield family(
            "counter",
            "hit_tokens",
            "Tokens found per tier: device and host by match_prefix, storage committed by "
            "prefetch.",
            "tier",
            [
                ("device", s.hit_tokens_device),
                ("host", s.hit_tokens_host),
                ("storage", s.prefetch_hit_tokens),
            ],
        )
        yield one("counter", "inserted_tokens", "Tokens added to the tree.", s.inserted_tokens)
        if self.prompts is not None:
            p = self.prompts
            yield one("counter", "prompts", "Prompts the serving loop attributed.", p.prompts)
            yield family(
                "counter",
                "prompt_tokens",
                "Prompt tokens by where their KV came from; cached (device + host + storage) "
                "plus computed equals the prompt tokens.",
                "source",
                [
                    ("device", p.device),
                    ("host", p.host),
                    ("storage", p.storage),
                    ("computed", p.computed),
                ],
            )
        yield family(
            "counter",
            "transfer_bytes",
            "Bytes moved between tiers (storage directions: KV and sidecar payload of whole "
            "pages, without framing).",
            "direction",
            [
                ("device_to_host", s.bytes_device_to_host),
                ("host_to_device", s.bytes_host_to_device),
                ("host_to_storage", s.backup_pages_ok * payload),
                ("storage_to_host", s.prefetch_hit_tokens // cfg.page_size * payload),
            ],
        )
        yield family(
            "counter",
            "copies_started",
            "Device <-> host copies started.",
            "direction",
            [("device_to_host", s.write_through_started), ("host_to_device", s.load_back_started)],
        )
        copies = prom.CounterMetricFamily(
            PREFIX + "copies_finished",
            "Device <-> host copies applied, by outcome.",
            labels=[*const, "direction", "outcome"],
        )
        if st is not None:
            for direction, ok, failed in (
                ("device_to_host", s.write_through_done, s.write_through_failed),
                ("host_to_device", s.load_back_done, s.load_back_failed),
            ):
                copies.add_metric([*cvals, direction, "ok"], ok)
                copies.add_metric([*cvals, direction, "failed"], failed)
        yield copies
        yield one(
            "counter",
            "write_through_skipped_pages",
            "Pages not written to host because the host pool was full.",
            s.write_through_skipped_pages,
        )
        yield one("counter", "backups", "Storage backups started.", s.backup_started)
        yield one("counter", "prefetches", "Prefetches with a storage tier.", s.prefetch_queries)
        yield one(
            "counter",
            "prefetch_storage_hit_tokens",
            "Tokens storage reported present to prefetches.",
            s.prefetch_storage_hit_tokens,
        )
        yield family(
            "counter",
            "storage_pages",
            "Storage tier pages: backed up, failed, skipped while backing off, prefetched "
            "but discarded, prefetched but failing their verification at load-back.",
            "op",
            [
                ("backup_ok", s.backup_pages_ok),
                ("backup_failed", s.backup_pages_failed),
                ("backup_skipped", s.backup_skipped_pages),
                ("prefetch_discarded", s.prefetch_pages_discarded),
                ("load_back_corrupt", s.load_back_corrupt_pages),
            ],
        )
        yield one("counter", "storage_errors", "Failed storage operations.", s.storage_errors)
        yield family(
            "counter",
            "evicted_pages",
            "Pages whose copy in a tier was dropped by eviction (storage: the backend "
            "reported it evicted).",
            "tier",
            [
                ("device", s.evicted_pages_device),
                ("host", s.evicted_pages_host),
                ("storage", s.evicted_pages_storage),
            ],
        )
        yield one("counter", "drops", "Drops (cache.drop) that removed something.", s.drops)
        yield family(
            "counter",
            "dropped_pages",
            "Pages removed by drops, per tier (storage: keys removed, any node's).",
            "tier",
            [
                ("device", s.dropped_pages_device),
                ("host", s.dropped_pages_host),
                ("storage", s.dropped_pages_storage),
            ],
        )
        yield one(
            "counter",
            "zeroized_bytes",
            "Bytes of freed device and host pages overwritten with zeros by drops.",
            s.zeroized_bytes,
        )
        yield family(
            "counter",
            "drop_races",
            "Work a drop overtook: prefetches that committed nothing, late puts removed.",
            "kind",
            [("prefetch", s.prefetch_dropped), ("late_put", s.late_puts_removed)],
        )
        yield family(
            "counter",
            "quota_evictions",
            "Pages evicted to bring a tenant down to its quota, per tenant.",
            "tenant",
            sorted(s.quota_evictions.items()),
        )
        yield one(
            "counter",
            "quota_evictions_other_tenants",
            "Quota evictions of tenants no longer counted by name (past 1,024 names: those "
            "holding no page, without a quota of their own).",
            s.quota_evictions_folded,
        )
        tenant_pages = prom.GaugeMetricFamily(
            PREFIX + "tenant_pages",
            "Pages per tenant per tier (kept when per-tenant quotas are configured).",
            labels=[*const, "tenant", "tier"],
        )
        for tenant, tiers_of in sorted(s.tenant_pages.items()):
            for tier_name, n in tiers_of.items():
                tenant_pages.add_metric([*cvals, tenant, tier_name], n)
        yield tenant_pages
        pool = prom.GaugeMetricFamily(
            PREFIX + "pool_pages", "Pages per pool by state.", labels=[*const, "tier", "state"]
        )
        if st is not None:
            tiers: tuple[tuple[str, TierStatistics], ...] = (
                ("device", st.device),
                ("host", st.host),
            )
            for tier, t in tiers:
                for state in POOL_STATES:
                    pool.add_metric([*cvals, tier, state], getattr(t, f"{state}_pages"))
        yield pool
        yield one("gauge", "tree_nodes", "Nodes in the radix tree.", s.nodes)
        yield one("gauge", "namespaces", "Namespaces with nodes or handles.", s.namespaces)
        yield family(
            "gauge",
            "operations_in_flight",
            "Device <-> host copies, storage backups and background prefetches, and storage "
            "calls worker threads still run (late ones included), in flight.",
            "kind",
            [
                ("copy", s.ops_in_flight),
                ("storage", s.storage_in_flight),
                ("storage_call", s.storage_calls_running),
            ],
        )
        yield one(
            "gauge",
            "prefetch_reserved_pages",
            "Host pages reserved by prefetches in flight.",
            s.prefetch_reserved_pages,
        )
        yield family(
            "gauge",
            "pinned_pages",
            "Pages under a hard pin (cache.pin), per tier, each page once.",
            "tier",
            [("device", s.pinned_pages_device), ("host", s.pinned_pages_host)],
        )
        yield one("gauge", "pins_active", "Hard pins in force.", s.active_pins)
        yield one("counter", "pins", "Hard pins taken (cache.pin).", s.pins_created)
        yield family(
            "counter",
            "pins_ended",
            "Hard pins ended, by outcome: released (unpin or close) or expired (ttl).",
            "outcome",
            [("released", s.pins_released), ("expired", s.pins_expired)],
        )
        yield one("counter", "warms", "Warm-ups (cache.warm, one per prompt).", s.warms)
        yield one(
            "counter",
            "warms_cut_short",
            "Warm-ups ended by their timeout or cancelled.",
            s.warms_cut_short,
        )
        yield one(
            "counter",
            "warm_storage_tokens",
            "Tokens warm-ups brought in from storage.",
            s.warm_storage_tokens,
        )
        yield one("counter", "events_published", "KV events published.", s.events_published)
        yield one("counter", "events_dropped", "KV events dropped (buffer full).", s.events_dropped)
        yield one(
            "gauge", "event_queue_depth", "KV events buffered, not yet consumed.", s.events_pending
        )
        for key, (name, doc) in LATENCY_METRICS.items():
            hist = prom.HistogramMetricFamily(PREFIX + name, doc, labels=const)
            snap = st.latency.get(key) if st is not None else None
            if snap is not None:
                hist.add_metric(cvals, histogram_buckets(snap), snap.sum)
            yield hist


def histogram_buckets(snap: HistogramSnapshot) -> list[tuple[str, float]]:
    """``snap`` as ``prometheus_client`` histogram buckets (cumulative, then ``+Inf``)."""
    out = [(repr(float(b)), float(n)) for b, n in zip(snap.buckets, snap.cumulative, strict=False)]
    out.append(("+Inf", float(snap.count)))
    return out


def _zero_tier() -> TierStatistics:
    return TierStatistics(0, 0, 0, 0, 0)


_ZERO = CacheStatistics(
    device=_zero_tier(),
    host=_zero_tier(),
    nodes=0,
    namespaces=0,
    match_queries=0,
    hit_tokens_device=0,
    hit_tokens_host=0,
    inserted_tokens=0,
    write_through_started=0,
    write_through_done=0,
    write_through_failed=0,
    write_through_skipped_pages=0,
    load_back_started=0,
    load_back_done=0,
    load_back_failed=0,
    bytes_device_to_host=0,
    bytes_host_to_device=0,
    ops_in_flight=0,
    events_published=0,
)

__all__ = ["LATENCY_METRICS", "CacheCollector", "histogram_buckets", "prometheus_core"]
