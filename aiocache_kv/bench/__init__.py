"""Benchmarks behind ``aiocache-kv bench``: the radix tree and the device<->host copy path.

Each suite module has an options dataclass and a ``run(options) -> dict`` that prints its
tables and returns JSON-able results; :mod:`aiocache_kv.bench.report` holds the shared
printing and JSON helpers.
"""

from __future__ import annotations

SUITES = ("tree", "transfer")

__all__ = ["SUITES"]
