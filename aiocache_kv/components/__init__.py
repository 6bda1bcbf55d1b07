"""Sidecar components of hybrid models (SWA, Mamba state, DSA indexer)."""

from aiocache_kv.components.spec import (
    Component,
    HitPolicy,
    Indexer,
    MambaState,
    SlidingWindow,
)
from aiocache_kv.components.usable import feasible_ends, usable_end

__all__ = [
    "Component",
    "HitPolicy",
    "Indexer",
    "MambaState",
    "SlidingWindow",
    "feasible_ends",
    "usable_end",
]
