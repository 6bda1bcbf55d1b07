"""``HiCache``: the hierarchical cache a serving loop awaits.

Every method here runs on the event-loop thread that started the cache; that thread owns the
tree, the allocators and the table of transfers in flight.  Sync methods plan a state change
and apply it at once; the copies they start run on the copy engine, whose completions come
back to :meth:`HiCache._complete` on the loop, in order with every other mutation.  A node
split re-targets a pending transfer (``_on_split``), so an ack always lands on every fragment.
"""

from __future__ import annotations

import asyncio
import enum
import threading
import time
from array import array
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import structlog
import torch

from aiocache_kv.components import usable_end
from aiocache_kv.config import CacheConfig, PrefetchPolicy, WritePolicy
from aiocache_kv.distributed import AckQueue, Request, Sequencer, SingleRank, TPGroup
from aiocache_kv.errors import (
    CacheClosedError,
    CapacityError,
    HandleError,
    InvalidInputError,
    InvalidTypeError,
    OwnershipError,
    TransferError,
)
from aiocache_kv.events import AllBlocksCleared, BlockRemoved, BlockStored, EventLog, KVEvent
from aiocache_kv.handles import HandleState, InsertResult, MatchResult, WriteAck, _Handle
from aiocache_kv.namespace import Namespace
from aiocache_kv.pools import (
    DeviceKVPool,
    HostKVPool,
    PageAllocator,
    PageState,
    admit_host_bytes,
    available_host_bytes,
    host_slot_bytes,
)
from aiocache_kv.pools.sidecar import SidecarPools
from aiocache_kv.stats import CacheStatistics, TierStatistics
from aiocache_kv.storage.integrity import FRAME_OVERHEAD
from aiocache_kv.storage.tier import PrefetchResult, PrefetchStatus, StorageTier
from aiocache_kv.transfer import CopyEngine, CopyJob, Direction, default_engine
from aiocache_kv.tree import Node, RadixTree, Tier
from aiocache_kv.tree.node import ABSENT, FILLING, RESIDENT

log = structlog.get_logger(__name__)


class CacheState(enum.IntEnum):
    """Lifecycle of a cache."""

    NEW = 0
    RUNNING = 1
    CLOSING = 2
    CLOSED = 3


class OpKind(enum.Enum):
    """Why a copy runs."""

    WRITE_THROUGH = "write_through"
    WRITE_BACK = "write_back"
    LOAD_BACK = "load_back"


class TransferOp:
    """One copy in flight and the nodes its completion applies to, in path order."""

    __slots__ = ("error", "evict_after", "future", "kind", "nbytes", "started", "targets")

    def __init__(self, kind: OpKind, targets: list[Node], future: asyncio.Future[None]) -> None:
        self.kind = kind
        self.targets = targets
        self.future = future  # set when the op is applied to the tree
        self.nbytes = 0
        self.started = time.monotonic()
        self.evict_after: Node | None = None  # write-back: the victim to demote on ack
        self.error: BaseException | None = None  # local copy failure, if any

    def __repr__(self) -> str:
        state = "done" if self.future.done() else "pending"
        return f"<TransferOp {self.kind.value} targets={len(self.targets)} {state}>"


async def _nothing() -> None:
    return None


def _consume(fut: asyncio.Future[None]) -> None:
    if not fut.cancelled():
        fut.exception()  # mark retrieved: failures are counted and logged by the cache


class HiCache:
    """Hierarchical KV cache over a device pool (L1) and a host pool (L2).

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
        if not isinstance(config, CacheConfig):
            raise InvalidTypeError(f"config must be a CacheConfig, got {type(config).__name__}")
        if tp_group is not None and not isinstance(tp_group, TPGroup):
            raise InvalidTypeError(f"tp_group must be a TPGroup, got {type(tp_group).__name__}")
        self.config = config
        self.tp_group: TPGroup = tp_group if tp_group is not None else SingleRank()
        #: with more than one rank, completions are applied only through agreements
        self._deferred = self.tp_group.world_size > 1
        self._seq: Sequencer | None = None
        self._writes: AckQueue[TransferOp] = AckQueue("write", self._apply_op)
        self._loads: AckQueue[TransferOp] = AckQueue("load", self._apply_op)
        self._device = torch.device(config.device)
        self._engine = (
            copy_engine
            if copy_engine is not None
            else default_engine(self._device, config.copy_threads)
        )
        self._state = CacheState.NEW
        self._loop: asyncio.AbstractEventLoop | None = None
        self._owner: int | None = None
        self._tree = RadixTree(config.page_size, on_split=self._on_split)
        self._events = EventLog(enabled=config.enable_kv_events)
        self._namespaces: dict[tuple[str, str], Namespace] = {}
        self._handles: dict[int, _Handle] = {}
        self._inflight: dict[int, TransferOp] = {}
        self._counters: dict[str, int] = dict.fromkeys(
            (
                "match_queries",
                "hit_tokens_device",
                "hit_tokens_host",
                "inserted_tokens",
                "write_through_started",
                "write_through_done",
                "write_through_failed",
                "write_through_skipped_pages",
                "load_back_started",
                "load_back_done",
                "load_back_failed",
                "bytes_device_to_host",
                "bytes_host_to_device",
            ),
            0,
        )
        self.device_pool: DeviceKVPool | None = None
        self.host_pool: HostKVPool | None = None
        self._dev_alloc: PageAllocator | None = None
        self._host_alloc: PageAllocator | None = None
        self._l3: StorageTier | None = None
        self._sidecars: list[SidecarPools] = []
        #: trailing-window components: (name, window pages)
        self._trailing = [
            (c.name, c.window_pages(config.page_size))
            for c in config.components
            if c.window_pages(config.page_size)
        ]

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Admit host memory, allocate the pools (off the loop) and start the copy engine.

        Raises:
            HostMemoryError: the host pools do not fit in available RAM minus the reserve.
            CacheClosedError: the cache was already started.
        """
        if self._state is not CacheState.NEW:
            raise CacheClosedError(f"cache cannot start from state {self._state.name}")
        cfg = self.config
        pin = self._device.type == "cuda" and torch.cuda.is_available()
        extra = FRAME_OVERHEAD if cfg.storage is not None else 0
        host_bytes = cfg.host_pages * host_slot_bytes(cfg.page_bytes, extra)
        host_bytes += sum(
            SidecarPools.host_bytes(c, cfg.host_pages, extra) for c in cfg.components
        )  # every pool is admitted together
        available = await asyncio.to_thread(available_host_bytes)
        admit_host_bytes(host_bytes, cfg.host_memory_reserve_bytes, available)

        def build() -> tuple[DeviceKVPool, HostKVPool | None, list[SidecarPools]]:
            dev = DeviceKVPool(
                cfg.device_pages,
                cfg.num_layers,
                cfg.page_size,
                cfg.num_kv_heads,
                cfg.head_dim,
                cfg.dtype,
                self._device,
            )
            host = (
                HostKVPool(
                    cfg.host_pages,
                    cfg.num_layers,
                    cfg.page_elems,
                    cfg.dtype,
                    extra_bytes=extra,
                    pin_memory=pin,
                )
                if cfg.host_pages
                else None
            )
            sidecars = [
                SidecarPools(
                    c,
                    cfg.device_pages,
                    cfg.host_pages,
                    self._device,
                    extra_bytes=extra,
                    pin_memory=pin,
                )
                for c in cfg.components
            ]
            return dev, host, sidecars

        self.device_pool, self.host_pool, self._sidecars = await asyncio.to_thread(build)
        self._dev_alloc = PageAllocator(cfg.device_pages, "device")
        self._host_alloc = PageAllocator(cfg.host_pages, "host") if cfg.host_pages else None
        self._loop = asyncio.get_running_loop()
        self._owner = threading.get_ident()
        self._tree.bind_owner(self._owner)
        if cfg.storage is not None:
            self._l3 = StorageTier(self, cfg.storage)
            await self._l3.start()
        self._engine.start(self._loop)
        if self._deferred:
            self._seq = Sequencer(self.tp_group, self._loop)
            self._seq.start()
        self._state = CacheState.RUNNING
        log.info(
            "cache_started",
            device=str(self._device),
            device_pages=cfg.device_pages,
            host_pages=cfg.host_pages,
            page_size=cfg.page_size,
            write_policy=WritePolicy(cfg.write_policy).value,
            host_bytes=host_bytes,
        )

    async def aclose(self) -> None:
        """Settle every transfer in flight, stop the engine and end event streams."""
        if self._state in (CacheState.CLOSING, CacheState.CLOSED):
            return
        if self._state is CacheState.NEW:
            self._state = CacheState.CLOSED
            return
        self._state = CacheState.CLOSING
        try:
            if self._deferred:
                await self._flush()  # every rank closes at the same point of its loop
            await self._engine.aclose()  # runs what is queued; completions reach the loop
            await self._wait_inflight()
            if self._l3 is not None:
                await self._l3.aclose()
            if self._seq is not None:
                await self._seq.aclose()
        finally:
            if self._events.enabled:
                self._events.append(AllBlocksCleared())
            self._events.close()
            self._state = CacheState.CLOSED
            log.info("cache_closed", **self._counters)

    async def __aenter__(self) -> HiCache:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _check(self) -> None:
        if self._state is not CacheState.RUNNING:
            raise CacheClosedError(f"cache is {self._state.name.lower()}")
        if threading.get_ident() != self._owner:
            raise OwnershipError(
                f"HiCache used from thread {threading.current_thread().name!r}; only the "
                "event-loop thread that started it may call it"
            )

    # ------------------------------------------------------------------ input checks

    def _ns(self, tenant: str | None, lora: str | None) -> Namespace:
        key = (tenant or "", lora or "")
        ns = self._namespaces.get(key)
        if ns is None:
            ns = Namespace(self.config.namespace, *key)
            self._namespaces[key] = ns
        return ns

    def _tokens(self, tokens: Sequence[int] | torch.Tensor) -> list[int]:
        if isinstance(tokens, torch.Tensor):
            if tokens.dim() != 1 or tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
                raise InvalidInputError(
                    f"tokens tensor must be 1-D integer, got {tokens.dtype} {tuple(tokens.shape)}"
                )
            out: list[int] = tokens.tolist()
        elif isinstance(tokens, (list, tuple)):
            out = tokens if isinstance(tokens, list) else list(tokens)
        else:
            raise InvalidTypeError(f"tokens must be a list of ints, got {type(tokens).__name__}")
        if not out:
            raise InvalidInputError("tokens must not be empty")
        try:
            array("Q", out)  # one C pass: rejects non-ints, negatives and ids >= 2**64
        except TypeError as exc:
            bad = next((t for t in out if type(t) is not int), None)
            raise InvalidTypeError(f"tokens must be ints; found {bad!r} ({exc})") from None
        except OverflowError:
            bad = next(t for t in out if not 0 <= t < 1 << 64)
            raise InvalidInputError(f"tokens must be in [0, 2**64); found {bad}") from None
        return out

    def _slots_to_pages(self, slots: Any, n: int) -> torch.Tensor:
        """Validate device token slots for ``n`` aligned tokens; return their page ids."""
        cfg = self.config
        if not isinstance(slots, torch.Tensor):
            raise InvalidTypeError(f"kv_indices must be a torch.Tensor, got {type(slots).__name__}")
        if slots.dim() != 1 or slots.dtype not in (torch.int64, torch.int32):
            raise InvalidInputError(
                f"kv_indices must be 1-D int64, got {slots.dtype} {tuple(slots.shape)}"
            )
        if not slots.is_cpu:
            slots = slots.cpu()
        slots = slots[:n]
        if slots.dtype != torch.int64:
            slots = slots.to(torch.int64)
        limit = cfg.device_pages * cfg.page_size
        arr = slots.numpy()
        if n and (arr.min() < 0 or arr.max() >= limit):
            lo, hi = int(arr.min()), int(arr.max())
            raise InvalidInputError(f"kv_indices out of range [0, {limit}): min {lo} max {hi}")
        p = cfg.page_size
        if p == 1:
            out: torch.Tensor = slots.clone()  # the tree keeps it; the caller may reuse theirs
            return out
        grid = slots.view(-1, p)
        first = grid[:, 0]
        if bool((first % p != 0).any()) or not torch.equal(grid, first[:, None] + torch.arange(p)):
            raise InvalidInputError(
                f"kv_indices must cover whole pages (page_size {p}): each run of {p} slots must "
                "be page*page_size + 0..page_size-1, as returned by alloc()"
            )
        pages: torch.Tensor = first // p
        return pages

    # ------------------------------------------------------------------ match / load back

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
            InvalidTypeError / InvalidInputError: tokens are not non-negative ints or empty.
            CacheClosedError: the cache is not running.
        """
        self._check()
        toks = self._tokens(tokens)
        ns = self._ns(tenant, lora)
        p = self.config.page_size
        tree = self._tree
        tree.root(ns, ns.tag)
        node, _ = tree.match(ns, toks, len(toks) // p * p, pin=True)
        m = MatchResult(self, node)
        self._handles[id(m)] = m
        c = self._counters
        c["match_queries"] += 1
        if node.parent is not None:
            tree.record_hit(node)
            dev, host = m._split()
            c["hit_tokens_device"] += sum(len(n.key) for n in dev)
            c["hit_tokens_host"] += sum(len(n.key) for n in host)
            if self.config.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
                threshold = self.config.write_through_threshold
                self._backup(
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
            InvalidTypeError / InvalidInputError: bad tokens or policy (nothing changed).
            CacheClosedError: the cache is not running.
        """
        self._check()
        toks = self._tokens(tokens)
        try:
            pol = PrefetchPolicy(policy if policy is not None else self.config.prefetch_policy)
        except ValueError:
            raise InvalidInputError(f"unknown prefetch policy {policy!r}") from None
        ns = self._ns(tenant, lora)
        if self._l3 is None:
            return PrefetchResult(PrefetchStatus.NO_STORAGE, 0, 0, 0)
        p = self.config.page_size
        self._tree.root(ns, ns.tag)
        return await self._l3.prefetch(ns, toks, len(toks) // p * p, pol)

    async def load_back(self, m: MatchResult) -> MatchResult:
        """Copy the host-resident part of ``m`` to device; ``m`` then reports it on device.

        Cancelling the await does not cancel the copy: it lands (the pages become
        device-resident, owned by the tree) and nothing leaks.  ``m`` stays pinned either way.
        Nodes below one that another ``load_back`` is still filling are copied once that copy
        has landed (nothing may be on device below a node whose load can still fail).

        Raises:
            CapacityError: not enough device pages even after eviction (nothing changed).
            TransferError: the copy failed (or another load_back's copy of a node above);
                the nodes stay host-only.
            HandleError: ``m`` was released or belongs to another cache.
        """
        self._check()
        self._check_handle(m, MatchResult)
        _, host_nodes = m._split()
        waits: list[asyncio.Future[None]] = []
        to_load: list[Node] = []
        for node in host_nodes:
            if node.device is FILLING:
                waits.append(node.op.future)
            else:
                to_load.append(node)
        below_loading = bool(waits and to_load)  # to_load hangs below a FILLING node
        if to_load and not below_loading:
            op = self._start_load(to_load)
            waits.append(op.future)
        if waits and self._deferred:
            loads = self._loads
            upto = loads.submitted
            await self._agree(lambda: loads.wait_landed(upto))
        if waits:
            await asyncio.wait(waits)
            failed = [f.exception() for f in waits if f.exception() is not None]
            if failed:
                raise TransferError(f"load-back failed: {failed[0]}") from failed[0]
        if below_loading:
            return await self.load_back(m)  # the nodes above have landed: now the rest
        return m

    def _start_load(self, nodes: list[Node]) -> TransferOp:
        assert self.host_pool is not None and self.device_pool is not None
        need = sum(len(n.key) for n in nodes) // self.config.page_size
        dst = self._alloc_device(need)
        src = torch.cat([n.host_pages for n in nodes])  # type: ignore[misc]
        op = TransferOp(OpKind.LOAD_BACK, list(nodes), self._new_future())
        off = 0
        for node in nodes:
            k = len(node.key) // self.config.page_size
            self._tree.begin_device_fill(node, dst[off : off + k], op)
            off += k
        self._counters["load_back_started"] += 1
        self._submit(
            op,
            CopyJob(
                Direction.H2D,
                self.device_pool.buffer,
                self.host_pool.pages,
                src,
                dst,
                self._sidecar_pairs(),
            ),
        )
        return op

    # ------------------------------------------------------------------ alloc / insert

    def alloc(self, n: int) -> torch.Tensor:
        """Device token slots for ``n`` tokens, in whole pages (``ceil(n / page_size)`` pages).

        The caller owns them until it passes them to :meth:`insert` or :meth:`free`.

        Raises:
            InvalidInputError: ``n`` is not a positive int.
            CapacityError: too few free pages even after evicting (nothing taken).
        """
        self._check()
        if type(n) is not int or n < 1:
            raise InvalidInputError(f"alloc needs a positive int, got {n!r}")
        p = self.config.page_size
        pages = self._alloc_device(-(-n // p), PageState.HELD)
        if p == 1:
            return pages
        return (pages[:, None] * p + torch.arange(p)).flatten()

    async def alloc_wait(self, n: int) -> torch.Tensor:
        """Like :meth:`alloc`, but when pages are only held back by copies in flight
        (write-through acks, write-back staging), wait for those copies and retry.

        Raises:
            InvalidInputError: ``n`` is not a positive int.
            CapacityError: too few pages even with no copy in flight (pinned by handles).
        """
        while True:
            try:
                return self.alloc(n)
            except CapacityError:
                if not self._inflight:
                    raise
            if self._deferred:
                await self._agree_all_landed()
            else:
                await asyncio.wait([op.future for op in self._inflight.values()])

    def free(self, kv_indices: torch.Tensor) -> None:
        """Return slots from :meth:`alloc` that were not inserted (whole pages).

        Raises:
            InvalidInputError: slots are malformed or not held by the caller (nothing freed).
        """
        self._check()
        n = kv_indices.numel() if isinstance(kv_indices, torch.Tensor) else 0
        if n % self.config.page_size:
            raise InvalidInputError(f"free needs whole pages, got {n} slots")
        pages = self._slots_to_pages(kv_indices, n)
        assert self._dev_alloc is not None
        if not self._dev_alloc.distinct(pages) or not self._dev_alloc.check(pages, PageState.HELD):
            raise InvalidInputError("free: slots not held by the caller (double free?)")
        self._dev_alloc.free([pages])

    def _alloc_device(self, n: int, state: PageState = PageState.OWNED) -> torch.Tensor:
        alloc = self._dev_alloc
        assert alloc is not None
        if alloc.num_free < n:
            self._evict_device(n - alloc.num_free)
        if alloc.num_free < n:
            raise CapacityError(
                f"device pool: need {n} pages, {alloc.num_free} free, "
                f"{self._tree.dev_evictable} evictable, {self._tree.dev_protected} protected"
            )
        return alloc.alloc(n, state)

    def _alloc_host(self, n: int) -> torch.Tensor | None:
        alloc = self._host_alloc
        if alloc is None:
            return None
        if alloc.num_free < n:
            self._evict_host(n - alloc.num_free)
        if alloc.num_free < n:
            return None
        return alloc.alloc(n)

    def device_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V views of ``layer``: ``[device_pages * page_size, heads, head_dim]``.

        Raises:
            InvalidInputError: ``layer`` out of range.
        """
        self._check()
        if type(layer) is not int or not 0 <= layer < self.config.num_layers:
            raise InvalidInputError(
                f"layer must be in [0, {self.config.num_layers}), got {layer!r}"
            )
        assert self.device_pool is not None
        return self.device_pool.kv(layer)

    def sidecar(self, name: str) -> torch.Tensor:
        """Device buffer of sidecar component ``name``: ``[device_pages, *page_shape]``.

        The model writes a page's sidecar state at the page ids of the slots ``alloc`` gave
        (``slot // page_size``) and reads it at ``m.device_pages``.

        Raises:
            InvalidInputError: no component of that name.
        """
        self._check()
        for sc in self._sidecars:
            if sc.component.name == name:
                buf: torch.Tensor = sc.device
                return buf
        names = [sc.component.name for sc in self._sidecars]
        raise InvalidInputError(f"no sidecar component {name!r}; configured: {names}")

    def _sidecar_pairs(self) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        return tuple((sc.device, sc.host) for sc in self._sidecars)

    def _usable_path(self, path: list[Node]) -> list[Node]:
        """Cut ``path`` where every trailing-window component still has its whole window."""
        if not self._trailing or not any(n.invalid for n in path):
            return path
        p = self.config.page_size
        sizes = [len(n.key) // p for n in path]
        total = sum(sizes)
        trailing = []
        for name, window in self._trailing:
            valid: list[bool] = []
            for node, k in zip(path, sizes, strict=True):
                valid += [name not in node.invalid] * k
            trailing.append((window, valid, 0))
        end = usable_end(total, trailing, total)
        out: list[Node] = []
        acc = 0
        for node, k in zip(path, sizes, strict=True):
            if acc + k > end:
                break
            out.append(node)
            acc += k
        return out

    def insert(
        self,
        tokens: Sequence[int] | torch.Tensor,
        kv_indices: torch.Tensor,
        *,
        tenant: str | None = None,
        lora: str | None = None,
    ) -> InsertResult:
        """Cache ``tokens`` (whole pages; an unaligned tail is not cached) with their KV.

        ``kv_indices[i]`` is the device slot of token ``i``.  Slots of new pages must come from
        :meth:`alloc`; the cache takes them.  Where the tree already has the prefix on device,
        the caller's own duplicate pages are freed (passing the tree's slots back, e.g. from
        ``m.device_indices``, is fine).  Slots of the unaligned tail stay the caller's.

        Returns an :class:`InsertResult` pinning the path; ``.write_through`` is awaitable.

        Raises:
            InvalidTypeError / InvalidInputError: bad tokens or slots (nothing changed).
            CacheClosedError: the cache is not running.
        """
        self._check()
        toks = self._tokens(tokens)
        if (
            isinstance(kv_indices, torch.Tensor)
            and kv_indices.dim() == 1
            and kv_indices.numel() != len(toks)
        ):
            raise InvalidInputError(
                f"kv_indices has {kv_indices.numel()} slots for {len(toks)} tokens"
            )
        p = self.config.page_size
        n = len(toks) // p * p
        pages = self._slots_to_pages(kv_indices, n)
        ns = self._ns(tenant, lora)
        tree = self._tree
        alloc = self._dev_alloc
        assert alloc is not None
        # validate ownership before changing anything (not even a new namespace's root)
        existing = self._device_prefix(ns, toks, n)
        d = existing.numel()
        if not alloc.distinct(pages):
            raise InvalidInputError("kv_indices repeat a page")
        same = pages[:d].numpy() == existing.numpy()
        held = alloc.mask(pages, PageState.HELD)
        if not (held[:d] | same).all() or not held[d:].all():
            raise InvalidInputError(
                "kv_indices name pages the caller does not hold (not from alloc(), already "
                "inserted elsewhere, or freed)"
            )
        tree.root(ns, ns.tag)
        out = tree.insert(ns, toks, n, pages)
        kept = out.inserted_tokens // p  # the walk stops below a node that is still loading
        if d and not same.all():
            alloc.free([torch.from_numpy(pages[:d].numpy()[~same])])
        if kept > d:
            alloc.set_state(pages[d:kept], PageState.OWNED)
        if n // p > kept:
            alloc.free([pages[kept:]])
        self._counters["inserted_tokens"] += out.inserted_tokens - out.prefix_tokens
        if self._events.enabled:
            for node in out.adopted + out.created:
                self._emit_stored(node, Tier.DEVICE)
        ack = None
        if self.config.write_policy is WritePolicy.WRITE_THROUGH and n:
            op = self._backup(tree.path(out.node), OpKind.WRITE_THROUGH)
            if op is not None:
                ack = WriteAck(op.future)
        r = InsertResult(self, out.node, out.prefix_tokens, out.inserted_tokens, ack)
        self._handles[id(r)] = r
        return r

    def _device_prefix(self, ns: Namespace, toks: list[int], n: int) -> torch.Tensor:
        """Device pages the tree holds for the leading part of ``toks[:n]`` (no mutation).

        Ends after a node that is still loading, as :meth:`RadixTree.insert` does.
        """
        root = self._tree._roots.get(ns)
        if root is None:
            return torch.empty(0, dtype=torch.int64)
        node = root
        p = self.config.page_size
        pos = 0
        parts: list[torch.Tensor] = []
        while pos < n:
            child = node.children.get(toks[pos] if p == 1 else tuple(toks[pos : pos + p]))
            if child is None or child.device is ABSENT:
                break
            key = child.key
            if pos + len(key) <= n and toks[pos : pos + len(key)] == key:
                parts.append(child.device_pages)  # type: ignore[arg-type]
                pos += len(key)
                node = child
                if child.device is FILLING:
                    break
                continue
            common = self._tree._common(key, toks, pos, min(len(key), n - pos))
            parts.append(child.device_pages[: common // p])  # type: ignore[index]
            break
        if not parts:
            return torch.empty(0, dtype=torch.int64)
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def release(self, handle: MatchResult | InsertResult) -> None:
        """Drop the pin of a handle from :meth:`match_prefix` or :meth:`insert`.

        Raises:
            HandleError: released twice, or a handle of another cache.
        """
        self._check()
        self._check_handle(handle, _Handle)
        handle.state = HandleState.RELEASED
        del self._handles[id(handle)]
        self._tree.unpin(handle._node)

    def _check_handle(self, handle: object, kind: type) -> None:
        if not isinstance(handle, kind):
            raise InvalidTypeError(f"expected a {kind.__name__}, got {type(handle).__name__}")
        h: _Handle = handle  # type: ignore[assignment]
        if h._cache is not self:
            raise HandleError("handle belongs to another cache")
        if h.state is not HandleState.PINNED:
            raise HandleError(f"handle already {h.state.name.lower()}")

    # ------------------------------------------------------------------ backup / acks

    def _backup(self, path: list[Node], kind: OpKind) -> TransferOp | None:
        """Start copying the device-only nodes of ``path`` (root-most first) to host."""
        nodes = [n for n in path if n.host is ABSENT and n.device is RESIDENT]
        if not nodes or self.host_pool is None or self.device_pool is None:
            return None
        p = self.config.page_size
        need = sum(len(n.key) for n in nodes) // p
        dst = self._alloc_host(need)
        if dst is None:  # all or nothing keeps host presence prefix-closed
            self._counters["write_through_skipped_pages"] += need
            log.debug("backup_skipped", pages=need, reason="host pool full")
            return None
        src = torch.cat([n.device_pages for n in nodes])  # type: ignore[misc]
        op = TransferOp(kind, nodes, self._new_future())
        off = 0
        for node in nodes:
            k = len(node.key) // p
            self._tree.begin_host_fill(node, dst[off : off + k], op)
            off += k
        self._counters["write_through_started"] += 1
        self._submit(
            op,
            CopyJob(
                Direction.D2H,
                self.device_pool.buffer,
                self.host_pool.pages,
                src,
                dst,
                self._sidecar_pairs(),
            ),
        )
        return op

    def _new_future(self) -> asyncio.Future[None]:
        assert self._loop is not None
        fut: asyncio.Future[None] = self._loop.create_future()
        fut.add_done_callback(_consume)
        return fut

    def _submit(self, op: TransferOp, job: CopyJob) -> None:
        op.nbytes = job.nbytes
        self._inflight[id(op)] = op
        if self._deferred:
            assert self._loop is not None
            (self._loads if op.kind is OpKind.LOAD_BACK else self._writes).push(op, self._loop)
        self._engine.submit(job, lambda err: self._complete(op, err))

    def _on_split(self, head: Node, tail: Node) -> None:
        """A node with a transfer in flight was split: the transfer now covers both parts."""
        if tail.op is not None:
            op: TransferOp = tail.op
            op.targets.insert(op.targets.index(tail), head)
        if tail.backup is not None:
            assert self._l3 is not None
            self._l3.retarget(head, tail)

    def _complete(self, op: TransferOp, err: BaseException | None) -> None:
        """A copy finished (on the loop): apply it now, or queue it for agreement (TP)."""
        op.error = err
        if not self._deferred:
            self._apply_op(op, err is None)
        else:
            (self._loads if op.kind is OpKind.LOAD_BACK else self._writes).land(op, err is None)

    def _apply_op(self, op: TransferOp, ok: bool) -> None:
        """Apply a finished copy to the tree (on the loop).  Every target, in path order."""
        del self._inflight[id(op)]
        tree = self._tree
        err = op.error if op.error is not None else "failed on another rank"
        c = self._counters
        freed: list[torch.Tensor] = []
        if op.kind is OpKind.LOAD_BACK:
            # a failed load rolls back children first: device presence stays prefix-closed
            for node in op.targets if ok else reversed(op.targets):
                pages = tree.end_device_fill(node, ok)
                if pages is not None:
                    freed.append(pages)
                elif self._events.enabled:
                    self._emit_stored(node, Tier.DEVICE)
            if freed:
                assert self._dev_alloc is not None
                self._dev_alloc.free(freed)
            c["load_back_done" if ok else "load_back_failed"] += 1
            if ok:
                c["bytes_host_to_device"] += op.nbytes
        else:
            for node in op.targets:
                pages = tree.end_host_fill(node, ok)
                if pages is not None:
                    freed.append(pages)
                elif self._events.enabled:
                    self._emit_stored(node, Tier.HOST)
            if ok and self._l3 is not None:
                self._l3.backup(op.targets)  # every fragment, including split heads
            if freed:
                assert self._host_alloc is not None
                self._host_alloc.free(freed)
            c["write_through_done" if ok else "write_through_failed"] += 1
            if ok:
                c["bytes_device_to_host"] += op.nbytes
                if op.evict_after is not None and op.evict_after.alive:
                    self._demote(op.evict_after)
        if not ok:
            log.error("transfer_failed", kind=op.kind.value, nodes=len(op.targets), error=repr(err))
        if not op.future.done():
            if ok:
                op.future.set_result(None)
            else:
                op.future.set_exception(TransferError(f"{op.kind.value} copy failed: {err!r}"))

    def _demote(self, node: Node) -> None:
        """Write-back finished for an eviction victim: drop its device copy if still idle."""
        tree = self._tree
        pages = tree.demote(node)
        if pages is None:
            return
        assert self._dev_alloc is not None
        self._dev_alloc.free([pages])
        if self._events.enabled:
            self._emit_removed([node], Tier.DEVICE)

    async def _wait_inflight(self) -> None:
        while self._inflight:
            await asyncio.wait([op.future for op in self._inflight.values()])

    async def flush(self) -> None:
        """Wait until every transfer in flight (write-through, write-back, load-back) landed.

        Failures do not raise here; they are counted in :meth:`statistics` and logged.

        Raises:
            CacheClosedError: the cache is not running.
        """
        self._check()
        await self._flush()

    async def _flush(self) -> None:
        if self._deferred:
            # one agreement per round; a round can start backups, so repeat until idle
            assert self._seq is not None
            while self._inflight or (self._l3 is not None and self._l3.backups_pending):
                await self._agree_all_landed()
            if self._seq.pending:
                await self._agree(_nothing)
        while True:
            await self._wait_inflight()
            if self._l3 is None or not self._l3.in_flight:
                break
            await self._l3.settle()

    async def sync(self) -> None:
        """Apply the completions every rank has (TP): call once per scheduler step.

        With one rank completions apply as they land and this returns at once.

        Raises:
            CacheClosedError: the cache is not running.
            AgreementError: the ranks can no longer agree (a collective failed).
        """
        self._check()
        if self._deferred:
            await self._agree(_nothing)

    def _queues(self) -> list[AckQueue[Any]]:
        qs: list[AckQueue[Any]] = [self._writes, self._loads]
        if self._l3 is not None:
            qs.append(self._l3.acks)
        return qs

    def agreement(
        self,
        ready: Callable[[], Awaitable[None]],
        width: int = 0,
        pack: Callable[[], list[int]] | None = None,
        apply: Callable[[list[int]], None] | None = None,
    ) -> Request:
        """Take the next ticket for an agreement on every ack queue plus ``width`` extra ints.

        ``pack`` gives the extra local values, ``apply`` receives the agreed ones.
        """
        assert self._seq is not None, "agreements exist only with more than one rank"
        queues = self._queues()
        upto = [q.submitted for q in queues]
        widths: list[int] = []

        def pack_all() -> list[int]:
            vec: list[int] = []
            widths.clear()
            for q, u in zip(queues, upto, strict=True):
                part = q.pack(u)
                widths.append(len(part))
                vec += part
            extra = pack() if pack is not None else []
            assert len(extra) == width, f"agreement extra width {len(extra)} != {width}"
            return vec + extra

        def plan(agreed: list[int]) -> None:
            pos = 0
            for q, w in zip(queues, widths, strict=True):
                q.plan(agreed[pos : pos + w])
                pos += w

        def apply_all(agreed: list[int]) -> None:
            for q in queues:
                q.apply_next()
            if apply is not None:
                apply(agreed[sum(widths) :])

        return self._seq.submit(Request(ready, pack_all, plan, apply_all))

    async def _agree(self, ready: Callable[[], Awaitable[None]]) -> None:
        assert self._seq is not None
        await self._seq.settle(self.agreement(ready))

    async def _agree_all_landed(self) -> None:
        queues = self._queues()
        upto = [q.submitted for q in queues]

        async def ready() -> None:
            for q, u in zip(queues, upto, strict=True):
                await q.wait_landed(u)

        await self._agree(ready)

    # ------------------------------------------------------------------ eviction

    def evict(self, num_pages: int, tier: Tier | str = Tier.DEVICE) -> int:
        """Evict at least ``num_pages`` unpinned pages of ``tier``; return pages freed now.

        Device: nodes with a host copy are demoted (still matchable from host); others are
        deleted, or, under ``write_back``, staged to host and freed when the copy lands.
        Host: host-only leaves are deleted.

        Raises:
            InvalidInputError: bad ``num_pages`` or ``tier``.
        """
        self._check()
        if type(num_pages) is not int or num_pages < 0:
            raise InvalidInputError(f"num_pages must be an int >= 0, got {num_pages!r}")
        t = (
            {"device": Tier.DEVICE, "host": Tier.HOST}.get(tier, tier)
            if isinstance(tier, str)
            else tier
        )
        if t is Tier.DEVICE:
            return self._evict_device(num_pages)
        if t is Tier.HOST:
            return self._evict_host(num_pages)
        raise InvalidInputError(f"tier must be 'device' or 'host', got {tier!r}")

    def _evict_device(self, num_pages: int) -> int:
        stage = self._stage if self.config.write_policy is WritePolicy.WRITE_BACK else None
        ev = self._tree.evict_device(num_pages, stage)
        assert self._dev_alloc is not None
        self._dev_alloc.free(ev.pages)
        if ev.host_pages:
            assert self._host_alloc is not None
            self._host_alloc.free(ev.host_pages)
        if self._events.enabled:
            self._emit_removed(ev.nodes, Tier.DEVICE)
            self._emit_removed(ev.host_nodes, Tier.HOST)
        return ev.num_pages

    def _emit_removed(self, nodes: list[Node], tier: Tier) -> None:
        if nodes:
            hashes = [h for node in nodes for h in self._tree.block_hashes(node)]
            self._events.append(BlockRemoved(hashes, tier.medium))

    def _stage(self, node: Node) -> bool:
        """Write-back: start copying an eviction victim (and its host-less ancestors) to host."""
        op = self._backup(self._tree.path(node), OpKind.WRITE_BACK)
        if op is None:
            return False
        op.evict_after = node
        return True

    def _evict_host(self, num_pages: int) -> int:
        if self._host_alloc is None:
            return 0
        ev = self._tree.evict_host(num_pages)
        self._host_alloc.free(ev.pages)
        if self._events.enabled:
            self._emit_removed(ev.nodes, Tier.HOST)
        return ev.num_pages

    # ------------------------------------------------------------------ events

    def _emit_stored(self, node: Node, tier: Tier) -> None:
        tree = self._tree
        self._events.append(
            BlockStored(
                block_hashes=list(tree.block_hashes(node)),
                parent_block_hash=tree.parent_hash(node),
                token_ids=list(node.key),
                block_size=self.config.page_size,
                medium=tier.medium,
            )
        )

    def take_events(self) -> list[KVEvent]:
        """Drain and return the buffered KV events, oldest first."""
        return self._events.take()

    def events(self) -> AsyncIterator[KVEvent]:
        """Async iterator over KV events as they happen; ends when the cache closes."""
        return self._events.stream()

    # ------------------------------------------------------------------ introspection

    def statistics(self) -> CacheStatistics:
        """A frozen snapshot of sizes, hits and operations in flight."""
        tree = self._tree

        def tier(alloc: PageAllocator | None, ev: int, prot: int) -> TierStatistics:
            if alloc is None:
                return TierStatistics(0, 0, 0, 0, 0)
            return TierStatistics(
                alloc.num_pages, alloc.num_free, alloc.count(PageState.HELD), ev, prot
            )

        return CacheStatistics(
            device=tier(self._dev_alloc, tree.dev_evictable, tree.dev_protected),
            host=tier(self._host_alloc, tree.host_evictable, tree.host_protected),
            nodes=tree.num_nodes,
            namespaces=sum(1 for _ in tree.roots()),
            ops_in_flight=len(self._inflight),
            events_published=self._events.published,
            storage_in_flight=self._l3.in_flight if self._l3 is not None else 0,
            prefetch_reserved_pages=self._l3.reserved_pages if self._l3 is not None else 0,
            **self._counters,
            **(self._l3.counters if self._l3 is not None else {}),
        )

    def check_invariants(self) -> None:
        """Recompute every counter and cross-check tree, allocators and transfers.

        Raises:
            AssertionError: naming the broken invariant.
        """
        handle_pins: dict[int, int] = {}
        for h in self._handles.values():
            assert h.state is HandleState.PINNED, f"released handle still registered {h!r}"
            if h._node.parent is not None:
                handle_pins[id(h._node)] = handle_pins.get(id(h._node), 0) + 1
            assert h._node.alive, f"handle pins a removed node {h!r}"
        self._tree.check_invariants(handle_pins)
        if self._dev_alloc is not None:
            self._dev_alloc.check_invariants(self._tree.device_pages_in_tree())
        if self._host_alloc is not None:
            reserved = list(self._l3.reserved.values()) if self._l3 is not None else []
            self._host_alloc.check_invariants(self._tree.host_pages_in_tree() + reserved)
        for op in self._inflight.values():
            assert not op.future.done(), f"settled op still in flight {op!r}"
            for node in op.targets:
                assert node.op is op, f"{op!r} target {node!r} points elsewhere"
        for node in self._tree.walk():
            if node.op is not None:
                assert id(node.op) in self._inflight, f"{node!r} points at a settled op"

    def __repr__(self) -> str:
        if self._dev_alloc is None:
            return f"<HiCache {self._state.name}>"
        t = self._tree
        return (
            f"<HiCache {self._state.name} nodes={t.num_nodes} "
            f"device={self._dev_alloc.num_pages - self._dev_alloc.num_free}/"
            f"{self._dev_alloc.num_pages} (evictable={t.dev_evictable} "
            f"protected={t.dev_protected}) "
            f"host={t.host_evictable + t.host_protected}/"
            f"{self._host_alloc.num_pages if self._host_alloc else 0} "
            f"(evictable={t.host_evictable} protected={t.host_protected}) "
            f"in_flight={len(self._inflight)}>"
        )
