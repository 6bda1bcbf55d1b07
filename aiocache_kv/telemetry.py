"""What the cache measures about itself besides its counters: latencies and prompt attribution.

Everything here is plain Python, owned by the event loop like the rest of the cache's state
(docs/ARCHITECTURE.md, rule 1): no locks, no dependency.  :class:`LatencyHistogram` is a
fixed-bucket histogram that costs one bisect and two additions per observation; the cache
observes into it when an operation ends (a device<->host copy is applied, a storage backup is
applied, a prefetch finishes).  :class:`PromptCounters` count where the KV of the prompts a
serving loop ran came from (device / host / storage hit, or computed), the way vLLM reports
``cached_tokens`` per request; the serving loop owns them, since only it knows what its model
recomputed.

:mod:`aiocache_kv.metrics` exports all of it, with the counters of
:meth:`~aiocache_kv.HiCache.statistics`, to Prometheus.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

from aiocache_kv.errors import InvalidInputError

#: upper bounds (seconds) of the latency buckets: 100 us .. 10 s
LATENCY_BUCKETS: tuple[float, ...] = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    """A histogram at one moment: cumulative counts per upper bound, then ``+Inf``."""

    buckets: tuple[float, ...]
    cumulative: tuple[int, ...]  #: one per bucket, then one for ``+Inf`` (== count)
    count: int
    sum: float


class LatencyHistogram:
    """A fixed-bucket histogram of seconds (on the loop; no lock)."""

    __slots__ = ("_counts", "buckets", "count", "sum")

    def __init__(self, buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        bounds = tuple(float(b) for b in buckets)
        if not bounds or list(bounds) != sorted(set(bounds)):
            raise InvalidInputError(f"buckets must be increasing and distinct, got {buckets!r}")
        self.buckets = bounds
        self._counts = [0] * (len(bounds) + 1)  # the last one: above every bound
        self.count = 0
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        """Record one duration."""
        self._counts[bisect.bisect_left(self.buckets, seconds)] += 1
        self.count += 1
        self.sum += seconds

    def snapshot(self) -> HistogramSnapshot:
        """Cumulative counts (Prometheus ``le`` semantics: a value equal to a bound is in it)."""
        acc = 0
        cumulative = []
        for n in self._counts:
            acc += n
            cumulative.append(acc)
        return HistogramSnapshot(self.buckets, tuple(cumulative), self.count, self.sum)


@dataclass(frozen=True, slots=True)
class PromptAttribution:
    """Where one prompt's KV came from; ``cached + computed == prompt`` always."""

    prompt: int
    device: int  #: tokens reused from a device hit
    host: int  #: ... from a host hit (loaded back)
    storage: int  #: ... from storage (prefetched to host, then loaded back)
    computed: int  #: tokens the model ran in the prefill

    @property
    def cached(self) -> int:
        """Tokens not recomputed (vLLM's ``cached_tokens``)."""
        return self.device + self.host + self.storage


def attribute(
    prompt: int, reused: int, *, device: int, host: int, storage: int
) -> PromptAttribution:
    """Split the ``reused`` leading prompt tokens over the tiers their hits came from.

    A cached prefix is a device run, then a host run, then what a prefetch committed after
    them; ``device``/``host``/``storage`` are those runs' lengths at match time.  The model
    never reuses more than ``reused`` tokens (the last prompt token always runs, so a fully
    cached prompt still recomputes its last page), so the hits are cut at ``reused`` in that
    order and the rest of the prompt is ``computed``.

    Raises:
        InvalidInputError: a count that is not an int >= 0, or ``reused`` outside
            ``[0, prompt]``.
    """
    counts = (prompt, reused, device, host, storage)
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in counts)
    if not ints or min(counts) < 0 or reused > prompt:
        raise InvalidInputError(
            f"bad attribution: prompt={prompt} reused={reused} device={device} host={host} "
            f"storage={storage}"
        )
    dev = min(device, reused)
    hst = min(host, reused - dev)
    sto = min(storage, reused - dev - hst)
    return PromptAttribution(prompt, dev, hst, sto, prompt - dev - hst - sto)


@dataclass(slots=True)
class PromptCounters:
    """Prompt tokens by source, summed over the prompts a serving loop recorded.

    The serving loop owns these (it alone knows what its model recomputed): e.g.
    :attr:`aiocache_kv.models.CachedLM.prompt_tokens`.  Update them on the loop thread.
    """

    prompts: int = 0
    device: int = 0
    host: int = 0
    storage: int = 0
    computed: int = 0

    def record(self, attribution: PromptAttribution) -> None:
        """Count one prompt's attribution (once per request)."""
        self.prompts += 1
        self.device += attribution.device
        self.host += attribution.host
        self.storage += attribution.storage
        self.computed += attribution.computed


@dataclass(slots=True)
class Latencies:
    """A cache's latency histograms (loop-owned), observed when each operation ends."""

    #: a load-back copy (host -> device), from submission until it is applied
    load_back: LatencyHistogram = field(default_factory=LatencyHistogram)
    #: a write-through copy (device -> host), from submission until it is applied
    write_through: LatencyHistogram = field(default_factory=LatencyHistogram)
    #: a write-back staging copy (device -> host of an eviction victim)
    write_back: LatencyHistogram = field(default_factory=LatencyHistogram)
    #: a storage backup (host -> storage), from its start until its verdicts are applied
    backup: LatencyHistogram = field(default_factory=LatencyHistogram)
    #: a prefetch that went to storage, from its reservation until it committed
    prefetch: LatencyHistogram = field(default_factory=LatencyHistogram)

    def snapshot(self) -> dict[str, HistogramSnapshot]:
        """Every histogram by name (the field names above)."""
        return {
            "load_back": self.load_back.snapshot(),
            "write_through": self.write_through.snapshot(),
            "write_back": self.write_back.snapshot(),
            "backup": self.backup.snapshot(),
            "prefetch": self.prefetch.snapshot(),
        }


__all__ = [
    "LATENCY_BUCKETS",
    "HistogramSnapshot",
    "Latencies",
    "LatencyHistogram",
    "PromptAttribution",
    "PromptCounters",
    "attribute",
]
