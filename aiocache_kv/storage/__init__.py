"""Storage tier (L3): backends behind one blocking Protocol, and the async executor facade.

``FileStorage`` (embedded default) and ``MooncakeStorage`` (distributed) implement
:class:`StorageBackend`; the cache drives them through :class:`StorageIO`.  Keys are made by
:func:`storage_key`; every stored page carries the :mod:`integrity` trailer
(:data:`FRAME_OVERHEAD` bytes at the end of each page slot).
"""

from aiocache_kv.storage.base import (
    ChainAwareStorage,
    PageBuffer,
    StorageBackend,
    StorageStats,
    leading_run,
)
from aiocache_kv.storage.executor import StorageIO, StorageIOStats
from aiocache_kv.storage.file import FileStorage, FsyncPolicy
from aiocache_kv.storage.integrity import FRAME_OVERHEAD, Verdict, payload_nbytes
from aiocache_kv.storage.keys import ParsedKey, parse_storage_key, storage_key
from aiocache_kv.storage.mooncake import MooncakeNotInstalledError, MooncakeStorage

__all__ = [
    "FRAME_OVERHEAD",
    "ChainAwareStorage",
    "FileStorage",
    "FsyncPolicy",
    "MooncakeNotInstalledError",
    "MooncakeStorage",
    "PageBuffer",
    "ParsedKey",
    "StorageBackend",
    "StorageIO",
    "StorageIOStats",
    "StorageStats",
    "Verdict",
    "leading_run",
    "parse_storage_key",
    "payload_nbytes",
    "storage_key",
]
