"""The loop-owned radix tree of token pages."""

from aiocache_kv.tree.node import Node, Tier, TierState
from aiocache_kv.tree.radix import Eviction, InsertOutcome, RadixTree

__all__ = ["Eviction", "InsertOutcome", "Node", "RadixTree", "Tier", "TierState"]
