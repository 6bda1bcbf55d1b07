"""What ``aiocache-kv demo`` prints: one result per turn and the tables built from them.

:mod:`aiocache_kv.demo` plays the conversations (each round's turns batched through one
:class:`~aiocache_kv.serving.Engine`); this module only turns what it measured into text.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TextIO

from aiocache_kv.bench.report import table
from aiocache_kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from aiocache_kv.models.generate import Generation
from aiocache_kv.serving import EngineStatistics, GenerationResult
from aiocache_kv.stats import CacheStatistics

__all__ = [
    "DemoLog",
    "RoundStats",
    "TurnResult",
    "hits_line",
    "print_engine_statistics",
    "print_event_summary",
    "print_statistics",
    "print_ttft_by_source",
    "print_turns",
    "round_line",
]


@dataclass
class TurnResult:
    """One turn: generated alone without a cache, and with the cache in a batch of
    ``batch`` concurrent requests (one per conversation)."""

    node: str
    turn: int
    chat: str
    ref: Generation  #: ``reference_generate``: ``DynamicCache``, whole prompt, alone
    got: GenerationResult  #: ``Engine.generate``: TTFT from arrival, in the batch
    max_logit_diff: float
    batch: int = 1  #: requests the engine served concurrently with this one (itself included)

    @property
    def identical(self) -> bool:
        """The reply is token-identical with and without the cache."""
        return self.ref.tokens == self.got.tokens

    @property
    def source(self) -> str:
        """Where the deepest part of the reused prefix came from."""
        a = self.got.attribution
        if a.storage:
            return "storage"
        if a.host:
            return "host"
        if a.device:
            return "device"
        return "miss"


@dataclass(frozen=True)
class RoundStats:
    """What the engine did for one round (the difference of two ``statistics()``)."""

    requests: int
    steps: int  #: forward passes
    step_tokens: int  #: tokens run through the model (prefill chunks and decodes)
    slots: int  #: requests summed over the passes (``steps * mean batch size``)
    shared_in_flight: int  #: prompt tokens reused while another request computed them
    preemptions: int

    @classmethod
    def between(cls, before: EngineStatistics, after: EngineStatistics) -> RoundStats:
        """The engine's work from ``before`` to ``after``."""
        return cls(
            requests=after.finished - before.finished,
            steps=after.steps - before.steps,
            step_tokens=after.step_tokens - before.step_tokens,
            slots=round(after.batch_size.sum - before.batch_size.sum),
            shared_in_flight=after.shared_in_flight_tokens - before.shared_in_flight_tokens,
            preemptions=after.preemptions - before.preemptions,
        )


@dataclass
class DemoLog:
    """Everything the summary needs."""

    results: list[TurnResult] = field(default_factory=list)
    events: list[KVEvent] = field(default_factory=list)
    engines: list[tuple[str, EngineStatistics]] = field(default_factory=list)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _ratio(ref: float, got: float) -> str:
    return f"{ref / got:.1f}x" if got > 0 else "-"


def print_turns(results: Sequence[TurnResult], out: TextIO) -> None:
    """One row per conversation: prompt tokens reused per tier and computed, TTFT without the
    cache (alone) and with it (in the batch, from arrival: the time it queued for admission
    included), identity."""
    batch = max((r.batch for r in results), default=1)
    rows = [
        [
            r.chat,
            r.got.prompt_len,
            r.got.attribution.device,
            r.got.attribution.host,
            r.got.attribution.storage,
            r.got.attribution.computed,
            _ms(r.ref.ttft),
            _ms(r.got.ttft),
            _ms(r.got.queue_time),
            _ratio(r.ref.ttft, r.got.ttft),
            "yes" if r.identical else "NO",
            f"{r.max_logit_diff:.1e}",
        ]
        for r in results
    ]
    table(
        [
            "chat",
            "prompt",
            "device hit",
            "host hit",
            "storage hit",
            "computed",
            "TTFT no cache ms",
            f"TTFT cache ms (batch of {batch})",
            "of it queued ms",
            "speedup",
            "identical",
            "max |dlogit|",
        ],
        rows,
        out=out,
    )


def round_line(stats: RoundStats) -> str:
    """One line under a round's table: how the engine batched it."""
    per_pass = stats.slots / stats.steps if stats.steps else 0.0
    line = (
        f"  {stats.requests} concurrent requests in {stats.steps} forward passes "
        f"({per_pass:.1f} requests and {stats.step_tokens / max(stats.steps, 1):.0f} tokens "
        f"per pass)"
    )
    if stats.shared_in_flight:
        line += (
            f"; {stats.shared_in_flight} prompt tokens reused while another request computed them"
        )
    if stats.preemptions:
        line += f"; {stats.preemptions} preemptions"
    return line


def print_ttft_by_source(results: Sequence[TurnResult], out: TextIO) -> None:
    """Median TTFT without/with the cache, grouped by where the reused prefix came from."""
    rows: list[list[object]] = []
    for source in ("miss", "device", "host", "storage"):
        group = [r for r in results if r.source == source]
        if not group:
            continue
        ref = statistics.median(r.ref.ttft for r in group)
        got = statistics.median(r.got.ttft for r in group)
        rows.append(
            [
                source,
                len(group),
                round(statistics.mean(r.got.prompt_len for r in group)),
                round(statistics.mean(r.got.attribution.cached for r in group)),
                _ms(ref),
                _ms(got),
                _ratio(ref, got),
            ]
        )
    table(
        [
            "deepest tier hit",
            "turns",
            "mean prompt",
            "mean reused",
            "median TTFT no cache ms",
            "median TTFT cache ms (batched)",
            "speedup",
        ],
        rows,
        out=out,
    )


def print_event_summary(events: Sequence[KVEvent], out: TextIO) -> None:
    """KV events counted by type and medium (pages in brackets)."""
    counts: Counter[tuple[str, str]] = Counter()
    pages: Counter[tuple[str, str]] = Counter()
    for ev in events:
        if isinstance(ev, BlockStored):
            key = ("BlockStored", ev.medium)
            pages[key] += len(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            key = ("BlockRemoved", ev.medium)
            pages[key] += len(ev.block_hashes)
        else:
            assert isinstance(ev, AllBlocksCleared), ev
            key = ("AllBlocksCleared", "")
        counts[key] += 1
    table(
        ["event", "medium", "events", "pages"],
        [[k[0], k[1], counts[k], pages[k]] for k in sorted(counts)],
        out=out,
        align="llrr",
    )


def print_statistics(st: CacheStatistics, out: TextIO) -> None:
    """``statistics()``: the tiers, then the hit and traffic counters."""
    table(
        ["tier", "total", "free", "held", "evictable", "protected"],
        [
            [name, t.total_pages, t.free_pages, t.held_pages, t.evictable_pages, t.protected_pages]
            for name, t in (("device (L1)", st.device), ("host (L2)", st.host))
        ],
        out=out,
    )
    print(file=out)
    keys = (
        "match_queries",
        "hit_tokens_device",
        "hit_tokens_host",
        "inserted_tokens",
        "write_through_done",
        "load_back_done",
        "bytes_device_to_host",
        "bytes_host_to_device",
        "backup_pages_ok",
        "prefetch_queries",
        "prefetch_hit_tokens",
        "storage_errors",
        "events_published",
    )
    table(["counter", "value"], [[k, getattr(st, k)] for k in keys], out=out)


def print_engine_statistics(engines: Sequence[tuple[str, EngineStatistics]], out: TextIO) -> None:
    """``Engine.statistics()`` of each node: requests, forward passes, batch sizes."""
    rows = [
        [
            node,
            st.finished,
            st.steps,
            st.step_tokens,
            f"{st.batch_size.sum / st.steps:.1f}" if st.steps else "-",
            st.shared_in_flight_tokens,
            st.preemptions,
            _ms(st.step_seconds_total / st.steps) if st.steps else "-",
        ]
        for node, st in engines
    ]
    table(
        [
            "engine",
            "requests",
            "forward passes",
            "tokens run",
            "mean batch",
            "reused in flight",
            "preemptions",
            "mean pass ms",
        ],
        rows,
        out=out,
    )


def hits_line(results: Sequence[TurnResult], storage: bool) -> str:
    """Tokens hit per tier (the tiers this run has), and whether each of them served hits."""
    hits = {
        "device": sum(r.got.attribution.device for r in results),
        "host": sum(r.got.attribution.host for r in results),
    }
    if storage:
        hits["storage"] = sum(r.got.attribution.storage for r in results)
    idle = [k for k, v in hits.items() if not v]
    if not idle:
        verdict = "every tier served hits" if storage else "both tiers served hits (no storage)"
    else:
        verdict = f"no hits from {' or '.join(idle)} (pools too large for the workload?)"
    return (
        "tokens hit per tier: " + ", ".join(f"{k} {v}" for k, v in hits.items()) + f" - {verdict}"
    )
