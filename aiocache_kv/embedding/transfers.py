"""``StoreTransfers``: the embedding cache's global-store paths (push, fetch, slot release).

*Push.*  All of an ``insert_batch``'s entries, local hits included, go to the store in ONE
``put`` (the store keeps a key it already holds without moving its bytes; with
``check_existing=True`` ``MooncakeStorage.put`` asks ``batch_is_exist`` first, so its counters
tell re-sent from skipped).  The entries stay pinned until the worker has released their
slots - after a timeout or cancellation that is later than the caller's return, handled by a
cleanup task that awaits ``StorageIO.wait_released``.

*Fetch.*  Misses are fetched with one size lookup
(:func:`~aiocache_kv.embedding.remote.mooncake_object_sizes`) and ONE ``get_into``: each is
tabled as ``LOOKUP`` (no slot), then ``FILLING`` with a slot of exactly the object's size, then
``READY`` once the integrity trailer and the header check out.  On failure or cancellation
every ``LOOKUP`` entry is dropped at once and every ``FILLING`` slot once the worker released it.

Store faults never raise out of here: a failed push is counted and returned, a failed fetch is
a miss; both are logged once per call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import torch

from aiocache_kv.embedding.entries import Entry, EntryState
from aiocache_kv.embedding.keys import embedding_key
from aiocache_kv.embedding.layout import HEADER_BYTES, unpack_header
from aiocache_kv.embedding.pool import EntryPool
from aiocache_kv.embedding.remote import mooncake_object_sizes
from aiocache_kv.errors import StorageError
from aiocache_kv.logs import get_logger
from aiocache_kv.storage.base import PageBuffer
from aiocache_kv.storage.executor import StorageIO
from aiocache_kv.storage.mooncake import MooncakeStorage

__all__ = ["StoreTransfers"]

#: the cache's events keep the logger name they had when this code lived in cache.py
log = get_logger("aiocache_kv.embedding.cache")


class StoreTransfers:
    """Push and fetch of pool entries through ``io`` (``None``: local-only, no store calls).

    ``cleanups`` holds the tasks that wait for workers to release slots (see
    :meth:`after_release`); the cache waits for them on close.
    """

    def __init__(
        self,
        pool: EntryPool,
        io: StorageIO | None,
        store: MooncakeStorage | None,
        *,
        namespace: str,
        dtype: torch.dtype,
    ) -> None:
        self.pool = pool
        self.io = io
        self.store = store
        self.namespace = namespace
        self.dtype = dtype
        self.counters = pool.counters
        self.cleanups: set[asyncio.Task[None]] = set()

    async def push(self, batch: list[Entry]) -> int:
        """One put of every entry in ``batch``; returns how many the store did not confirm.
        Unpins the entries once no worker holds their slots (maybe after returning)."""
        assert self.io is not None
        io = self.io
        bufs = [e.buffer for e in batch if e.buffer is not None]
        self.counters["pushed"] += len(batch)
        failed = len(batch)
        try:
            ok = await io.put([e.key for e in batch], bufs)
            failed = sum(1 for x in ok if not x)
        except StorageError as exc:
            self.counters["store_errors"] += 1
            log.warning(
                "embedding.push_failed", entries=len(batch), error=f"{type(exc).__name__}: {exc}"
            )
        finally:

            def unpin_all() -> None:
                for e in batch:
                    self.pool.unpin(e)

            self.after_release(bufs, unpin_all)
        self.counters["push_failed"] += failed
        return failed

    async def fetch(self, hs: list[bytes], found: dict[bytes, torch.Tensor | None]) -> None:
        """Fetch ``hs`` (absent locally) from the store into the pool; fill ``found``."""
        assert self.io is not None and self.store is not None
        io, store, pool = self.io, self.store, self.pool
        loop = asyncio.get_running_loop()
        entries = []
        for h in hs:
            key = embedding_key(self.namespace, h, self.dtype)
            e = Entry(h, key, EntryState.LOOKUP, loop.create_future())
            pool.entries[h] = e
            entries.append(e)
            found[h] = None
        keys = [e.key for e in entries]
        filling: list[Entry] = []
        try:
            try:
                sizes = await io.call("emb_sizes", mooncake_object_sizes, store, keys)
            except StorageError as exc:
                self._store_error("sizes", exc, len(keys))
                sizes = [-1] * len(keys)
            for e, size in zip(entries, sizes, strict=True):
                offset = pool.reserve(size) if pool.plausible(size) else None
                if offset is None:
                    if size > 0:
                        why = "get_no_space" if pool.plausible(size) else "get_invalid"
                        self.counters[why] += 1
                    pool.drop(e)
                    continue
                e.offset = offset
                e.buffer = pool.slot(offset, size)
                e.transition(EntryState.FILLING)
                filling.append(e)
            if not filling:
                return
            bufs = [e.buffer for e in filling if e.buffer is not None]
            try:
                ok = await io.get_into([e.key for e in filling], bufs)
            except StorageError as exc:
                self._store_error("get", exc, len(filling))
                ok = [False] * len(filling)
            if io.holds(bufs):  # only after a timeout: a worker still writes into the slots
                return
            for e, good in zip(filling, ok, strict=True):
                assert e.buffer is not None
                shape = unpack_header(bytes(e.buffer.view[:HEADER_BYTES]), e.buffer.nbytes)
                if not good or shape is None or shape.dtype != self.dtype:
                    if good:
                        self.counters["get_invalid"] += 1
                    pool.drop(e)
                    continue
                e.shape = shape
                e.transition(EntryState.READY)
                pool.lru_add(e)
                found[e.hash] = pool.read(e)
                self.counters["get_store_hits"] += 1
            filling = []
        finally:
            for e in entries:
                if e.state is EntryState.LOOKUP:
                    pool.drop(e)
            held = [e for e in filling if e.state is EntryState.FILLING]
            if held:

                def drop_held() -> None:
                    for e in held:
                        if e.state is EntryState.FILLING:
                            pool.drop(e)

                self.after_release([e.buffer for e in held if e.buffer is not None], drop_held)

    def _store_error(self, what: str, exc: StorageError, n: int) -> None:
        self.counters["store_errors"] += 1
        log.warning(
            "embedding.fetch_failed", step=what, entries=n, error=f"{type(exc).__name__}: {exc}"
        )

    def after_release(self, bufs: list[PageBuffer], then: Callable[[], Any]) -> None:
        """Run ``then`` now if no worker holds ``bufs``, else once the worker released them."""
        if self.io is None or not self.io.holds(bufs):
            then()
            return
        io = self.io

        async def wait_then() -> None:
            await io.wait_released(bufs)
            then()

        task = asyncio.get_running_loop().create_task(wait_then(), name="aiocache-kv-emb-release")
        self.cleanups.add(task)
        task.add_done_callback(self.cleanups.discard)
