"""The storage tier's plumbing: the executor, per-page buffer views, keys and shards.

:class:`StorageTierBase` opens the backend, registers the host pools once, and maps a host
page of any pool (KV first, then each sidecar component) to its :class:`PageBuffer` and a page
hash to its storage key (namespace tag once, then the pool's suffix, with the tensor-parallel
shard).  The prefetch path (:mod:`.prefetch`) and the backup path (:mod:`.tier`) build on it.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

from aiocache_kv.errors import StorageKeyError
from aiocache_kv.events import BlockRemoved
from aiocache_kv.logs import get_logger
from aiocache_kv.stats import StorageCounters
from aiocache_kv.storage import owners
from aiocache_kv.storage.base import (
    ChainAwareStorage,
    PageBuffer,
    StorageBackend,
    TagRemovableStorage,
)
from aiocache_kv.storage.executor import StorageIO
from aiocache_kv.storage.file_quota import TenantQuotaStorage
from aiocache_kv.storage.integrity import FRAME_OVERHEAD
from aiocache_kv.storage.key_layout import key_components
from aiocache_kv.storage.keys import parse_storage_key, storage_keys
from aiocache_kv.storage.stored_pages import StoredPages, StoredRun
from aiocache_kv.tree.node import RESIDENT, Node, Tier

if TYPE_CHECKING:
    from aiocache_kv.core import CacheCore
    from aiocache_kv.namespace import Namespace
    from aiocache_kv.quotas import QuotaBook

log = get_logger(__name__)


#: STORAGE claims of pages whose nodes left the tree kept for retraction and snapshots (the
#: newest; ~100 bytes each plus their node's tokens, only with KV events on)
ORPHAN_CLAIMS = 1 << 18


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
        #: per pool: its name, this rank's shard (each TP rank stores its own shard of a page
        #: under its own keys) and a digest of its layout (key_layout.py)
        self._suffixes = key_components(cfg, group.rank, group.world_size)
        page_size = cfg.page_size
        #: trailing-window components: (pool index, name, window pages)
        self._trailing = [
            (i + 1, c.name, c.window_pages(page_size))
            for i, c in enumerate(cfg.components)
            if c.window_pages(page_size)
        ]
        self._tasks: set[asyncio.Task[Any]] = set()
        self.counters = StorageCounters()
        #: page hash -> the node that held the page when it was stored (weakly: a node dropped
        #: from the tree leaves), to find what an eviction took.  Hashes are seeded by the
        #: namespace, so the hash alone names the page; a collision would only mark a node
        #: absent (backed up again), never present.
        self._stored = StoredPages(ORPHAN_CLAIMS if core.events.enabled else 0)
        core.on_split(self._split_stored)
        #: a backend enforcing per-tenant storage budgets (FileStorage): told each namespace
        #: tag's tenant when its first key is made, and the budgets (``quotas.py``)
        self._quota_store = backend if isinstance(backend, TenantQuotaStorage) else None
        #: asked once: a runtime protocol check scans the class (~9 us), and every backup
        #: asked twice (its release and its landing)
        self._chain_aware = isinstance(backend, ChainAwareStorage)
        self._tagged: set[str] = set()
        self.deferred_verify = False  #: set at start (see there)

    async def start(self) -> None:
        """Open the backend, register the host pool once, build per-page buffer views.

        Raises:
            ConfigError: the backend object is used by another cache (:mod:`.owners`).
            StorageUnavailableError / StorageTimeoutError: the backend cannot be opened (within
                ``storage_open_timeout``).
        """
        pool = self.core.host_pool
        assert pool is not None, "a storage tier needs a host pool"
        owners.claim(self.io.backend, self.core)  # released when this cache closes it
        await self.io.open(timeout=self.core.config.storage_open_timeout)
        raws = [(pool.raw, pool.page_bytes)]
        raws += [(sc.host_raw, sc.page_bytes) for sc in self.core.sidecars]
        for raw, _ in raws:
            await self.io.register_buffer(raw)

        def views() -> list[list[PageBuffer]]:
            # KV pages carry their checksum row: the copy that wrote one took its sum
            # (storage/presum.py), so its backup seals only the trailer
            sums = [pool.sums] + [None] * len(self.core.sidecars)
            return [
                [
                    PageBuffer.from_tensor(
                        raw[i, : nbytes + FRAME_OVERHEAD], None if table is None else table[i]
                    )
                    for i in range(len(raw))
                ]
                for (raw, nbytes), table in zip(raws, sums, strict=True)
            ]

        self._buffers = await asyncio.to_thread(views)
        # Mooncake reads check only trailers, the load-back verifies (deferred.py); not with
        # tensor parallelism (ranks would have to agree on which pages failed)
        backend = self.io.backend
        if hasattr(backend, "defer_checksum"):  # set either way: an object may be reused
            backend.defer_checksum = not self.core.coordinator.deferred
        #: prefetched KV pages come unverified (the load-back verifies them)
        self.deferred_verify = bool(getattr(backend, "defer_checksum", False))
        if self.core.tree.tenants is not None:
            self.apply_storage_quotas(self.core.tree.tenants)
        self.reconcile_evictions()  # what the backend evicted at open, to fit its capacity

    # ------------------------------------------------------------------ truth

    def remember_stored(self, node: Node) -> None:
        """``node``'s pages are in storage now (a backup landed, or they came from there)."""
        tree = self.core.tree
        self._stored.remember(
            node,
            tree.block_hashes(node),
            tree.parent_hash(node),
            node.start // self.core.config.page_size,
        )

    def remember_announced(self, node: Node) -> None:
        """``node``'s pages are in storage (a backup landed, or a prefetch committed them):
        remembered as stored, and those the stream does not claim yet announced in STORAGE,
        one ``BlockStored`` per run of them.  A page may be claimed already: a node of the
        same pages that left the tree announced it and its claim lives on (a recomputed node
        may extend such a run); pages may be unclaimed although stored: for a fetched node, a
        restart over the store, or a backup whose failed page announced none of its node.
        Snapshot + stream must equal the cache's claims, and a block is not stored twice
        without a removal between."""
        core = self.core
        claimed = []
        if core.events.enabled and node.alive:
            claimed = list(map(self._stored.claims_page, core.tree.block_hashes(node)))
        self.remember_stored(node)
        lo = 0
        for is_claimed, run in itertools.groupby(claimed):  # each unclaimed run, once
            hi = lo + len(list(run))
            if not is_claimed:
                core.append_stored(node, Tier.STORAGE, lo, hi)
            lo = hi

    def _split_stored(self, head: Node, tail: Node) -> None:
        """A split's new prefix node holds some of ``tail``'s stored pages now: index them
        under it, so that an eviction finds it even after ``tail`` left the tree."""
        if head.storage is RESIDENT:
            self.remember_stored(head)

    def storage_claims(self) -> list[tuple[StoredRun, list[int]]]:
        """Every page this cache still claims in storage, each once, per run of pages it
        remembered (see :meth:`StoredPages.claims`); on the loop."""
        return self._stored.claims()

    def claimed_in(self, ns: Namespace) -> list[bytes]:
        """The pages of namespace ``ns`` this cache still claims in storage (``drop``)."""
        return [run.hashes[i] for run, idx in self._stored.claims() if run.ns == ns for i in idx]

    def claimed_below(self, ns: Namespace, page_hash: bytes) -> list[bytes]:
        """The pages of ``ns`` this cache claims in storage that are ``page_hash`` or continue
        it (their chain of parents reaches it, through the runs it remembers)."""
        claims = [(run, idx) for run, idx in self._stored.claims() if run.ns == ns]
        parent: dict[bytes, bytes | None] = {}
        for run, _ in claims:
            for i, h in enumerate(run.hashes):
                parent[h] = run.parent if i == 0 else run.hashes[i - 1]
        memo: dict[bytes, bool] = {page_hash: True}
        out = []
        for run, idx in claims:
            for h in (run.hashes[i] for i in idx):
                path = []
                cur: bytes | None = h
                while cur is not None and cur not in memo:
                    path.append(cur)
                    cur = parent.get(cur)
                below = cur is not None and memo[cur]
                memo.update(dict.fromkeys(path, below))
                if below:
                    out.append(h)
        return out

    def forget_claims(self, hashes: list[bytes]) -> list[bytes]:
        """The pages ``hashes`` were removed from storage on purpose (``drop``): of those this
        cache claims, each claim is forgotten; returns them (the caller publishes their
        ``BlockRemoved``: two drops that overlapped retract a page once)."""
        claimed = [h for h in hashes if self._stored.claims_page(h)]
        for h in claimed:
            self._stored.pop(h)
        return claimed

    def retract_claims(self, hashes: list[bytes]) -> list[bytes]:
        """Storage is losing the pages ``hashes`` (a removal): of those this cache claims,
        each claim is forgotten and its node becomes storage-ABSENT; returns them (the caller
        publishes the ``BlockRemoved``)."""
        claimed = [h for h in hashes if self._stored.claims_page(h)]
        for h in claimed:
            self.lose_stored(h)
        return claimed

    def lose_stored(self, page_hash: bytes) -> bool:
        """Storage no longer has the page ``page_hash``: its claim is forgotten and the node
        holding it becomes storage-ABSENT (the caller publishes the ``BlockRemoved``).
        Whether a node was storage-RESIDENT."""
        node = self._stored.pop(page_hash)
        holder = None if node is None else self._holder(node, page_hash)
        return holder is not None and self.core.tree.lose_storage(holder)

    def _holder(self, node: Node, page_hash: bytes) -> Node | None:
        """The live node holding ``page_hash`` now: ``node`` or, after splits, an ancestor."""
        tree = self.core.tree
        cur: Node | None = node
        while cur is not None and cur.parent is not None and cur.alive:
            if page_hash in tree.block_hashes(cur):
                return cur
            cur = cur.parent
        return None

    def reconcile_evictions(self) -> int:
        """Apply what a :class:`ChainAwareStorage` backend evicted since it was last asked (on
        the loop): one ``BlockRemoved(STORAGE)`` for those pages, and every node that held one
        becomes storage-ABSENT, so a later hit backs it up again.  A backup in flight that
        puts one of them fails that page, even if its own put already reported it stored
        (another put, or another slice of the same backup, evicted it meanwhile).  With TP
        nothing changes but the counter: each rank's store is its own, and the tree must stay
        the same on every rank.  Returns the pages reported."""
        if not self._chain_aware:
            return 0
        backend = cast(ChainAwareStorage, self.io.backend)  # (fixed for the tier's life)
        keys = backend.take_evicted()
        if not keys:
            return 0
        self.counters.evicted_pages_storage += len(keys)
        core = self.core
        if core.coordinator.deferred:
            return len(keys)
        gone: dict[bytes, None] = {}  # ordered, once each
        nodes = 0
        for key in keys:
            try:
                parsed = parse_storage_key(key)
            except StorageKeyError:
                continue  # not one of this cache's keys
            if parsed.component not in self._suffixes:
                continue  # another layout's (or TP shard's) page: this cache's copy may stay
            gone[parsed.page_hash] = None
            if self.lose_stored(parsed.page_hash):
                nodes += 1
        self._evicted_in_flight(set(keys))
        if gone:
            core.emit(BlockRemoved(list(gone), Tier.STORAGE.medium))
        log.info("storage_evicted", pages=len(keys), nodes=nodes)
        return len(keys)

    async def remove_keys(
        self,
        keys: list[str],
        timeout: float | None = None,
        on_release: Callable[[], None] | None = None,
    ) -> int:
        """Remove ``keys`` from the store (on a worker); how many were there.  ``on_release``
        runs on the loop once no worker can remove any of them any more (at once for no keys;
        see :meth:`StorageIO.call`).

        Raises:
            StorageError: the backend failed; StorageTimeoutError: not within ``timeout``.
        """
        if not keys:
            if on_release is not None:
                on_release()
            return 0
        res = await self.io.remove(keys, timeout=timeout, on_release=on_release)
        return sum(res)

    async def remove_tag(
        self, tag: str, timeout: float | None = None, on_release: Callable[[], None] | None = None
    ) -> int | None:
        """Remove every key of namespace tag ``tag`` from the store, whoever wrote it; how
        many (``None``: the backend cannot, see :class:`TagRemovableStorage`, and
        ``on_release`` runs at once); ``on_release`` as for :meth:`remove_keys`.

        Raises:
            StorageError: the backend failed; StorageTimeoutError: not within ``timeout``.
        """
        backend = self.io.backend
        if not isinstance(backend, TagRemovableStorage):
            if on_release is not None:
                on_release()
            return None
        fn = backend.remove_tag
        n: int = await self.io.call("remove_tag", fn, tag, timeout=timeout, on_release=on_release)
        return n

    def _evicted_in_flight(self, keys: set[str]) -> None:
        """``keys`` were evicted: a backup in flight that puts one of them must not report
        its page stored (the backup path overrides this; on the loop)."""

    def _keys(self, ns: Namespace, hashes: list[bytes], pool: int = 0) -> list[str]:
        if self._quota_store is not None and ns.tag not in self._tagged:
            self._tagged.add(ns.tag)
            self._quota_store.tag_tenant(ns.tag, ns.tenant)
        return storage_keys(ns.tag, hashes, self._suffixes[pool])

    def apply_storage_quotas(self, book: QuotaBook) -> None:
        """Hand the tenants' storage budgets to a backend that enforces them (at its next
        put); a backend that does not (Mooncake: its master evicts) ignores them."""
        if self._quota_store is not None:
            default = None if book.default is None else book.default.storage_pages
            per = {t: q.storage_pages for t, q in book.overrides.items()}
            self._quota_store.set_storage_quotas(default, per)

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
