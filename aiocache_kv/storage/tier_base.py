"""The storage tier's plumbing: the executor, per-page buffer views, keys and shards.

:class:`StorageTierBase` opens the backend, registers the host pools once, and maps a host
page of any pool (KV first, then each sidecar component) to its :class:`PageBuffer` and a page
hash to its storage key (namespace tag once, then the pool's suffix, with the tensor-parallel
shard).  The prefetch path (:mod:`.prefetch`) and the backup path (:mod:`.tier`) build on it.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import torch

from aiocache_kv.stats import StorageCounters
from aiocache_kv.storage.base import PageBuffer, StorageBackend
from aiocache_kv.storage.executor import StorageIO
from aiocache_kv.storage.integrity import FRAME_OVERHEAD
from aiocache_kv.storage.keys import storage_key

if TYPE_CHECKING:
    from aiocache_kv.core import CacheCore
    from aiocache_kv.namespace import Namespace

COMPONENT = "kv"


class StorageTierBase:
    """Executor, buffers and keys of one cache's storage tier."""

    def __init__(self, core: CacheCore, backend: StorageBackend) -> None:
        cfg = core.config
        self.core = core
        self.io = StorageIO(
            backend, workers=cfg.storage_workers, default_timeout=cfg.storage_timeout
        )
        #: per pool (KV first, then each sidecar component): one buffer view per host page
        self._buffers: list[list[PageBuffer]] = []
        group = core.tp_group
        #: each tensor-parallel rank stores its own shard of a page under its own keys
        shard = "" if group.world_size == 1 else f"-tp{group.rank}-{group.world_size}"
        names = [COMPONENT, *(c.name for c in cfg.components)]
        self._suffixes = [name + shard for name in names]
        page_size = cfg.page_size
        #: trailing-window components: (pool index, name, window pages)
        self._trailing = [
            (i + 1, c.name, c.window_pages(page_size))
            for i, c in enumerate(cfg.components)
            if c.window_pages(page_size)
        ]
        self._tasks: set[asyncio.Task[Any]] = set()
        self.counters = StorageCounters()

    async def start(self) -> None:
        """Open the backend, register the host pool once, build per-page buffer views.

        Raises:
            StorageUnavailableError / StorageTimeoutError: the backend cannot be opened.
        """
        pool = self.core.host_pool
        assert pool is not None, "a storage tier needs a host pool"
        await self.io.open()
        raws = [(pool.raw, pool.page_bytes)]
        raws += [(sc.host_raw, sc.page_bytes) for sc in self.core.sidecars]
        for raw, _ in raws:
            await self.io.register_buffer(raw)

        def views() -> list[list[PageBuffer]]:
            return [
                [PageBuffer.from_tensor(raw[i, : nbytes + FRAME_OVERHEAD]) for i in range(len(raw))]
                for raw, nbytes in raws
            ]

        self._buffers = await asyncio.to_thread(views)

    def _keys(self, ns: Namespace, hashes: list[int], pool: int = 0) -> list[str]:
        tag = ns.tag
        suffix = self._suffixes[pool]
        return [storage_key(tag, h, suffix) for h in hashes]

    def _bufs(self, pages: torch.Tensor, pool: int = 0) -> list[PageBuffer]:
        b = self._buffers[pool]
        return [b[i] for i in pages.tolist()]

    @property
    def pools(self) -> int:
        """KV plus sidecar components."""
        return len(self._suffixes)

    def _track(self, task: asyncio.Task[Any]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _quarantined(self) -> int:
        alloc = self.core.host_alloc
        return alloc.quarantined if alloc is not None else 0
