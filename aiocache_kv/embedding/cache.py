"""``EmbeddingCache``: a node-local pool of multimodal embeddings over a global store.

Design
------
*One owner.*  The table (hash -> :class:`~aiocache_kv.embedding.entries.Entry`), the LRU of
evictable entries and the pool allocator are touched only by synchronous code on the event-loop
thread.  Store calls run on :class:`~aiocache_kv.storage.executor.StorageIO` workers; a worker
only reads or writes the bytes of the slots it was handed.

*Layout.*  One host tensor of ``pool_bytes`` (pinned when CUDA is present), registered once with
the Mooncake client, so every put and get is zero-copy from / into it.  An entry occupies one
64-byte aligned extent: ``[header 64 B | data | integrity trailer 40 B]``
(:mod:`~aiocache_kv.embedding.layout`); the stored object is exactly that slot, so its size and
the header tell a reader everything.

*Plan, then I/O.*  Each public call validates everything first (a bad batch changes nothing),
then makes all its state changes in one synchronous step that returns the I/O still to do, and
only then awaits.

*insert_batch.*  After waiting out any entry of the batch that is being filled from the store,
or being pushed by another call (so two inserts of one hash neither store nor send it twice),
the plan copies each new tensor into a fresh slot *synchronously* (the entry is born ``READY``:
complete before anyone can see it), counts entries already cached as local hits, and skips
entries that do not fit even after evicting every unpinned entry (LRU order).  Then all of the
batch's entries, local hits included, go to the store in ONE ``put``: the global copy may have
been evicted or lost with a restarted master, and ``MooncakeStorage.put`` asks
``batch_is_exist`` first and sends only the keys the store lacks, so a local hit costs a
metadata lookup, not its bytes.  The entries are pinned (not evictable, their slots not reused)
until the worker has released them - after a timeout or cancellation that is later than the
caller's return, handled by a cleanup task that awaits ``StorageIO.wait_released``.

*get_batch.*  Local ``READY`` entries are copied out at once.  The rest are fetched with one
size lookup (:func:`~aiocache_kv.embedding.remote.mooncake_object_sizes`) and ONE
``get_into``: each is tabled as ``LOOKUP`` (no slot), then ``FILLING`` with a slot of exactly
the object's size, then ``READY`` once the integrity trailer and the header check out.  Other
tasks that ask for the same hash meanwhile wait for the entry to settle instead of fetching it
again; a reader never copies out of a ``FILLING`` slot.  On failure or cancellation every
``LOOKUP`` entry is dropped at once and every ``FILLING`` slot once the worker released it.

Store faults never raise out of ``insert_batch``/``get_batch``: a failed push is counted
(``InsertBatchStats.push_failed``), a failed fetch is a miss; both are logged once per call.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from aiocache_kv.embedding.allocator import ExtentAllocator
from aiocache_kv.embedding.entries import Entry, EntryState
from aiocache_kv.embedding.errors import DuplicateHashError, EmbeddingMismatchError
from aiocache_kv.embedding.keys import canonical_hashes, embedding_key
from aiocache_kv.embedding.layout import (
    DTYPE_CODES,
    HEADER_BYTES,
    EntryShape,
    pack_header,
    unpack_header,
)
from aiocache_kv.embedding.remote import mooncake_object_sizes
from aiocache_kv.embedding.stats import EmbeddingCacheStats, InsertBatchStats
from aiocache_kv.errors import (
    CacheClosedError,
    ConfigError,
    InvalidInputError,
    InvalidTypeError,
    OwnershipError,
    StorageError,
    StorageKeyError,
)
from aiocache_kv.logs import get_logger
from aiocache_kv.storage.base import PageBuffer
from aiocache_kv.storage.executor import StorageIO
from aiocache_kv.storage.integrity import FRAME_OVERHEAD
from aiocache_kv.storage.mooncake import MooncakeStorage

__all__ = ["EmbeddingCache"]

log = get_logger(__name__)

#: a get_batch re-examines hashes whose fetch (by another task) failed at most this often
_MAX_GET_ROUNDS = 3
_ALIGNMENT = 64


class _Life(enum.Enum):
    NEW = "new"
    STARTING = "starting"
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"


_COUNTERS = (
    "insert_calls",
    "insert_new",
    "insert_local_hits",
    "insert_skipped",
    "pushed",
    "push_failed",
    "get_calls",
    "get_local_hits",
    "get_store_hits",
    "get_misses",
    "get_no_space",
    "get_invalid",
    "evictions",
    "evicted_bytes",
    "store_errors",
)


class EmbeddingCache:
    """Multimodal embedding cache: a local pool of ``num_tokens x dim`` tensors keyed by
    content hash, backed by a global Mooncake store (or local-only with ``store=None``).

    Use it from one event loop: ``async with EmbeddingCache(...) as emb:`` (or let the first
    call start it, and ``await emb.aclose()``).  Closing closes the store client too (which
    drops the objects held in its own segment).
    """

    def __init__(
        self,
        pool_bytes: int,
        dtype: torch.dtype = torch.float32,
        store: MooncakeStorage | None = None,
        *,
        namespace: str = "default",
        timeout: float = 5.0,
        workers: int = 2,
        pin_memory: bool | None = None,
    ) -> None:
        """Validate the configuration (no allocation, no I/O: safe on the loop).

        Args:
            pool_bytes: size of the local pool; entries need ``64 + bytes + 40`` each,
                rounded up to 64.
            dtype: element type of every embedding.
            store: the global store, or ``None`` for a local-only cache.
            namespace: storage tag of the embedding namespace (e.g. the encoder name); the
                charset of storage tags (``[A-Za-z0-9][A-Za-z0-9._-]*``, <= 64 chars).
            timeout: deadline in seconds of each store call.
            workers: store worker threads.
            pin_memory: page-lock the pool (default: when CUDA is available).

        Raises:
            ConfigError: a bad size, dtype, namespace, timeout, store type or worker count.
        """
        if isinstance(pool_bytes, bool) or not isinstance(pool_bytes, int) or pool_bytes <= 0:
            raise ConfigError(f"pool_bytes must be a positive int, got {pool_bytes!r}")
        if not isinstance(dtype, torch.dtype) or dtype not in DTYPE_CODES:
            raise ConfigError(
                f"dtype must be one of {sorted(str(d) for d in DTYPE_CODES)}, got {dtype!r}"
            )
        if store is not None and not isinstance(store, MooncakeStorage):
            raise ConfigError(
                f"store must be a MooncakeStorage or None, got {type(store).__name__}"
            )
        try:
            embedding_key(namespace, b"probe")
        except StorageKeyError as exc:
            raise ConfigError(f"namespace {namespace!r} is not a valid storage tag: {exc}") from exc
        if not timeout > 0:
            raise ConfigError(f"timeout must be > 0, got {timeout}")
        self.pool_bytes = pool_bytes
        self.dtype = dtype
        self.namespace = namespace
        self.timeout = float(timeout)
        self._store = store
        self._io = (
            StorageIO(store, workers=workers, default_timeout=timeout, name="aiocache-kv-emb")
            if store is not None
            else None
        )
        self._pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._life = _Life.NEW
        self._starting: asyncio.Future[None] | None = None
        self._owner: int | None = None
        self._pool = torch.empty(0, dtype=torch.uint8)
        self._alloc = ExtentAllocator(0, _ALIGNMENT)
        self._entries: dict[bytes, Entry] = {}
        self._lru: collections.OrderedDict[bytes, Entry] = collections.OrderedDict()
        self._evictable_bytes = 0
        self._cleanups: set[asyncio.Task[None]] = set()
        self._counters = dict.fromkeys(_COUNTERS, 0)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Allocate the pool; with a store, connect and register the pool (idempotent).

        Raises:
            CacheClosedError: the cache was closed.
            StorageUnavailableError / StorageTimeoutError: the store cannot be opened.
            OwnershipError: called from a thread other than the one that started it.
        """
        if self._life is _Life.RUNNING:
            self._check()
            return
        if self._life in (_Life.CLOSING, _Life.CLOSED):
            raise CacheClosedError(f"EmbeddingCache is {self._life.value}")
        if self._starting is not None:
            await asyncio.shield(self._starting)
            return
        loop = asyncio.get_running_loop()
        self._starting = loop.create_future()
        self._life = _Life.STARTING
        try:
            pin = self._pin_memory

            def build() -> torch.Tensor:
                pool = torch.empty(self.pool_bytes, dtype=torch.uint8, pin_memory=pin)
                pool.zero_()  # touch every page now, not on the first inserts
                return pool

            self._pool = await asyncio.to_thread(build)
            self._alloc = ExtentAllocator(self.pool_bytes, _ALIGNMENT)
            if self._io is not None:
                await self._io.open()
                await self._io.register_buffer(self._pool)
        except BaseException as exc:
            self._life = _Life.NEW
            starting, self._starting = self._starting, None
            if isinstance(exc, Exception):
                starting.set_exception(exc)
                starting.exception()  # retrieved: waiters re-raise it, nobody else must
            else:
                starting.cancel()
            raise
        self._owner = threading.get_ident()
        self._life = _Life.RUNNING
        self._starting.set_result(None)
        log.info(
            "embedding.started",
            pool_bytes=self.pool_bytes,
            dtype=str(self.dtype),
            namespace=self.namespace,
            store=type(self._store).__name__ if self._store is not None else None,
            pinned=pin,
        )

    async def aclose(self) -> None:
        """Wait for pending slot releases, then close the store (idempotent; never raises for
        store trouble, which is logged).

        Bounded by about ``3 * timeout`` however stuck the store is: workers that have not
        released their slots by then are abandoned (their entries stay pinned; the pool's
        memory stays alive for them)."""
        if self._life in (_Life.CLOSING, _Life.CLOSED):
            return
        if self._life is _Life.STARTING and self._starting is not None:
            await asyncio.wait([self._starting])
        self._life = _Life.CLOSING
        try:
            if self._cleanups:
                _, stuck = await asyncio.wait(list(self._cleanups), timeout=self.timeout)
                if stuck:
                    log.warning("embedding.close_abandoned_workers", tasks=len(stuck))
                    for task in stuck:
                        task.cancel()  # the entries stay pinned: the cache is closing
            if self._io is not None:
                await self._io.aclose(timeout=self.timeout)
        except StorageError as exc:
            log.warning("embedding.close_failed", error=str(exc))
        finally:
            self._life = _Life.CLOSED
            log.info("embedding.closed", **self._counters)

    async def __aenter__(self) -> EmbeddingCache:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _check(self) -> None:
        if self._life in (_Life.CLOSING, _Life.CLOSED):
            raise CacheClosedError(f"EmbeddingCache is {self._life.value}")
        if self._owner is not None and threading.get_ident() != self._owner:
            raise OwnershipError(
                f"EmbeddingCache used from thread {threading.current_thread().name!r}; only "
                "the event-loop thread that started it may call it"
            )

    async def _ready(self) -> None:
        self._check()
        if self._life is not _Life.RUNNING:
            await self.start()

    # ------------------------------------------------------------------ public API

    async def insert_batch(
        self, hashes: Sequence[str | bytes], tensors: Sequence[torch.Tensor]
    ) -> InsertBatchStats:
        """Cache ``tensors[i]`` under ``hashes[i]`` and push every entry of the batch - local
        hits too - to the global store in one put.

        Each tensor is ``num_tokens x dim`` of the cache's dtype, on any device.  The local part
        is done before the first await that can block on I/O; the push is best effort (failures
        are counted in ``push_failed``, never raised).  An entry that does not fit in the pool,
        even after evicting every unpinned entry, is skipped.  One ``embedding.insert_batch``
        log event per call.  An empty batch returns zeros and does no I/O.

        Raises:
            InvalidTypeError: ``hashes`` is not a sequence of ``str``/``bytes``, or an item of
                ``tensors`` is not a ``torch.Tensor``.
            InvalidInputError: lengths differ; an empty or over-long hash; a tensor that is not
                2-D, has an empty dimension, or is not of the cache's dtype.
            DuplicateHashError: a hash appears twice in the batch.
            EmbeddingMismatchError: a hash is cached with another shape.
            CacheClosedError: the cache is closed.
            OwnershipError: called from another thread.
            StorageUnavailableError / StorageTimeoutError: only from the implicit
                :meth:`start` of a first call.
        Nothing is stored when one of these is raised.
        """
        self._check()
        hs = canonical_hashes(hashes)
        ts = self._check_tensors(tensors, len(hs))
        self._check_duplicates(hs)
        await self._ready()
        if not hs:
            self._counters["insert_calls"] += 1
            return self._log_insert(InsertBatchStats(0, 0, 0), pushed=0)
        shapes = [EntryShape(int(t.shape[0]), int(t.shape[1]), self.dtype) for t in ts]
        loop = asyncio.get_running_loop()
        while True:
            self._check_existing(hs, shapes)
            waits: list[asyncio.Future[None]] = []
            for h in hs:
                e = self._entries.get(h)
                if e is None:
                    continue
                if e.state is not EntryState.READY:
                    assert e.settled is not None, f"{e!r} has no settle future"
                    waits.append(e.settled)
                elif e.pushes and self._io is not None:
                    if e.idle is None:
                        e.idle = loop.create_future()
                    waits.append(e.idle)
            if not waits:
                break
            await asyncio.wait(waits)  # never cancels the shared futures
            self._check()
        self._counters["insert_calls"] += 1
        batch, stats = self._plan_insert(hs, ts, shapes)
        if self._io is None or not batch:
            for e in batch:
                self._unpin(e)
            return self._log_insert(stats, pushed=0)
        stats = dataclasses.replace(stats, push_failed=await self._push(batch))
        return self._log_insert(stats, pushed=len(batch))

    async def get_batch(self, hashes: Sequence[str | bytes]) -> list[torch.Tensor | None]:
        """Per hash, a new ``num_tokens x dim`` CPU tensor of the cached embedding, or ``None``.

        Local entries first; the rest with one size lookup and one batched get from the global
        store, filling the local pool.  An entry that is in the store but does not fit in the
        pool (even after eviction) is a miss, counted in ``get_no_space``.  A hash given twice
        gets two equal tensors.  Store faults are misses, never raised.  An empty batch returns
        ``[]`` and does no I/O.

        Raises:
            InvalidTypeError, InvalidInputError: as for :meth:`insert_batch` (hashes).
            CacheClosedError, OwnershipError: as for :meth:`insert_batch`.
            StorageUnavailableError / StorageTimeoutError: only from the implicit
                :meth:`start` of a first call.
        """
        self._check()
        hs = canonical_hashes(hashes)
        await self._ready()
        self._counters["get_calls"] += 1
        found: dict[bytes, torch.Tensor | None] = {}
        local = 0
        pending = list(dict.fromkeys(hs))
        for _ in range(_MAX_GET_ROUNDS):
            fetch: list[bytes] = []
            waits: list[asyncio.Future[None]] = []
            later: list[bytes] = []
            for h in pending:
                e = self._entries.get(h)
                if e is None:
                    if self._io is None:
                        found[h] = None
                    else:
                        fetch.append(h)
                elif e.state is EntryState.READY:
                    found[h] = self._read(e)
                    self._touch(e)
                    local += 1
                else:
                    assert e.settled is not None, f"{e!r} has no settle future"
                    waits.append(e.settled)
                    later.append(h)
            if fetch:
                await self._fetch(fetch, found)
            if not later:
                break
            await asyncio.wait(waits)
            self._check()
            pending = later
        else:
            for h in pending:
                found.setdefault(h, None)
        misses = sum(1 for v in found.values() if v is None)
        self._counters["get_local_hits"] += local
        self._counters["get_misses"] += misses
        log.debug(
            "embedding.get_batch",
            hashes=len(hs),
            local_hits=local,
            store_hits=len(found) - local - misses,
            misses=misses,
        )
        out: list[torch.Tensor | None] = []
        seen: set[bytes] = set()
        for h in hs:
            t = found[h]
            out.append(t.clone() if t is not None and h in seen else t)
            seen.add(h)
        return out

    def statistics(self) -> EmbeddingCacheStats:
        """Frozen snapshot of sizes, entry states and counters (no I/O)."""
        by_state = collections.Counter(e.state for e in self._entries.values())
        return EmbeddingCacheStats(
            state=self._life.value,
            pool_bytes=self.pool_bytes,
            used_bytes=self._alloc.used_bytes,
            free_bytes=self._alloc.free_bytes,
            largest_free_bytes=self._alloc.largest_free(),
            entries=len(self._entries),
            ready=by_state[EntryState.READY],
            filling=by_state[EntryState.FILLING],
            lookup=by_state[EntryState.LOOKUP],
            pinned=sum(1 for e in self._entries.values() if e.pushes),
            evictable=len(self._lru),
            evictable_bytes=self._evictable_bytes,
            cleanups_pending=len(self._cleanups),
            **self._counters,
        )

    def check_invariants(self) -> None:
        """Recompute every derived quantity and raise ``AssertionError`` on any inconsistency."""
        self._alloc.check_invariants()
        base = int(self._pool.data_ptr()) if self._pool.numel() else 0
        extents: set[int] = set()
        for h, e in self._entries.items():
            assert e.hash == h, f"{e!r} filed under another hash"
            assert e.key == embedding_key(self.namespace, h), f"{e!r} has a wrong key"
            assert e.state is not EntryState.GONE, f"{e!r} is GONE but still tabled"
            assert e.pushes >= 0, f"{e!r} has negative pushes"
            if e.state is EntryState.LOOKUP:
                assert e.offset is None and e.buffer is None, f"{e!r}: LOOKUP with a slot"
                continue
            assert e.offset is not None and e.buffer is not None, f"{e!r}: no slot"
            assert e.buffer.ptr == base + e.offset, f"{e!r}: buffer not at its offset"
            assert e.buffer.nbytes <= self._alloc.size_of(e.offset), f"{e!r}: slot overflows"
            assert e.offset not in extents, f"{e!r}: extent shared"
            extents.add(e.offset)
            if e.state is EntryState.READY:
                assert e.shape is not None and e.buffer.nbytes == e.shape.slot_nbytes, (
                    f"{e!r}: slot size differs from its shape"
                )
            else:
                assert e.pushes == 0, f"{e!r}: pushed while {e.state.name}"
            assert (h in self._lru) == e.evictable, f"{e!r}: LRU membership wrong"
        used = self._alloc.used_offsets()
        assert extents == used, f"pool extents {sorted(used - extents)} belong to no entry"
        assert all(self._entries.get(h) is e for h, e in self._lru.items()), "stale LRU entry"
        evictable = sum(self._alloc.size_of(e.offset or 0) for e in self._lru.values())
        assert evictable == self._evictable_bytes, (
            f"evictable bytes {self._evictable_bytes} != recomputed {evictable}"
        )

    def __repr__(self) -> str:
        by_state = collections.Counter(e.state.name.lower() for e in self._entries.values())
        states = ", ".join(f"{k}={by_state[k]}" for k in ("ready", "filling", "lookup"))
        store = type(self._store).__name__ if self._store is not None else None
        return (
            f"EmbeddingCache(state={self._life.value}, namespace={self.namespace!r}, "
            f"dtype={self.dtype}, entries={len(self._entries)} ({states}), "
            f"pinned={sum(1 for e in self._entries.values() if e.pushes)}, "
            f"used={self._alloc.used_bytes}/{self.pool_bytes}, store={store})"
        )

    def evict(self, nbytes: int | None = None) -> int:
        """Evict unpinned ``READY`` entries, least recently used first, until at least
        ``nbytes`` pool bytes were freed (all of them when ``None``); returns the bytes freed.
        Only the local copies go: the global store keeps its own.

        Raises:
            CacheClosedError, OwnershipError: as for :meth:`insert_batch`.
            InvalidInputError: ``nbytes`` is negative.
        """
        self._check()
        if nbytes is not None and nbytes < 0:
            raise InvalidInputError(f"evict needs nbytes >= 0, got {nbytes}")
        freed = 0
        while self._lru and (nbytes is None or freed < nbytes):
            _, victim = self._lru.popitem(last=False)
            freed += self._evict_popped(victim)
        return freed

    def lru_order(self) -> list[bytes]:
        """Hashes of evictable entries, next victim first (tests and diagnostics)."""
        return list(self._lru)

    # ------------------------------------------------------------------ validation

    def _check_tensors(self, tensors: Sequence[torch.Tensor], n: int) -> list[torch.Tensor]:
        given: object = tensors
        if isinstance(given, torch.Tensor):
            raise InvalidTypeError(
                "tensors must be a sequence of tensors (one per hash), got a single Tensor"
            )
        ts = list(tensors)
        if len(ts) != n:
            raise InvalidInputError(f"{n} hashes but {len(ts)} tensors")
        for i, t in enumerate(ts):
            if not isinstance(t, torch.Tensor):
                raise InvalidTypeError(
                    f"tensors[{i}] must be a torch.Tensor, got {type(t).__name__}"
                )
            if t.dim() != 2:
                raise InvalidInputError(
                    f"tensors[{i}] must be 2-D (num_tokens, dim), got shape {tuple(t.shape)}"
                )
            if t.shape[0] < 1 or t.shape[1] < 1:
                raise InvalidInputError(f"tensors[{i}] has an empty dimension: {tuple(t.shape)}")
            if t.dtype != self.dtype:
                raise InvalidInputError(
                    f"tensors[{i}] has dtype {t.dtype}, the cache holds {self.dtype}"
                )
        return ts

    @staticmethod
    def _check_duplicates(hs: list[bytes]) -> None:
        if len(set(hs)) != len(hs):
            counts = collections.Counter(hs)
            dups = [h for h, c in counts.items() if c > 1]
            raise DuplicateHashError(
                f"{len(dups)} duplicate hash(es) in one insert_batch: {dups[:3]!r}"
            )

    def _check_existing(self, hs: list[bytes], shapes: list[EntryShape]) -> None:
        bad: list[str] = []
        for h, shape in zip(hs, shapes, strict=True):
            e = self._entries.get(h)
            if e is not None and e.shape is not None and e.shape != shape:
                bad.append(
                    f"{h[:32]!r}: cached {e.shape.num_tokens}x{e.shape.dim} {e.shape.dtype}, "
                    f"given {shape.num_tokens}x{shape.dim} {shape.dtype}"
                )
        if bad:
            raise EmbeddingMismatchError(
                f"{len(bad)} hash(es) already cached with another shape: {'; '.join(bad[:3])}"
            )

    # ------------------------------------------------------------------ insert internals

    def _plan_insert(
        self, hs: list[bytes], ts: list[torch.Tensor], shapes: list[EntryShape]
    ) -> tuple[list[Entry], InsertBatchStats]:
        """Synchronous: local hits, new entries copied in, skips.  Returns the entries to push,
        each pinned (so the batch never evicts its own entries)."""
        batch: list[Entry] = []
        new = hit = skipped = 0
        for h, t, shape in zip(hs, ts, shapes, strict=True):
            e = self._entries.get(h)
            if e is not None:
                assert e.state is EntryState.READY and not (e.pushes and self._io), (
                    f"plan met {e!r}"
                )
                hit += 1
                self._pin(e)
                batch.append(e)
                continue
            offset = self._reserve(shape.slot_nbytes)
            if offset is None:
                skipped += 1
                continue
            e = Entry(h, embedding_key(self.namespace, h), EntryState.READY)
            e.shape = shape
            e.offset = offset
            e.buffer = self._slot(offset, shape.slot_nbytes)
            e.buffer.view[:HEADER_BYTES] = pack_header(shape)
            self._data(e).copy_(t.detach())
            self._entries[h] = e
            new += 1
            e.pushes = 1  # born pinned by this batch (READY, never in the LRU yet)
            batch.append(e)
        self._counters["insert_new"] += new
        self._counters["insert_local_hits"] += hit
        self._counters["insert_skipped"] += skipped
        return batch, InsertBatchStats(new=new, local_hit=hit, skipped=skipped)

    async def _push(self, batch: list[Entry]) -> int:
        """One put of every entry in ``batch``; returns how many the store did not confirm.
        Unpins the entries once no worker holds their slots (maybe after returning)."""
        assert self._io is not None
        io = self._io
        bufs = [e.buffer for e in batch if e.buffer is not None]
        self._counters["pushed"] += len(batch)
        failed = len(batch)
        try:
            ok = await io.put([e.key for e in batch], bufs)
            failed = sum(1 for x in ok if not x)
        except StorageError as exc:
            self._counters["store_errors"] += 1
            log.warning(
                "embedding.push_failed", entries=len(batch), error=f"{type(exc).__name__}: {exc}"
            )
        finally:

            def unpin_all() -> None:
                for e in batch:
                    self._unpin(e)

            self._after_release(bufs, unpin_all)
        self._counters["push_failed"] += failed
        return failed

    def _log_insert(self, stats: InsertBatchStats, *, pushed: int) -> InsertBatchStats:
        log.info(
            "embedding.insert_batch",
            namespace=self.namespace,
            new=stats.new,
            local_hit=stats.local_hit,
            skipped=stats.skipped,
            pushed=pushed,
            push_failed=stats.push_failed,
        )
        return stats

    # ------------------------------------------------------------------ get internals

    async def _fetch(self, hs: list[bytes], found: dict[bytes, torch.Tensor | None]) -> None:
        """Fetch ``hs`` (absent locally) from the store into the pool; fill ``found``."""
        assert self._io is not None and self._store is not None
        io, store = self._io, self._store
        loop = asyncio.get_running_loop()
        entries = []
        for h in hs:
            e = Entry(h, embedding_key(self.namespace, h), EntryState.LOOKUP, loop.create_future())
            self._entries[h] = e
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
                offset = self._reserve(size) if self._plausible(size) else None
                if offset is None:
                    if size > 0:
                        why = "get_no_space" if self._plausible(size) else "get_invalid"
                        self._counters[why] += 1
                    self._drop(e)
                    continue
                e.offset = offset
                e.buffer = self._slot(offset, size)
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
                        self._counters["get_invalid"] += 1
                    self._drop(e)
                    continue
                e.shape = shape
                e.transition(EntryState.READY)
                self._lru_add(e)
                found[e.hash] = self._read(e)
                self._counters["get_store_hits"] += 1
            filling = []
        finally:
            for e in entries:
                if e.state is EntryState.LOOKUP:
                    self._drop(e)
            held = [e for e in filling if e.state is EntryState.FILLING]
            if held:

                def drop_held() -> None:
                    for e in held:
                        if e.state is EntryState.FILLING:
                            self._drop(e)

                self._after_release([e.buffer for e in held if e.buffer is not None], drop_held)

    def _plausible(self, size: int) -> bool:
        return HEADER_BYTES + FRAME_OVERHEAD < size <= self._alloc.capacity

    def _store_error(self, what: str, exc: StorageError, n: int) -> None:
        self._counters["store_errors"] += 1
        log.warning(
            "embedding.fetch_failed", step=what, entries=n, error=f"{type(exc).__name__}: {exc}"
        )

    # ------------------------------------------------------------------ pool and LRU

    def _slot(self, offset: int, nbytes: int) -> PageBuffer:
        return PageBuffer.from_tensor(self._pool[offset : offset + nbytes])

    def _data(self, e: Entry) -> torch.Tensor:
        assert e.offset is not None and e.shape is not None
        start = e.offset + HEADER_BYTES
        raw = self._pool[start : start + e.shape.data_nbytes]
        return raw.view(e.shape.dtype).view(e.shape.num_tokens, e.shape.dim)

    def _read(self, e: Entry) -> torch.Tensor:
        assert e.state is EntryState.READY, f"read of {e!r}"
        return self._data(e).clone()

    def _reserve(self, nbytes: int) -> int | None:
        """An extent of ``nbytes``, evicting LRU entries as needed; ``None`` if impossible."""
        size = self._alloc.aligned(nbytes)
        if size > self._alloc.capacity or size > self._alloc.free_bytes + self._evictable_bytes:
            return None
        while (offset := self._alloc.alloc(nbytes)) is None:
            if not self._lru:
                return None
            _, victim = self._lru.popitem(last=False)
            self._evict_popped(victim)
        return offset

    def _evict_popped(self, victim: Entry) -> int:
        """Drop ``victim``, just popped from the LRU; returns the bytes freed."""
        assert victim.offset is not None and victim.evictable, f"evicting {victim!r}"
        freed = self._alloc.size_of(victim.offset)
        self._evictable_bytes -= freed
        self._counters["evictions"] += 1
        self._counters["evicted_bytes"] += freed
        self._drop(victim)
        return freed

    def _drop(self, e: Entry) -> None:
        """Remove ``e`` from the table and the LRU and free its extent (-> GONE)."""
        if e.hash in self._lru:
            self._lru_remove(e)
        if self._entries.get(e.hash) is e:
            del self._entries[e.hash]
        if e.offset is not None:
            self._alloc.free(e.offset)
            e.offset = None
            e.buffer = None
        e.transition(EntryState.GONE)

    def _lru_add(self, e: Entry) -> None:
        assert e.evictable and e.offset is not None, f"LRU add of {e!r}"
        self._lru[e.hash] = e
        self._evictable_bytes += self._alloc.size_of(e.offset)

    def _lru_remove(self, e: Entry) -> None:
        assert e.offset is not None
        del self._lru[e.hash]
        self._evictable_bytes -= self._alloc.size_of(e.offset)

    def _touch(self, e: Entry) -> None:
        if e.hash in self._lru:
            self._lru.move_to_end(e.hash)

    def _pin(self, e: Entry) -> None:
        if e.hash in self._lru:
            self._lru_remove(e)
        e.pin_push()

    def _unpin(self, e: Entry) -> None:
        e.unpin_push()
        if e.evictable and self._entries.get(e.hash) is e:
            self._lru_add(e)  # most recently used

    def _after_release(self, bufs: list[PageBuffer], then: Callable[[], Any]) -> None:
        """Run ``then`` now if no worker holds ``bufs``, else once the worker released them."""
        if self._io is None or not self._io.holds(bufs):
            then()
            return
        io = self._io

        async def wait_then() -> None:
            await io.wait_released(bufs)
            then()

        task = asyncio.get_running_loop().create_task(wait_then(), name="aiocache-kv-emb-release")
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)
