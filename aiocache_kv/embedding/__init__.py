"""Multimodal embedding cache: a local pool of per-item embeddings over a global store.

``EmbeddingCache`` (cache.py: the facade, lifecycle and batch validation via checks.py) keeps
``num_tokens x dim`` tensors keyed by the caller's content hash in one host pool (pool.py: the
table, LRU and pins; allocator.py: variable-size extents; entries.py: per-entry state), pushes
every inserted entry to the Mooncake store in one batch per request and reads misses back with
one batched get (transfers.py: the store paths; remote.py: object sizes; layout.py: the
self-describing slot).
"""

from aiocache_kv.embedding.allocator import ExtentAllocator
from aiocache_kv.embedding.cache import EmbeddingCache
from aiocache_kv.embedding.entries import Entry, EntryState
from aiocache_kv.embedding.errors import DuplicateHashError, EmbeddingMismatchError
from aiocache_kv.embedding.keys import canonical_hashes, embedding_key
from aiocache_kv.embedding.layout import HEADER_BYTES, EntryShape, slot_nbytes
from aiocache_kv.embedding.stats import EmbeddingCacheStats, InsertBatchStats

__all__ = [
    "HEADER_BYTES",
    "DuplicateHashError",
    "EmbeddingCache",
    "EmbeddingCacheStats",
    "EmbeddingMismatchError",
    "Entry",
    "EntryShape",
    "EntryState",
    "ExtentAllocator",
    "InsertBatchStats",
    "canonical_hashes",
    "embedding_key",
    "slot_nbytes",
]
