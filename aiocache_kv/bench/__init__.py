"""Benchmarks behind ``aiocache-kv bench``: the radix tree, the device<->host copy path and
the storage tier (L3) against its raw backend.

Each suite module has an options dataclass and a ``run(options) -> dict`` that prints its
tables and returns JSON-able results; :mod:`aiocache_kv.bench.report` holds the shared
printing and JSON helpers.
"""

from __future__ import annotations

SUITES = ("tree", "transfer", "storage")

__all__ = ["SUITES"]
