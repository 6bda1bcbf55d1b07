"""aiocache_kv: an asyncio-native hierarchical KV-cache runtime for LLM serving.

The public contract (see docs/ARCHITECTURE.md): :class:`CacheConfig`, :class:`HiCache`, the handles
it returns, the KV events and the error hierarchy in :mod:`aiocache_kv.errors`.
"""

from aiocache_kv.blocks import BlockInfo, page_hashes
from aiocache_kv.cache import HiCache
from aiocache_kv.components import Component, HitPolicy, Indexer, MambaState, SlidingWindow
from aiocache_kv.config import CacheConfig, PrefetchPolicy, WritePolicy
from aiocache_kv.distributed import AgreementError, SingleRank, TorchTPGroup, TPGroup
from aiocache_kv.embedding import EmbeddingCache, InsertBatchStats
from aiocache_kv.errors import (
    BlockingCallError,
    CacheClosedError,
    CapacityError,
    ConfigError,
    DropIncompleteError,
    EngineClosedError,
    HandleError,
    HostMemoryError,
    InvalidInputError,
    InvalidTypeError,
    KVCacheError,
    NotCachedError,
    OwnershipError,
    PinLimitError,
    PrefixDroppedError,
    StorageError,
    StorageKeyError,
    StorageTimeoutError,
    StorageUnavailableError,
    TransferError,
)
from aiocache_kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from aiocache_kv.handles import InsertResult, MatchResult, WriteAck
from aiocache_kv.hardpins import CachePin, PinState
from aiocache_kv.namespace import Namespace
from aiocache_kv.purge import DropResult
from aiocache_kv.quotas import TenantQuota
from aiocache_kv.stats import CacheStatistics, TierStatistics
from aiocache_kv.storage import FileStorage, MooncakeStorage, StorageBackend
from aiocache_kv.storage.tier import PrefetchResult, PrefetchStatus
from aiocache_kv.tree import Tier, TierState
from aiocache_kv.warm import WarmResult

__version__ = "0.1.0.dev0"

__all__ = [
    "AgreementError",
    "AllBlocksCleared",
    "BlockInfo",
    "BlockRemoved",
    "BlockStored",
    "BlockingCallError",
    "CacheClosedError",
    "CacheConfig",
    "CachePin",
    "CacheStatistics",
    "CapacityError",
    "Component",
    "ConfigError",
    "DropIncompleteError",
    "DropResult",
    "EmbeddingCache",
    "EngineClosedError",
    "FileStorage",
    "HandleError",
    "HiCache",
    "HitPolicy",
    "HostMemoryError",
    "Indexer",
    "InsertBatchStats",
    "InsertResult",
    "InvalidInputError",
    "InvalidTypeError",
    "KVCacheError",
    "KVEvent",
    "MambaState",
    "MatchResult",
    "MooncakeStorage",
    "Namespace",
    "NotCachedError",
    "OwnershipError",
    "PinLimitError",
    "PinState",
    "PrefetchPolicy",
    "PrefetchResult",
    "PrefetchStatus",
    "PrefixDroppedError",
    "SingleRank",
    "SlidingWindow",
    "StorageBackend",
    "StorageError",
    "StorageKeyError",
    "StorageTimeoutError",
    "StorageUnavailableError",
    "TPGroup",
    "TenantQuota",
    "Tier",
    "TierState",
    "TierStatistics",
    "TorchTPGroup",
    "TransferError",
    "WarmResult",
    "WriteAck",
    "WritePolicy",
    "__version__",
    "page_hashes",
]
