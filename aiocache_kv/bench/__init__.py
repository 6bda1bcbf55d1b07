"""Benchmarks behind ``aiocache-kv bench``: the radix tree, the device<->host copy path, the
storage tier (L3) against its raw backend, the embedding cache and end-to-end TTFT.

Each suite module has an options dataclass and a ``run(options) -> dict`` that prints its
tables and returns JSON-able results; :mod:`aiocache_kv.bench.report` holds the shared
printing and JSON helpers.
"""

from __future__ import annotations

#: every suite, in the order ``aiocache-kv bench`` (``all``) runs them, with one line of help
SUITE_HELP = {
    "tree": "radix tree insert/match/evict against targets",
    "transfer": "device<->host page copies and event-loop lag",
    "storage": "storage tier (L3) through the cache vs the raw backend (file, mooncake)",
    "embedding": "embedding cache vs the raw Mooncake client, two nodes",
    "e2e": "time to first token vs cached prefix length, per tier (GPT-2)",
}
SUITES = tuple(SUITE_HELP)

__all__ = ["SUITES", "SUITE_HELP"]
