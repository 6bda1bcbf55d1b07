"""``EmbeddingCache``: a node-local pool of multimodal embeddings over a global store.

Design
------
*One owner.*  The table (hash -> :class:`~aiocache_kv.embedding.entries.Entry`), the LRU of
evictable entries and the pool allocator (:mod:`~aiocache_kv.embedding.pool`) are touched only
by synchronous code on the event-loop thread.  Store calls run on
:class:`~aiocache_kv.storage.executor.StorageIO` workers
(:mod:`~aiocache_kv.embedding.transfers`); a worker only reads or writes the bytes of the slots
it was handed.  The pool is registered once with the Mooncake client, so every put and get is
zero-copy from / into it; the stored object is exactly an entry's slot, so its size and header
tell a reader everything.

*Plan, then I/O.*  Each public call validates everything first
(:mod:`~aiocache_kv.embedding.checks`: a bad batch changes nothing), then makes all its state
changes in one synchronous step that returns the I/O still to do, and only then awaits.

*insert_batch.*  After waiting out any entry of the batch that is being filled from the store,
or being pushed by another call (so two inserts of one hash neither store nor send it twice),
the plan copies each new tensor into a fresh slot *synchronously* (the entry is born ``READY``:
complete before anyone can see it), counts entries already cached as local hits, and skips
entries that do not fit even after evicting every unpinned entry (LRU order).  Then all of the
batch's entries, local hits included, are pushed in ONE ``put``: the global copy may have been
evicted or lost with a restarted master, and a local hit costs a metadata lookup, not its
bytes.  The entries stay pinned until the worker has released their slots.

*get_batch.*  Local ``READY`` entries are copied out at once; the rest are fetched with one size
lookup and ONE ``get_into``.  Other tasks that ask for the same hash meanwhile wait for the
entry to settle instead of fetching it again; a reader never copies out of a ``FILLING`` slot.

Store faults never raise out of ``insert_batch``/``get_batch``: a failed push is counted
(``InsertBatchStats.push_failed``), a failed fetch is a miss; both are logged once per call.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
from collections.abc import Sequence

import torch

from aiocache_kv.embedding.checks import (
    check_duplicates,
    check_existing,
    check_tensors,
    own_copies,
)
from aiocache_kv.embedding.entries import Entry, EntryState, wait_settled
from aiocache_kv.embedding.keys import canonical_hashes, embedding_key
from aiocache_kv.embedding.layout import DTYPE_CODES, EntryShape
from aiocache_kv.embedding.pool import EntryPool
from aiocache_kv.embedding.stats import COUNTERS, EmbeddingCacheStats, InsertBatchStats
from aiocache_kv.embedding.transfers import StoreTransfers
from aiocache_kv.errors import (
    CacheClosedError,
    ConfigError,
    HostMemoryError,
    OwnershipError,
    StorageError,
    StorageKeyError,
)
from aiocache_kv.lifecycle import Lifecycle
from aiocache_kv.logs import get_logger
from aiocache_kv.numeric import MAX_THREADS, check_int, check_real
from aiocache_kv.outlast import Once
from aiocache_kv.pools.admission import available_host_bytes
from aiocache_kv.storage import owners
from aiocache_kv.storage.executor import StorageIO
from aiocache_kv.storage.mooncake import MooncakeStorage

__all__ = ["EmbeddingCache"]

log = get_logger(__name__)

#: a get_batch re-examines hashes whose fetch (by another task) failed at most this often
_MAX_GET_ROUNDS = 3

#: the largest ``pool_bytes`` (a torch size is an int64); start() also admits it against RAM
MAX_POOL_BYTES = (1 << 63) - 1


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
            pin_memory: page-lock the pool (a bool; default ``None``: when CUDA is available).

        Raises:
            ConfigError: a bad size (an int in ``[1, 2**63 - 1]``), dtype, namespace, timeout
                (a finite number of seconds > 0), store type or worker count (an int >= 1);
                a ``pin_memory`` that is not a bool or ``None``, or ``True`` without CUDA.
        """
        if (
            isinstance(pool_bytes, bool)
            or not isinstance(pool_bytes, int)
            or not 0 < pool_bytes <= MAX_POOL_BYTES
        ):
            raise ConfigError(
                f"pool_bytes must be an int in [1, {MAX_POOL_BYTES}], got {pool_bytes!r}"
            )
        if pin_memory is not None and not isinstance(pin_memory, bool):
            raise ConfigError(f"pin_memory must be a bool or None, got {pin_memory!r}")
        if pin_memory and not torch.cuda.is_available():
            raise ConfigError(
                "pin_memory=True needs CUDA, which is not available here; pass "
                "pin_memory=False or None (pinned when CUDA is available)"
            )
        if not isinstance(dtype, torch.dtype) or dtype not in DTYPE_CODES:
            raise ConfigError(
                f"dtype must be one of {sorted(str(d) for d in DTYPE_CODES)}, got {dtype!r}"
            )
        if store is not None and not isinstance(store, MooncakeStorage):
            raise ConfigError(
                f"store must be a MooncakeStorage or None, got {type(store).__name__}"
            )
        try:
            embedding_key(namespace, b"probe", dtype)
        except StorageKeyError as exc:
            raise ConfigError(f"namespace {namespace!r} is not a valid storage tag: {exc}") from exc
        check_real("timeout", timeout, exclusive=True, error=ConfigError)
        check_int("workers", workers, minimum=1, maximum=MAX_THREADS, error=ConfigError)
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
        self._life = Lifecycle.NEW
        self._starting: asyncio.Future[None] | None = None
        #: done when the cache starts closing: wakes calls waiting on entries
        self._woken: asyncio.Future[None] | None = None
        #: the one close (see :meth:`aclose`): created by the first call, awaited by all
        self._closing = Once()
        self._owner: int | None = None
        self._counters = dict.fromkeys(COUNTERS, 0)
        self._pool = EntryPool(self._counters)
        self._transfers = StoreTransfers(
            self._pool, self._io, store, namespace=namespace, dtype=dtype
        )
        #: the table (hash -> entry) and the tasks waiting for workers to release slots
        self._entries = self._pool.entries
        self._cleanups = self._transfers.cleanups

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Allocate the pool; with a store, connect and register the pool (idempotent).

        Raises:
            CacheClosedError: the cache was closed.
            HostMemoryError: ``pool_bytes`` exceeds the host's available memory, or the
                pool cannot be allocated (or pinned).
            StorageUnavailableError / StorageTimeoutError: the store cannot be opened.
            ConfigError: the store object is used by another cache (:mod:`..storage.owners`).
            OwnershipError: called from a thread other than the one that started it.
        """
        if self._life is Lifecycle.RUNNING:
            self._check()
            return
        if self._life in (Lifecycle.CLOSING, Lifecycle.CLOSED):
            raise CacheClosedError(f"EmbeddingCache is {self._life.value}")
        if self._starting is not None:
            starting = self._starting
            await asyncio.wait([starting])  # never cancels the shared future
            if starting.cancelled():  # its caller was cancelled, not this one: start here
                return await self.start()
            return starting.result()
        loop = asyncio.get_running_loop()
        self._starting = loop.create_future()
        self._life = Lifecycle.STARTING
        try:
            if self._io is not None:  # first: a refused start allocates nothing
                owners.claim(self._io.backend, self)  # released when this cache closes it
            pin = self._pin_memory

            def build() -> torch.Tensor:
                n = self.pool_bytes
                avail = available_host_bytes()
                if n > avail:
                    raise HostMemoryError(
                        f"EmbeddingCache pool_bytes={n} ({n / 2**30:.2f} GiB) exceeds the "
                        f"{avail} bytes ({avail / 2**30:.2f} GiB) of available host memory; "
                        "lower pool_bytes"
                    )
                try:
                    pool = torch.empty(n, dtype=torch.uint8, pin_memory=pin)
                except RuntimeError as exc:  # out of memory, or pinning refused
                    raise HostMemoryError(
                        f"EmbeddingCache pool of {n} bytes (pinned={pin}) could not be "
                        f"allocated: {exc}"
                    ) from exc
                pool.zero_()  # touch every page now, not on the first inserts
                return pool

            self._pool.install(await asyncio.to_thread(build))
            if self._io is not None:
                await self._io.open()
                await self._io.register_buffer(self._pool.memory)
        except BaseException as exc:
            self._life = Lifecycle.NEW
            if self._io is not None:  # a retry, by a new cache too, may claim the store
                owners.release(self._io.backend, self)
            starting, self._starting = self._starting, None
            if isinstance(exc, Exception):
                starting.set_exception(exc)
                starting.exception()  # retrieved: waiters re-raise it, nobody else must
            else:
                starting.cancel()
            raise
        self._owner = threading.get_ident()
        self._woken = loop.create_future()
        self._life = Lifecycle.RUNNING
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
        memory stays alive for them).

        The close runs in one task of its own, started by the first call: every call waits
        for that same close, and a caller that is cancelled only stops waiting (the close
        still completes: the store client and its worker threads are closed)."""
        if not self._closing.started and self._life is not Lifecycle.STARTING:
            self._life = Lifecycle.CLOSING  # refused from now on (a start ends first)
        await self._closing.run(self._close)

    async def _close(self) -> None:
        """The steps of :meth:`aclose`; the store is closed even if this task is cancelled."""
        try:
            if self._life is Lifecycle.STARTING and self._starting is not None:
                await asyncio.wait([self._starting])
            self._life = Lifecycle.CLOSING
            if self._woken is not None and not self._woken.done():
                self._woken.set_result(None)  # calls waiting on entries end
            if self._cleanups:
                _, stuck = await asyncio.wait(list(self._cleanups), timeout=self.timeout)
                if stuck:
                    log.warning("embedding.close_abandoned_workers", tasks=len(stuck))
                    for task in stuck:
                        task.cancel()  # the entries stay pinned: the cache is closing
        finally:
            self._life = Lifecycle.CLOSING
            try:
                if self._io is not None and owners.usable_by(self._io.backend, self):
                    await self._io.aclose(timeout=self.timeout)
            except StorageError as exc:
                log.warning("embedding.close_failed", error=str(exc))
            finally:
                if self._io is not None:
                    owners.release(self._io.backend, self)
                self._life = Lifecycle.CLOSED
                log.info("embedding.closed", **self._counters)

    async def __aenter__(self) -> EmbeddingCache:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _check(self) -> None:
        if self._life in (Lifecycle.CLOSING, Lifecycle.CLOSED):
            raise CacheClosedError(f"EmbeddingCache is {self._life.value}")
        if self._owner is not None and threading.get_ident() != self._owner:
            raise OwnershipError(
                f"EmbeddingCache used from thread {threading.current_thread().name!r}; only "
                "the event-loop thread that started it may call it"
            )

    async def _ready(self) -> None:
        self._check()
        if self._life is not Lifecycle.RUNNING:
            await self.start()

    # ------------------------------------------------------------------ public API

    async def insert_batch(
        self, hashes: Sequence[str | bytes], tensors: Sequence[torch.Tensor]
    ) -> InsertBatchStats:
        """Cache ``tensors[i]`` under ``hashes[i]`` and push every entry of the batch - local
        hits too - to the global store in one put.

        Each tensor is ``num_tokens x dim`` of the cache's dtype, on any device; it is read at
        the call only (a call that must wait first takes its own copies), so the caller may
        reuse it as soon as the call is made.  The local part is done before the first await
        that can block on I/O; the push is best effort (failures
        are counted in ``push_failed``, never raised).  An entry that does not fit in the pool,
        even after evicting every unpinned entry, is skipped, and so is one whose entry a store
        call still holds past ``timeout``.  One ``embedding.insert_batch``
        log event per call.  An empty batch returns zeros and does no I/O.

        Raises:
            InvalidTypeError: ``hashes`` is not a sequence of ``str``/``bytes``, ``tensors`` is
                not a sequence of tensors (``None``, a single tensor, ...), or an item of
                ``tensors`` is not a ``torch.Tensor``.
            InvalidInputError: lengths differ; an empty or over-long hash; a tensor that is not
                2-D, has an empty dimension, or is not of the cache's dtype; a tensor without
                dense data to copy (``meta``, sparse or other non-strided layout, nested, a
                dispatching subclass such as a fake tensor).
            DuplicateHashError: a hash appears twice in the batch.
            EmbeddingMismatchError: a hash is cached with another shape.
            CacheClosedError: the cache is closed.
            OwnershipError: called from another thread.
            HostMemoryError / StorageUnavailableError / StorageTimeoutError: only from the
                implicit :meth:`start` of a first call.
        Nothing is stored when one of these is raised.
        """
        self._check()
        hs = canonical_hashes(hashes)
        ts = check_tensors(tensors, len(hs), self.dtype)
        check_duplicates(hs)
        shapes = [EntryShape(int(t.shape[0]), int(t.shape[1]), self.dtype) for t in ts]
        # The caller's tensors are read only until the first suspension: one that would
        # suspend first takes the batch's own copies (a buffer the caller reuses meanwhile
        # must not be cached, or pushed, under these hashes).
        owned = False
        if self._life is not Lifecycle.RUNNING:
            ts, owned = own_copies(ts), True
        await self._ready()
        if not hs:
            self._counters["insert_calls"] += 1
            return self._log_insert(InsertBatchStats(0, 0, 0), pushed=0)
        loop = asyncio.get_running_loop()
        deadline, held = loop.time() + self.timeout, 0
        while True:
            check_existing(self._entries, hs, shapes)
            waits: list[asyncio.Future[None]] = []
            busy: set[bytes] = set()
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
                else:
                    continue
                busy.add(h)
            if not waits:
                break
            if not owned:
                ts, owned = own_copies(ts), True
            if not await wait_settled(waits, self._woken, deadline, self._check):
                # held by store calls that outlived the timeout: skipped by this call
                keep = [i for i, h in enumerate(hs) if h not in busy]
                held += len(hs) - len(keep)
                hs, ts, shapes = (
                    [hs[i] for i in keep],
                    [ts[i] for i in keep],
                    [shapes[i] for i in keep],
                )
        self._counters["insert_calls"] += 1
        batch, stats = self._plan_insert(hs, ts, shapes)
        if held:
            self._counters["insert_skipped"] += held
            stats = dataclasses.replace(stats, skipped=stats.skipped + held)
        if self._io is None or not batch:
            for e in batch:
                self._pool.unpin(e)
            return self._log_insert(stats, pushed=0)
        stats = dataclasses.replace(stats, push_failed=await self._transfers.push(batch))
        return self._log_insert(stats, pushed=len(batch))

    async def get_batch(self, hashes: Sequence[str | bytes]) -> list[torch.Tensor | None]:
        """Per hash, a new ``num_tokens x dim`` CPU tensor of the cached embedding, or ``None``.

        Local entries first; the rest with one size lookup and one batched get from the global
        store, filling the local pool.  An entry that is in the store but does not fit in the
        pool (even after eviction) is a miss, counted in ``get_no_space``.  A hash given twice
        gets two equal tensors.  Store faults are misses, never raised (a hash whose entry a
        store call still holds past ``timeout`` too).  An empty batch returns
        ``[]`` and does no I/O.

        Raises:
            InvalidTypeError, InvalidInputError: as for :meth:`insert_batch` (hashes).
            CacheClosedError, OwnershipError: as for :meth:`insert_batch`.
            HostMemoryError / StorageUnavailableError / StorageTimeoutError: only from the
                implicit :meth:`start` of a first call.
        """
        self._check()
        hs = canonical_hashes(hashes)
        await self._ready()
        self._counters["get_calls"] += 1
        found: dict[bytes, torch.Tensor | None] = {}
        local = 0
        pending = list(dict.fromkeys(hs))
        deadline: float | None = None  # of waits on other calls' entries, from the first
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
                    found[h] = self._pool.read(e)
                    self._pool.touch(e)
                    local += 1
                else:
                    assert e.settled is not None, f"{e!r} has no settle future"
                    waits.append(e.settled)
                    later.append(h)
            if fetch:
                await self._transfers.fetch(fetch, found)
            if not later:
                break
            if deadline is None:
                deadline = asyncio.get_running_loop().time() + self.timeout
            if not await wait_settled(waits, self._woken, deadline, self._check):
                for h in later:  # still held by a store call past its timeout: a miss
                    e = self._entries.get(h)
                    if e is not None and e.settled is not None and not e.settled.done():
                        found[h] = None
                later = [h for h in later if h not in found]
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
            used_bytes=self._pool.alloc.used_bytes,
            free_bytes=self._pool.alloc.free_bytes,
            largest_free_bytes=self._pool.alloc.largest_free(),
            entries=len(self._entries),
            ready=by_state[EntryState.READY],
            filling=by_state[EntryState.FILLING],
            lookup=by_state[EntryState.LOOKUP],
            pinned=sum(1 for e in self._entries.values() if e.pushes),
            evictable=len(self._pool.lru),
            evictable_bytes=self._pool.evictable_bytes,
            cleanups_pending=len(self._cleanups),
            **self._counters,
        )

    def check_invariants(self) -> None:
        """Recompute every derived quantity and raise ``AssertionError`` on any inconsistency."""
        self._pool.check_invariants(self.namespace, self.dtype)

    def __repr__(self) -> str:
        by_state = collections.Counter(e.state.name.lower() for e in self._entries.values())
        states = ", ".join(f"{k}={by_state[k]}" for k in ("ready", "filling", "lookup"))
        store = type(self._store).__name__ if self._store is not None else None
        return (
            f"EmbeddingCache(state={self._life.value}, namespace={self.namespace!r}, "
            f"dtype={self.dtype}, entries={len(self._entries)} ({states}), "
            f"pinned={sum(1 for e in self._entries.values() if e.pushes)}, "
            f"used={self._pool.alloc.used_bytes}/{self.pool_bytes}, store={store})"
        )

    def evict(self, nbytes: int | None = None) -> int:
        """Evict unpinned ``READY`` entries, least recently used first, until at least
        ``nbytes`` pool bytes were freed (all of them when ``None``); returns the bytes freed.
        Only the local copies go: the global store keeps its own.

        Raises:
            CacheClosedError, OwnershipError: as for :meth:`insert_batch`.
            InvalidInputError: ``nbytes`` is neither ``None`` nor an int >= 0.
        """
        self._check()
        if nbytes is not None:
            check_int("evict nbytes", nbytes)
        return self._pool.evict(nbytes)

    def lru_order(self) -> list[bytes]:
        """Hashes of evictable entries, next victim first (tests and diagnostics)."""
        return list(self._pool.lru)

    # ------------------------------------------------------------------ insert internals

    def _plan_insert(
        self, hs: list[bytes], ts: list[torch.Tensor], shapes: list[EntryShape]
    ) -> tuple[list[Entry], InsertBatchStats]:
        """Synchronous: local hits, new entries copied in, skips.  Returns the entries to push,
        each pinned (so the batch never evicts its own entries)."""
        batch: list[Entry] = []
        try:
            new, hit, skipped = self._plan_entries(hs, ts, shapes, batch)
        except BaseException:
            for e in batch:  # a copy that raised: the batch's pins go, its copies stay cached
                self._pool.unpin(e)
            raise
        self._counters["insert_new"] += new
        self._counters["insert_local_hits"] += hit
        self._counters["insert_skipped"] += skipped
        return batch, InsertBatchStats(new=new, local_hit=hit, skipped=skipped)

    def _plan_entries(
        self,
        hs: list[bytes],
        ts: list[torch.Tensor],
        shapes: list[EntryShape],
        batch: list[Entry],
    ) -> tuple[int, int, int]:
        new = hit = skipped = 0
        for h, t, shape in zip(hs, ts, shapes, strict=True):
            e = self._entries.get(h)
            if e is not None:
                assert e.state is EntryState.READY and not (e.pushes and self._io), (
                    f"plan met {e!r}"
                )
                hit += 1
                self._pool.pin(e)
                batch.append(e)
                continue
            e = self._pool.add_ready(h, self.namespace, shape, t)
            if e is None:
                skipped += 1
                continue
            new += 1
            batch.append(e)
        return new, hit, skipped

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
