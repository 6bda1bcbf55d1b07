"""``HiCache``: the hierarchical cache a serving loop awaits (the facade).

Every method runs on the event-loop thread that started the cache.  The facade validates its
input (nothing changes on bad input), plans the state change through the
:class:`~aiocache_kv.core.CacheCore` (tree, pools, events), submits the data movement it needs
to the :class:`~aiocache_kv.transfer.ops.Transfers` (device<->host) or the storage tier
(host<->storage), and awaits only what the caller asked to wait for.  Completions are applied
by the core's coordinator: at once with one rank, through agreements with tensor parallelism.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Sequence

import torch

from aiocache_kv.cache_control import CacheControls
from aiocache_kv.cache_reports import CacheReports
from aiocache_kv.capacity import CapacityWaiters
from aiocache_kv.config import CacheConfig, PrefetchPolicy, WritePolicy
from aiocache_kv.core import CacheCore
from aiocache_kv.distributed import SingleRank, TPGroup
from aiocache_kv.errors import CacheClosedError, CapacityError, InvalidInputError, InvalidTypeError
from aiocache_kv.events import KVEvent
from aiocache_kv.flush import settle_work
from aiocache_kv.handles import (
    HANDLE_TYPES,
    PINNED,
    Handle,
    InsertResult,
    MatchResult,
    check_handle,
)
from aiocache_kv.inserts import insert_tokens
from aiocache_kv.lifecycle import Lifecycle
from aiocache_kv.logs import get_logger
from aiocache_kv.namespace import Namespace, namespace_of
from aiocache_kv.outlast import Once
from aiocache_kv.pins import HandleTable
from aiocache_kv.pools import DeviceKVPool, HostKVPool, PageAllocator, PageState
from aiocache_kv.pools.build import build_pools
from aiocache_kv.shutdown import abandon, close_abandoned, close_parts
from aiocache_kv.storage.integrity import FRAME_OVERHEAD
from aiocache_kv.storage.tier import PrefetchResult, PrefetchStatus, StorageTier
from aiocache_kv.transfer import CopyEngine, default_engine
from aiocache_kv.transfer.ops import OpKind, Transfers
from aiocache_kv.tree import Node, Tier
from aiocache_kv.tree.pathwalk import path_lens
from aiocache_kv.validate import (
    check_methods,
    check_names,
    check_token_ints,
    check_tokens,
    slots_to_pages,
    token_list,
)

log = get_logger(__name__)
_get_ident = threading.get_ident
# members read on every request, bound once: an enum class attribute read costs ~90 ns (3.11)
_RUNNING, _HELD, _SELECTIVE = Lifecycle.RUNNING, PageState.HELD, WritePolicy.WRITE_THROUGH_SELECTIVE

CacheState = Lifecycle  #: the first release's name of :class:`Lifecycle`


class HiCache(CacheControls, CacheReports):
    """Hierarchical KV cache over a device pool (L1), a host pool (L2) and storage (L3).

    Use as ``async with HiCache(cfg) as cache``.  Every method must be called on the thread
    running the loop that entered the context; any other thread gets ``OwnershipError``.
    """

    def __init__(
        self,
        config: CacheConfig,
        *,
        copy_engine: CopyEngine | None = None,
        tp_group: TPGroup | None = None,
    ) -> None:
        """Raises:
        InvalidTypeError: ``config``, ``tp_group`` or ``copy_engine`` of a wrong type.
        """
        if not isinstance(config, CacheConfig):
            raise InvalidTypeError(f"config must be a CacheConfig, got {type(config).__name__}")
        if tp_group is not None and not isinstance(tp_group, TPGroup):
            raise InvalidTypeError(f"tp_group must be a TPGroup, got {type(tp_group).__name__}")
        if copy_engine is not None:
            check_methods("copy_engine", copy_engine, ("start", "submit", "aclose"))
        self.config = config
        self.tp_group: TPGroup = tp_group if tp_group is not None else SingleRank()
        self._core = CacheCore(config, self.tp_group)
        self._tree = self._core.tree  # tests inspect the tree through this name
        self._default_ns = namespace_of(config.namespace, "", "")
        self._engine = (
            copy_engine
            if copy_engine is not None
            else default_engine(
                self._core.device, config.copy_threads, config.worker_nice, config.worker_idle
            )
        )
        self._state = Lifecycle.NEW
        self._handles = HandleTable(self._core)
        self._l3: StorageTier | None = None
        self._closing = Once()  # the close, run once in its own task
        self._tier_closes: set[asyncio.Task[None]] = set()
        self._transfers = Transfers(self._core, self._engine, self._backup_to_storage, self._rotten)
        self._waiters = CapacityWaiters(self._core)
        if config.write_policy is WritePolicy.WRITE_BACK:
            self._core.stager = self._transfers.stage

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Admit host memory, allocate the pools (off the loop) and start the copy engine.

        Raises:
            HostMemoryError: the host pools do not fit in available RAM minus the reserve.
            ConfigError: the device pool does not fit (in RAM on cpu, in free device memory on
                cuda), CUDA is not available, or TP ranks are configured differently.
            CacheClosedError: the cache was already started.
            StorageUnavailableError / StorageTimeoutError: the storage cannot be opened.
        """
        if self._state is not Lifecycle.NEW:
            raise CacheClosedError(f"cache cannot start from state {self._state.name}")
        cfg = self.config
        self._state = Lifecycle.STARTING
        try:
            pools = await build_pools(cfg, FRAME_OVERHEAD if cfg.storage is not None else 0)
            loop = asyncio.get_running_loop()
            core = self._core
            core.bind(loop, pools.device, pools.host, pools.sidecars)
            if cfg.storage is not None:
                self._l3 = StorageTier(core, cfg.storage)
                await self._l3.start()
            await core.coordinator.start(loop)  # TP: checks every rank's layout first
            self._engine.start(loop)
        except BaseException:
            abandon(self._l3, self._tier_closes, self._core.coordinator)  # (shutdown.py)
            self._l3 = None
            self._state = Lifecycle.NEW
            raise
        self._state = Lifecycle.RUNNING
        log.info(
            "cache_started",
            device=str(core.device),
            device_pages=cfg.device_pages,
            host_pages=cfg.host_pages,
            page_size=cfg.page_size,
            write_policy=WritePolicy(cfg.write_policy).value,
            host_bytes=pools.host_bytes,
        )

    async def aclose(self) -> None:
        """Settle every transfer in flight and a drop's zeroing, stop the engine and end
        event streams (:func:`~aiocache_kv.shutdown.close_parts`).

        Bounded even when the store hangs: copies finish, storage calls get their deadlines,
        and the storage tier closes within about ``3 * storage_timeout`` (workers still stuck
        in the store are abandoned; an acknowledged page is stored: nothing is lost).  It
        runs once, in its own task: a cancelled caller stops waiting, the close goes on.
        """
        if self._state is Lifecycle.NEW:
            self._state = Lifecycle.CLOSED
            await close_abandoned(self._tier_closes, self.config, self._core)  # a start opened
            return
        if not self._closing.started:
            if self._state is Lifecycle.CLOSED:
                return  # (closed before it ever started)
            self._state = Lifecycle.CLOSING
            self._waiters.close()
        await self._closing.run(self._close)

    async def _close(self) -> None:
        try:
            await close_parts(self._core, self._engine, self._transfers, self._l3, self._handles)
        finally:
            self._state = Lifecycle.CLOSED
            log.info("cache_closed", **dataclasses.asdict(self._core.counters))

    async def __aenter__(self) -> HiCache:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _check(self) -> None:
        if self._state is _RUNNING and _get_ident() == self._core.owner:
            return  # every call on the loop thread of a running cache
        if self._state is not Lifecycle.RUNNING:
            hint = " (use `async with HiCache(cfg)` or `await cache.start()`)"
            raise CacheClosedError(
                f"cache is {self._state.value}" + (hint if self._state is Lifecycle.NEW else "")
            )
        self._core.check_owner()

    def _ns(self, tenant: str | None, lora: str | None) -> Namespace:
        if tenant is None and lora is None:
            return self._default_ns
        return namespace_of(self.config.namespace, *check_names(tenant, lora))

    def _walk_ns(self, toks: list[int], tenant: str | None, lora: str | None) -> Namespace:
        """:meth:`_ns` for a call whose tokens' items its walk checks later: a bad name is
        reported only after the tokens' own errors, as when the tokens were checked first."""
        if tenant is None and lora is None:
            return self._default_ns
        try:
            return self._ns(tenant, lora)
        except (InvalidInputError, InvalidTypeError):
            check_token_ints(toks)
            raise

    # ------------------------------------------------------------------ match / load back

    def cached_len(
        self, tokens: Sequence[int], *, tenant: str | None = None, lora: str | None = None
    ) -> int:
        """Leading tokens of ``tokens`` the tree holds now (device or host, whole pages): a
        look that changes nothing - no pin, no recency, no hit counted.

        Raises:
            As :meth:`match_prefix`.
        """
        self._check()
        toks = check_tokens(tokens)
        p = self.config.page_size
        return self._core.tree.peek(self._ns(tenant, lora), toks, len(toks) // p * p)

    def match_prefix(
        self,
        tokens: Sequence[int] | torch.Tensor,
        *,
        tenant: str | None = None,
        lora: str | None = None,
    ) -> MatchResult:
        """Find the longest cached prefix of ``tokens`` and pin it.

        Returns a :class:`MatchResult`; release it with :meth:`release`.

        Raises:
            InvalidTypeError / InvalidInputError: tokens are not ints in ``[0, 2**63)`` or
                empty; tenant/lora not ``str``/``None``.
            CacheClosedError: the cache is not running.
        """
        if self._state is not _RUNNING or _get_ident() != self._core.owner:
            self._check()  # raises; the test inline: every request passes here
        toks = tokens if type(tokens) is list and tokens else token_list(tokens)  # (inline)
        ns = self._default_ns if tenant is lora is None else self._walk_ns(toks, tenant, lora)
        p = self.config.page_size
        core = self._core
        tree = core.tree
        node, _ = tree.match(ns, toks, len(toks) // p * p, pin=True, unchecked=True, tag=ns.tag)
        m = MatchResult(core, node, self.release)
        self._handles.add(m)
        c = core.counters
        c.match_queries += 1
        if node.parent is not None:
            dev, host = m.lens() if core.trailing else path_lens(node)  # (lens, inline)
            c.hit_tokens_device += dev
            c.hit_tokens_host += host
            if self.config.write_policy is _SELECTIVE:
                tree.record_hit(node)  # hit counts only decide selective write-through
                threshold = self.config.write_through_threshold
                self._transfers.backup(
                    [n for n in tree.path(node) if n.hit_count >= threshold],
                    OpKind.WRITE_THROUGH,
                )
            if self._l3 is not None:  # host copies not yet in storage (earlier failure)
                self._l3.backup(tree.path(node))
        return m

    async def prefetch(
        self,
        tokens: Sequence[int] | torch.Tensor,
        *,
        tenant: str | None = None,
        lora: str | None = None,
        policy: PrefetchPolicy | str | None = None,
    ) -> PrefetchResult:
        """Load the storage-resident continuation of the cached prefix of ``tokens`` to host.

        Only the leading run of pages that arrived intact is committed; a later
        :meth:`match_prefix` sees them as host hits.  ``policy`` (default: the config's):
        ``wait_complete`` waits for every page (bounded by the storage deadline),
        ``timeout`` waits ``base + per_1k * tokens / 1000`` seconds (capped) and commits what
        arrived, ``best_effort`` returns at once and commits in the background (with TP: at
        a later agreement).  Storage faults never raise here: the result says what happened.

        Raises:
            InvalidTypeError / InvalidInputError: bad tokens, names or policy (nothing changed).
            CacheClosedError: the cache is not running.
        """
        self._check()
        toks = list(check_tokens(tokens))  # a copy: the caller's list may change meanwhile
        try:
            pol = PrefetchPolicy(policy if policy is not None else self.config.prefetch_policy)
        except ValueError:
            raise InvalidInputError(f"unknown prefetch policy {policy!r}") from None
        ns = self._ns(tenant, lora)
        if self._l3 is None:
            return PrefetchResult(PrefetchStatus.NO_STORAGE, 0, 0, 0)
        p = self.config.page_size
        self._core.tree.root(ns, ns.tag)
        return await self._l3.prefetch(ns, toks, len(toks) // p * p, pol)

    async def load_back(self, m: MatchResult, *, timeout: float | None = None) -> MatchResult:
        """Copy the host-resident part of ``m`` to device; ``m`` then reports it on device.

        Cancelling the await does not cancel the copy: it lands (the pages become
        device-resident, owned by the tree) and nothing leaks.  ``m`` stays pinned either way.
        Nodes another load is filling are waited for before their children are loaded, so a
        child's copy never outlives a failed parent.  With ``timeout`` (seconds, finite,
        >= 0), too few device pages is not an error at once: the load waits in line, as
        :meth:`alloc_wait` does, for pages to come back, up to ``timeout`` in all (copies it
        started are awaited as without it).

        Raises:
            CapacityError: not enough device pages even after eviction (nothing changed;
                with ``timeout``: still not enough when it passed).
            InvalidInputError: ``timeout`` is not a finite number >= 0, or given with
                tensor parallelism.
            TransferError: the copy failed; the nodes stay host-only.
            HandleError: ``m`` was released or belongs to another cache (or was released
                while waiting: its nodes are no longer held, so nothing more is loaded).
            CacheClosedError: the cache is not running (or closed while waiting).
        """

        def check() -> None:  # before every round: the pin is what keeps the nodes in the tree
            self._check()
            check_handle(m, MatchResult, self._core)

        check()
        wait = None
        if timeout is not None:
            p = self.config.page_size
            need = lambda: sum(len(n.key) for n in m.parts()[1]) // p  # noqa: E731
            wait = self._waiters.loads(self._waiters.check_timeout(timeout), need)
        await self._transfers.load_path(m.parts, check, wait)
        return m

    # ------------------------------------------------------------------ alloc / insert

    def alloc(self, n: int) -> torch.Tensor:
        """Device token slots for ``n`` tokens, in whole pages (``ceil(n / page_size)`` pages).

        The caller owns them until it passes them to :meth:`insert` or :meth:`free`.
        ``alloc(0)`` returns an empty tensor (a full hit needs no new rows).

        Raises:
            InvalidInputError: ``n`` is not an int >= 0.
            CapacityError: too few free pages even after evicting (nothing evicted or taken).
        """
        if self._state is not _RUNNING or _get_ident() != self._core.owner:
            self._check()  # raises; the test inline: every request passes here
        if type(n) is not int or n < 0:
            raise InvalidInputError(f"alloc needs an int >= 0, got {n!r}")
        if n == 0:
            return torch.empty(0, dtype=torch.int64)
        p = self.config.page_size
        pages = -(-n // p)
        alloc = self._core.dev_alloc
        if alloc is not None and alloc.num_free >= pages:  # (alloc_device's passing case)
            return alloc.alloc(pages, _HELD, slots_of=p)
        return self._core.alloc_device(pages, _HELD, slots_of=p)

    async def alloc_wait(self, n: int, *, timeout: float | None = None) -> torch.Tensor:
        """Like :meth:`alloc`, but waits for pages.  Without ``timeout``: only for pages held
        back by copies in flight (write-through acks, write-back staging), then retries.
        With ``timeout`` (seconds, finite, >= 0): in line (first come, first served) for any
        pages to come back (a release, free, eviction or copy that landed), up to
        ``timeout``.  Cancelled or timed out, it takes nothing.

        Raises:
            InvalidInputError: ``n`` is not an int >= 0, ``timeout`` not a finite number >= 0,
                or a ``timeout`` with tensor parallelism.
            CapacityError: too few pages even with no copy in flight (pinned by handles);
                with ``timeout``: still too few when it passed, or more than the pool holds.
            CacheClosedError: the cache is not running (or closed while waiting).
        """
        if timeout is not None:
            self._check()
            if type(n) is not int or n < 0:
                raise InvalidInputError(f"alloc_wait needs an int >= 0, got {n!r}")
            t = self._waiters.check_timeout(timeout)
            return await self._waiters.alloc(n, t) if n else torch.empty(0, dtype=torch.int64)
        while True:
            try:
                return self.alloc(n)
            except CapacityError:
                if not self._transfers.inflight:
                    raise
            coord = self._core.coordinator
            if coord.deferred:  # copies apply only through agreements
                await coord.settle_all()
            else:
                await asyncio.wait([op.future for op in self._transfers.inflight.values()])

    def free(self, kv_indices: torch.Tensor) -> None:
        """Return slots from :meth:`alloc` that were not inserted (whole pages).

        Raises:
            InvalidInputError: slots are malformed or not held by the caller (nothing freed).
        """
        self._check()
        n = kv_indices.numel() if isinstance(kv_indices, torch.Tensor) else 0
        if n % self.config.page_size:
            raise InvalidInputError(f"free needs whole pages, got {n} slots")
        pages = slots_to_pages(kv_indices, n, self.config.page_size, self.config.device_pages)
        alloc = self._dev_alloc
        if not alloc.distinct(pages) or not alloc.check(pages, PageState.HELD):
            raise InvalidInputError("free: slots not held by the caller (double free?)")
        alloc.free([pages])
        alloc.forget(kv_indices)

    @property
    def device_pool(self) -> DeviceKVPool | None:
        """The device (L1) pool, once started."""
        return self._core.device_pool

    @property
    def host_pool(self) -> HostKVPool | None:
        """The host (L2) pool, once started (``None`` without host pages)."""
        return self._core.host_pool

    @property
    def _dev_alloc(self) -> PageAllocator:
        alloc = self._core.dev_alloc
        assert alloc is not None, "cache not started"
        return alloc

    def device_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V views of ``layer``: ``[device_pages * page_size, heads, head_dim]``.

        Raises:
            InvalidInputError: ``layer`` out of range.
            CacheClosedError: the cache is not running.
        """
        self._check()
        if type(layer) is not int or not 0 <= layer < self.config.num_layers:
            raise InvalidInputError(
                f"layer must be in [0, {self.config.num_layers}), got {layer!r}"
            )
        pool = self._core.device_pool
        assert pool is not None
        return pool.kv(layer)

    def sidecar(self, name: str) -> torch.Tensor:
        """Device buffer of sidecar component ``name``: ``[device_pages, *page_shape]``.

        The model writes a page's sidecar state at the page ids of the slots ``alloc`` gave
        (``slot // page_size``) and reads it at ``m.device_pages``.

        Raises:
            InvalidInputError: no component of that name.
            CacheClosedError: the cache is not running.
        """
        self._check()
        return self._core.sidecar_buffer(name)

    def insert(
        self,
        tokens: Sequence[int] | torch.Tensor,
        kv_indices: torch.Tensor,
        *,
        prefix: MatchResult | InsertResult | None = None,
        tenant: str | None = None,
        lora: str | None = None,
        priority: int | None = None,
        retention: float | None = None,
    ) -> InsertResult:
        """Cache ``tokens`` (whole pages; an unaligned tail is not cached) with their KV.

        ``kv_indices[i]`` is the device slot of token ``i``.  Slots of new pages must come from
        :meth:`alloc`; the cache takes them.  Where the tree already has a page on device, the
        caller's own copy is *retained* by the result, not freed: it stays the caller's to
        read until :meth:`release` of the result (``r.retained_pages``; ``r.device_indices``
        are the tree's rows, to switch to if it likes).  So are its pages after a node still
        loading back.  Passing the tree's slots back (e.g. ``m.device_indices``), or rows an
        earlier result retains, is fine.  Slots of the unaligned tail stay the caller's.

        With ``prefix=`` a pinned handle of these tokens' leading part (same tenant/lora), a
        match ``m`` or the result ``r`` of the previous insert of this sequence,
        ``kv_indices`` may hold only the slots of ``tokens[len(tokens) - len(kv_indices):]``,
        which must start on a page boundary at or before ``m.device_len`` (read when the
        slots were allocated: if a load-back grew ``m`` since, the caller's copies of those
        pages are retained), or at or before ``r.inserted_len``.  The tree's own pages serve
        the rest.  The result of ``prefix=r`` retains ``r``'s rows as well, so ``r`` may be
        released right after.  ``priority`` (int in [0, 1000], soft: evicted after lower ones;
        ``retention``: seconds until it lapses to 0) is raised on every page of the path.

        Returns an :class:`InsertResult` pinning the path; ``.write_through`` is awaitable.

        Raises:
            InvalidTypeError / InvalidInputError: bad tokens, names, slots or priority, or
                tokens that do not extend ``prefix`` (nothing changed).
            HandleError: ``prefix`` was released or belongs to another cache.
            PrefixDroppedError: pages that ``prefix`` or the rows lean on left the tree (drop,
                load-back failure).
            CacheClosedError: the cache is not running.
        """
        if self._state is not _RUNNING or _get_ident() != self._core.owner:
            self._check()  # raises; the test inline: every request passes here
        toks = tokens if type(tokens) is list and tokens else token_list(tokens)  # (inline)
        ns = self._default_ns if tenant is lora is None else self._walk_ns(toks, tenant, lora)
        use = (self._core, self._transfers, self._handles, self.release)
        return insert_tokens(*use, toks, kv_indices, prefix, ns, (priority, retention))

    def release(self, handle: MatchResult | InsertResult) -> None:
        """Drop the pin of a handle from :meth:`match_prefix` or :meth:`insert`.

        Raises:
            HandleError: released twice, or a handle of another cache.
            CacheClosedError: the cache is not running.
        """
        core = self._core
        if self._state is not _RUNNING or _get_ident() != core.owner:
            self._check()  # raises; the test inline: every request passes here
        if not (type(handle) in HANDLE_TYPES and handle.core is core and handle.state is PINNED):
            check_handle(handle, Handle, core)  # (its passing case is the test inline)
        self._handles.release(handle)

    # ------------------------------------------------------------------ backups, flush

    def _backup_to_storage(self, nodes: list[Node]) -> None:
        if self._l3 is not None:
            self._l3.backup(nodes)

    async def flush(self) -> None:
        """Wait for what was in flight or queued when called: every transfer (write-through,
        write-back, load-back), the storage backups those copies start when they land, and
        the backups and background prefetches queued or running, each bounded by its
        deadline.  Work started meanwhile does not hold it up (it returns under sustained
        inserts).  When it returns, the pages of those copies and backups are in storage,
        unless their backup failed or was skipped (both counted in :meth:`statistics`).

        Failures do not raise here; they are counted in :meth:`statistics` and logged.

        Raises:
            CacheClosedError: the cache is not running.
        """
        self._check()
        await settle_work(self._core, self._transfers, self._l3)

    async def sync(self) -> None:
        """Apply the completions every rank has (TP): call once per scheduler step.

        With one rank completions apply as they land and this returns at once.

        Raises:
            CacheClosedError: the cache is not running.
            AgreementError: the ranks can no longer agree (a collective failed).
        """
        self._check()
        self._handles.release_dropped()  # (TP: handles collected unreleased, on every rank)
        await self._core.coordinator.sync()

    # ------------------------------------------------------------------ eviction

    def evict(self, num_pages: int, tier: Tier | str = Tier.DEVICE) -> int:
        """Evict at least ``num_pages`` unpinned pages of ``tier``; return pages freed now.

        Device: nodes with a host copy are demoted (still matchable from host); others are
        deleted, or, under ``write_back``, staged to host and freed when the copy lands.
        Host: host-only leaves are deleted.

        Raises:
            InvalidInputError: bad ``num_pages`` or ``tier``.
            CacheClosedError: the cache is not running.
        """
        self._check()
        if type(num_pages) is not int or num_pages < 0:
            raise InvalidInputError(f"num_pages must be an int >= 0, got {num_pages!r}")
        t = tier  # a str subclass as its characters: its own hash and repr are not asked
        if isinstance(tier, str):
            t = {"device": Tier.DEVICE, "host": Tier.HOST}.get(str.__str__(tier), str.__str__(tier))
        if t is Tier.DEVICE:
            return self._core.evict_device(num_pages, coming=False)
        if t is Tier.HOST:
            return self._core.evict_host(num_pages)
        raise InvalidInputError(f"tier must be 'device' or 'host', got {t!r}")

    # ------------------------------------------------------------------ events

    def take_events(self) -> list[KVEvent]:
        """Drain and return the buffered KV events, oldest first.

        Raises:
            OwnershipError: called from a thread other than the loop's.
        """
        self._core.check_owner()
        return self._core.events.take()


__all__ = ["CacheState", "HiCache"]
