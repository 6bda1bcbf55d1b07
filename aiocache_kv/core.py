"""``CacheCore``: the loop-side state of one cache, below the ``HiCache`` facade.

The core owns what only the event-loop thread may touch: the radix tree, the pools and their
allocators, the event log and the counters.  Its methods are the operations its collaborators
need (allocate with eviction, free, evict, demote, emit events, cut a path at the sidecars'
windows) so that the transfers (:mod:`aiocache_kv.transfer.ops`), the storage tier
(:mod:`aiocache_kv.storage.tier`) and the handles depend on the core, never on the facade or
on each other's private state.  Nothing here waits: every method is a synchronous step on the
loop (docs/ARCHITECTURE.md, rule 1).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np
import torch

from aiocache_kv.components import usable_end
from aiocache_kv.config import CacheConfig
from aiocache_kv.distributed.coordinator import Coordinator, coordinator_for
from aiocache_kv.distributed.group import TPGroup
from aiocache_kv.distributed.layout import tp_layout
from aiocache_kv.errors import CapacityError, InvalidInputError, OwnershipError
from aiocache_kv.events import BlockRemoved, BlockStored, EventLog, KVEvent
from aiocache_kv.events.kv_events import namespace_fields
from aiocache_kv.fastcheck import INSERT_NOT_HELD, exact_ints
from aiocache_kv.hardpins import HardPins
from aiocache_kv.namespace import Namespace
from aiocache_kv.pools import DeviceKVPool, HostKVPool, PageAllocator, PageState
from aiocache_kv.pools.allocator import PageIds
from aiocache_kv.pools.sidecar import SidecarPools
from aiocache_kv.quotas import DEVICE, HOST, QuotaBook, tenant_of
from aiocache_kv.stats import CacheCounters
from aiocache_kv.telemetry import Latencies
from aiocache_kv.tree import Node, RadixTree, Tier
from aiocache_kv.tree.node import RESIDENT, lacking
from aiocache_kv.tree.results import Eviction, InsertPlan
from aiocache_kv.validate import raise_for_insert

SplitHook = Callable[[Node, Node], None]
_NO_IDS = np.empty(0, dtype=np.int64)
_DEVICE = Tier.DEVICE  # bound once: an enum class attribute read is slow on Python 3.11


def _on_path(plan: InsertPlan, upto: int, anchor: Node | None) -> bool:
    """Whether the node the walk of ``plan`` covers token ``upto - 1`` with is ``anchor`` or
    one of its ancestors (``anchor`` ``None``: no path to keep to)."""
    if anchor is None:
        return True
    pos = 0
    node = plan.split
    for step in plan.steps:
        pos += len(step.key)
        if pos >= upto:
            node = step
            break
    while anchor is not None:  # a short walk up: paths are a few nodes deep
        if anchor is node:
            return True
        anchor = anchor.parent
    return False


def _consume(fut: asyncio.Future[None]) -> None:
    if not fut.cancelled():
        fut.exception()  # mark retrieved: failures are counted and logged where they happen


class CacheCore:
    """Tree, pools, allocators, events and counters of one cache (loop-owned)."""

    def __init__(self, config: CacheConfig, tp_group: TPGroup) -> None:
        self.config = config
        self.page_size = config.page_size
        self.device = torch.device(config.device)
        self.tp_group = tp_group
        #: applies completions at once (one rank) or through agreements (TP)
        self.coordinator: Coordinator = coordinator_for(tp_group, tp_layout(config))
        self.tree = RadixTree(config.page_size, on_split=self._on_split)
        self.events = EventLog(enabled=config.enable_kv_events)
        self.counters = CacheCounters()
        self.latencies = Latencies()  #: observed when copies, backups, prefetches end
        self.loop: asyncio.AbstractEventLoop | None = None
        self.owner: int | None = None
        self.device_pool: DeviceKVPool | None = None
        self.host_pool: HostKVPool | None = None
        self.dev_alloc: PageAllocator | None = None
        self.host_alloc: PageAllocator | None = None
        self.sidecars: list[SidecarPools] = []
        #: trailing-window components: (name, window pages)
        self.trailing = [
            (c.name, c.window_pages(config.page_size))
            for c in config.components
            if c.window_pages(config.page_size)
        ]
        #: write-back: starts staging an eviction victim to host (set by the transfers)
        self.stager: Callable[[Node], bool] | None = None
        #: device pages of victims being staged (write-back): freed when their copies land;
        #: and by tenant (:meth:`count_staging`)
        self.staging = 0
        self.staging_of: dict[str, int] = {}
        #: called on the loop when device pages may have become free or evictable (set by
        #: the capacity waiters; see :meth:`capacity_changed`)
        self.on_capacity: Callable[[], None] | None = None
        #: also called by :meth:`capacity_changed` (``purge.py``: dropped nodes may be idle)
        self.idle_hooks: list[Callable[[], None]] = []
        #: a drop's zeroing of freed pages, or the drop of pages that failed verification at
        #: load-back, in flight (``purge.py``; ``flush`` waits for them)
        self.zeroing: set[asyncio.Task[Any]] = set()
        self._split_hooks: list[SplitHook] = []
        #: hard pins with expiry (``cache.pin``): the tree pins they hold and their timer
        self.hard_pins = HardPins(self.tree, config)
        self._quota_pass = False  # an enforcement pass is scheduled
        #: the cache is closing (``shutdown.close_parts``): no quota pass runs any more (its
        #: evictions would stage copies on a closed engine and change the tree after the
        #: closing events)
        self.closing = False

    # ------------------------------------------------------------------ binding

    def bind(
        self,
        loop: asyncio.AbstractEventLoop,
        device_pool: DeviceKVPool,
        host_pool: HostKVPool | None,
        sidecars: list[SidecarPools],
    ) -> None:
        """Adopt the pools and make the calling thread (the loop's) the owner."""
        cfg = self.config
        self.device_pool, self.host_pool, self.sidecars = device_pool, host_pool, sidecars
        self.dev_alloc = PageAllocator(cfg.device_pages, "device")
        self.relisten()
        self.host_alloc = PageAllocator(cfg.host_pages, "host") if cfg.host_pages else None
        self.loop = loop
        self.owner = threading.get_ident()
        self.tree.bind_owner(self.owner)
        if cfg.quotas_configured:
            self.quota_book()

    def on_split(self, hook: SplitHook) -> None:
        """Call ``hook(head, tail)`` whenever a node with work in flight, or a
        storage-resident one, is split."""
        self._split_hooks.append(hook)

    def off_split(self, *hooks: SplitHook) -> None:
        """Stop calling ``hooks`` (registered with :meth:`on_split`)."""
        for hook in hooks:
            self._split_hooks.remove(hook)

    def _on_split(self, head: Node, tail: Node) -> None:
        for hook in self._split_hooks:
            hook(head, tail)

    def check_owner(self) -> None:
        """Raise ``OwnershipError`` unless called on the owning loop's thread."""
        if self.owner is not None and threading.get_ident() != self.owner:
            raise OwnershipError(
                f"cache used from thread {threading.current_thread().name!r}; only the "
                "event-loop thread that started it may call it"
            )

    def new_future(self) -> asyncio.Future[None]:
        """A loop future whose failure is marked retrieved (callers count and log it)."""
        assert self.loop is not None, "cache not started"
        fut: asyncio.Future[None] = self.loop.create_future()
        fut.add_done_callback(_consume)
        return fut

    # ------------------------------------------------------------------ pages

    def alloc_device(
        self, n: int, state: PageState = PageState.OWNED, *, slots_of: int = 0
    ) -> torch.Tensor:
        """``n`` device pages, evicting only if that can succeed (with ``slots_of=p``: their
        token slots for page size ``p``, as :meth:`PageAllocator.alloc` gives them).

        Raises:
            CapacityError: too few pages even after eviction (nothing evicted or taken).
        """
        alloc = self.dev_alloc
        assert alloc is not None
        if alloc.num_free < n:
            if n <= alloc.num_free + self.tree.dev_evictable:  # a hopeless ask flushes nothing
                self.evict_device(n - alloc.num_free)
            if alloc.num_free < n:
                raise CapacityError(self.capacity_report(n))
        return alloc.alloc(n, state, slots_of=slots_of)

    def capacity_report(self, n: int) -> str:
        """Why ``n`` device pages cannot be had now: what is free, evictable and held."""
        alloc = self.dev_alloc
        assert alloc is not None
        return (
            f"device pool: need {n} pages, {alloc.num_free} free of {alloc.num_pages}, "
            f"{self.tree.dev_evictable} evictable, {self.tree.dev_protected} pinned "
            f"or in flight (unreleased handles and copies), "
            f"{alloc.count(PageState.HELD)} allocated and not inserted, "
            f"{alloc.retained} retained by insert results, "
            f"{alloc.quarantined} held by workers"
        )

    def relisten(self) -> None:
        """Run :meth:`capacity_changed` on the tree's unpins and the device allocator's frees
        only while it has something to do: a capacity waiter in line (``on_capacity``), an
        idle hook, or tenants whose quotas it enforces.  Otherwise an unpin (two on every
        request) calls nothing.  Called whenever one of those three changes."""
        hook = self.capacity_hook()
        self.tree.on_unpinned = hook
        if self.dev_alloc is not None:
            self.dev_alloc.on_free = hook

    def capacity_hook(self) -> Callable[[], None] | None:
        """What unpins and frees call now: :meth:`capacity_changed` while it has something to
        do (see :meth:`relisten`), else nothing."""
        waits = self.on_capacity is not None or self.tree.tenants is not None
        return self.capacity_changed if waits or self.idle_hooks else None

    def listen_capacity(self, notify: Callable[[], None] | None) -> None:
        """Set the capacity waiters' hook (``None``: nobody waits) and :meth:`relisten`."""
        self.on_capacity = notify
        self.relisten()

    def add_idle_hook(self, hook: Callable[[], None]) -> None:
        """Also call ``hook`` from :meth:`capacity_changed` from now on."""
        self.idle_hooks.append(hook)
        self.relisten()

    def capacity_changed(self) -> None:
        """Device pages may have become free or evictable (a free, an unpin, a copy that
        landed): tell whoever waits for them (``on_capacity``), and let a tenant still over
        its quota evict its pages that may have become evictable."""
        if self.on_capacity is not None:
            self.on_capacity()
        book = self.tree.tenants
        if book is not None and (book.over[DEVICE] or book.over[HOST]):
            self._quota_over()
        for hook in self.idle_hooks:
            hook()

    def unretain(self, pages: np.ndarray) -> None:
        """An insert result that retained the device ``pages`` was released."""
        assert self.dev_alloc is not None
        self.dev_alloc.unretain(pages)

    def insert_device(
        self,
        ns: Namespace,
        tokens: list[int],
        n: int,
        slots: np.ndarray,
        skip: int = 0,
        anchor: Node | None = None,
        inherit: np.ndarray = _NO_IDS,
    ) -> tuple[Node, int, int, np.ndarray]:
        """Insert ``tokens[:n]`` (page-aligned) whose token slots after the first ``skip``
        pages are ``slots`` (C-contiguous int64, checked here): pages the tree does not hold on
        device become the tree's; the caller's other pages (its copies of pages the tree has,
        and those after a node still loading, which the tree does not take) are *retained*,
        not freed: they stay allocated for the caller until the insert's result is released.
        ``inherit`` (pages an earlier result retained, for ``prefix=`` that result) is
        retained once more.  The skipped pages must be on the path to ``anchor`` (the caller's
        prefix handle), the path whose KV the new pages were computed against.  Emits the
        device ``BlockStored`` events; returns the node the insert ends at (pinned), the tokens
        the tree held before it (any tier) and holds now for it (``InsertOutcome``'s
        ``prefix_tokens`` and ``inserted_tokens``), and the distinct page ids the result
        retains (one reference each).

        ``tokens`` is a list whose items are still to be checked (the walk checks them).

        Raises:
            InvalidTypeError / InvalidInputError: an item of ``tokens`` is not an int in
                ``[0, 2**63)``; the first ``skip`` pages of ``tokens`` are not on device on
                the path to ``anchor``, or ``slots`` are not whole pages the caller holds
                (nothing changed).
        """
        p = self.page_size
        alloc = self.dev_alloc
        assert alloc is not None, "cache not started"
        tree = self.tree
        checked = None
        if slots.size:  # the common insert: new pages only, one new leaf (one C call)
            checked = alloc.check_insert(slots, p, _NO_IDS)
            if not checked[0]:
                own = checked[3].copy()
                leaf = tree.grow(ns, tokens, n, own, skip, anchor)
                if leaf is not None:
                    alloc.take(own)
                    if inherit.size:
                        alloc.retain(inherit)
                    self.counters.inserted_tokens += n - skip * p
                    if self.events.enabled:
                        self.emit_stored(leaf, _DEVICE)
                    return leaf, skip * p, n, inherit
        # validate ownership before changing anything (not even a new namespace's root)
        # the walk, once; it checks the items of ``tokens`` before anything changes.  Int
        # subclasses (which ``grow`` declines) become exact ints first: no code of the
        # caller's runs in the walk or the new leaf's keys (``fastcheck.exact_ints``)
        tokens = exact_ints(tokens)
        plan = tree.plan_insert(ns, tokens, n, skip=skip, unchecked=True)
        if plan.existing_pages < skip or (skip and not _on_path(plan, skip * p, anchor)):
            raise InvalidInputError(
                f"insert: the {skip * p} tokens skipped are not the prefix's on "
                f"device (the tree holds {plan.existing_pages * p} leading tokens of these "
                "tokens on device): the tokens do not extend that prefix"
            )
        parts = plan.existing  # (plan.device_pages(), inline: the common cases, 0 or 1 part)
        existing = _NO_IDS if not parts else parts[0] if len(parts) == 1 else plan.device_pages()
        d = existing.size
        # (the check above holds when the tree has none of these pages)
        code, at, differing, ids = (
            checked if checked and not d else alloc.check_insert(slots, p, existing)
        )
        if code == INSERT_NOT_HELD and alloc.retained:  # retained rows are the caller's too
            code, at, differing = alloc.recheck_insert(ids, existing)
        if code:
            raise_for_insert(code, at, ids, slots, p, alloc.num_pages)
        keep = [inherit]
        if differing:  # the caller's own copies of pages the tree has: retained below
            lead = ids[:d]
            keep.append(lead[lead != existing])
        # the tree keeps only the pages after its own (ids is scratch, reused next insert)
        own = ids[d:].copy()
        if plan.root is None:  # a new namespace's root (the plan, just made, knows the rest)
            tree.root(ns, ns.tag)
        out = tree.insert(ns, tokens, n, own, plan=plan, first_page=skip + d)
        kept = out.inserted_tokens // p - skip - d  # the walk stops below a loading node
        if kept > 0:
            alloc.take(own[:kept])
        if own.size > kept:
            keep.append(own[max(kept, 0) :])
        retained = _NO_IDS
        if len(keep) > 1 or inherit.size:
            retained = np.unique(np.concatenate(keep)) if len(keep) > 1 else inherit
            alloc.retain(retained)
        self.counters.inserted_tokens += out.inserted_tokens - out.prefix_tokens
        if self.events.enabled:
            for node in out.adopted + out.created:
                self.emit_stored(node, _DEVICE)
        return out.node, out.prefix_tokens, out.inserted_tokens, retained

    def alloc_host(self, n: int, evict: bool = True) -> torch.Tensor | None:
        """``n`` host pages (evicting host-only leaves if that can succeed and ``evict``),
        else ``None``."""
        alloc = self.host_alloc
        if alloc is None:
            return None
        short = n - alloc.num_free  # (host copies of device pages are not evict_host's)
        if short > 0:
            if not evict or short > self.tree.host_evictable or not self.tree.can_free(short):
                return None
            self.evict_host(short)
            if alloc.num_free < n:  # (freed pages a worker still holds wait in quarantine)
                return None
        pages = alloc.alloc(n)
        if self.host_pool is not None:  # new bytes will land there: no checksum from before
            self.host_pool.forget_sums(pages)
        return pages

    def free_device(self, pages: Sequence[PageIds]) -> None:
        """Return device pages (quarantined while a worker holds them)."""
        assert self.dev_alloc is not None
        self.dev_alloc.free(pages)

    def free_host(self, pages: Sequence[PageIds]) -> None:
        """Return host pages (quarantined while a worker holds them)."""
        assert self.host_alloc is not None
        self.host_alloc.free(pages)

    def evict_device(self, num_pages: int, tenant: str | None = None, coming: bool = True) -> int:
        """Evict at least ``num_pages`` device pages (``tenant``'s alone if given) if
        possible; return pages freed now.  Write-back: pages staged to host count (they are
        freed when their copy lands), with ``coming`` those of earlier evictions too
        (``staging``, or the tenant's share of it: an operator's ``evict`` does not)."""
        flying = self.staging if tenant is None else self.staging_of.get(tenant, 0)
        flying = flying if coming else 0  # (an alloc retried, or a tenant still over)
        ev = Eviction()
        stager = self.stager
        told = 0  # victims whose device removal is published

        def stage(node: Node) -> bool:
            # staging may evict host copies (a victim demoted in this very walk among them):
            # the device removals so far are published first, so a block's GPU removal
            # never follows its CPU one
            nonlocal told
            assert stager is not None
            self.emit_removed(ev.nodes[told:], Tier.DEVICE)
            told = len(ev.nodes)
            return stager(node)

        self.tree.evict_device(num_pages, stage if stager else None, tenant, ev, flying)
        self.free_device(ev.pages)
        self.counters.evicted_pages_device += ev.num_pages
        if ev.host_pages:
            self.free_host(ev.host_pages)
            self.counters.evicted_pages_host += sum(p.numel() for p in ev.host_pages)
        self.emit_removed(ev.nodes[told:], Tier.DEVICE)
        self.emit_removed(ev.host_nodes, Tier.HOST)
        return ev.num_pages

    def count_staging(self, ns: Hashable, pages: int) -> None:
        """Device pages of a write-back victim of namespace ``ns`` staged (``pages`` > 0), or
        whose copy ended (< 0): they are counted as coming free meanwhile."""
        tenant = tenant_of(ns)
        left = self.staging_of.get(tenant, 0) + pages
        self.staging += pages
        assert self.staging >= 0 and left >= 0, f"staging went negative: {self.staging}"
        if left:
            self.staging_of[tenant] = left
        else:
            self.staging_of.pop(tenant, None)

    def evict_host(self, num_pages: int, tenant: str | None = None) -> int:
        """Delete host-only leaves (``tenant``'s alone if given) for at least ``num_pages``
        host pages if possible."""
        if self.host_alloc is None:
            return 0
        ev = self.tree.evict_host(num_pages, tenant)
        self.free_host(ev.pages)
        self.counters.evicted_pages_host += ev.num_pages
        self.emit_removed(ev.nodes, Tier.HOST)
        return ev.num_pages

    # ------------------------------------------------------------------ quotas

    def quota_book(self) -> QuotaBook:
        """The tree's per-tenant ledger (``quotas.py``), started on first use from the
        config's quotas (one walk of the tree)."""
        book = self.tree.tenants
        if book is None:
            book = QuotaBook(self.config.default_tenant_quota, self.config.tenant_quotas)
            book.on_over = self._quota_over
            self.tree.enable_quotas(book)
            self.relisten()
        return book

    def _quota_over(self) -> None:
        """A tenant went over a budget (inside a mutation): one enforcement pass, soon.  Not
        with tensor parallelism, where the pass would run at a different point of each rank's
        loop: there budgets are enforced only after inserts and quota changes, which every
        rank makes in the same order."""
        if (
            not self._quota_pass
            and not self.closing
            and self.loop is not None
            and not self.coordinator.deferred
        ):
            self._quota_pass = True
            self.loop.call_soon(self.enforce_quotas)

    def enforce_quotas(self) -> None:
        """Evict every over-budget tenant's own evictable pages down to its budgets (device
        victims with a host copy demote, host-only leaves are deleted); pinned and in-flight
        pages stay, so a budget is best effort against them."""
        book = self.tree.tenants
        if book is None or self.dev_alloc is None or self.closing:
            self._quota_pass = False
            return
        self._quota_pass = True  # the pass's own evictions schedule no other
        try:
            for tenant in list(book.over[DEVICE]):
                n = book.excess(tenant, DEVICE)
                if n:
                    book.count_evicted(tenant, self.evict_device(n, tenant))
            for tenant in list(book.over[HOST]):
                n = book.excess(tenant, HOST)
                if n:
                    book.count_evicted(tenant, self.evict_host(n, tenant))
        finally:
            self._quota_pass = False

    def demote(self, node: Node) -> None:
        """Drop an idle node's device copy (it has a host copy); no-op if it became busy."""
        pages = self.tree.demote(node)
        if pages is not None:
            self.free_device([pages])
            self.counters.evicted_pages_device += pages.size
            self.emit_removed([node], Tier.DEVICE)

    # ------------------------------------------------------------------ events

    def emit(self, event: KVEvent) -> None:
        """Record one event (when events are enabled)."""
        if self.events.enabled:
            self.events.append(event)

    def emit_stored(self, node: Node, tier: Tier) -> None:
        """``BlockStored`` for ``node``'s pages in ``tier``.

        On CPU a block is announced only once its parent was: a node whose parent is not
        (yet) host-resident and announced stays ``cpu_hidden``, and is announced right after
        its parent is (a consumer never sees a CPU block whose parent it does not know).
        A node no longer in the tree (dropped while a copy into it ran) is not announced.
        """
        if not self.events.enabled or not node.alive:
            return
        if tier is Tier.HOST:
            up = node.parent
            if (
                up is not None
                and up.parent is not None
                and (up.host is not RESIDENT or up.cpu_hidden)
            ):
                node.cpu_hidden = True
                return
            node.cpu_hidden = False
        self.append_stored(node, tier)
        if tier is Tier.HOST:  # children that landed first can be announced now
            stack = [c for c in node.children.values() if c.cpu_hidden]
            while stack:
                child = stack.pop()
                if child.cpu_hidden and child.host is RESIDENT:
                    child.cpu_hidden = False
                    self.append_stored(child, tier)
                    stack += [c for c in child.children.values() if c.cpu_hidden]

    def append_stored(self, node: Node, tier: Tier, lo: int = 0, hi: int | None = None) -> None:
        """``BlockStored`` of pages ``lo:hi`` of ``node`` in ``tier`` (events enabled)."""
        hashes, p = self.tree.block_hashes(node), self.page_size
        self.events.append(
            BlockStored(
                block_hashes=list(hashes[lo:hi]),
                parent_block_hash=hashes[lo - 1] if lo else self.tree.parent_hash(node),
                token_ids=list(node.key[lo * p : None if hi is None else hi * p]),
                block_size=self.page_size,
                medium=tier.medium,
                **namespace_fields(node.ns),
            )
        )

    def emit_removed(self, nodes: list[Node], tier: Tier) -> None:
        """One ``BlockRemoved`` for the pages of ``nodes`` in ``tier`` (on CPU: of those that
        were announced)."""
        if tier is Tier.HOST and any(n.cpu_hidden for n in nodes):
            shown = [n for n in nodes if not n.cpu_hidden]
            for n in nodes:
                n.cpu_hidden = False
            nodes = shown
        if nodes and self.events.enabled:
            hashes = [h for node in nodes for h in self.tree.block_hashes(node)]
            self.events.append(BlockRemoved(hashes, tier.medium))

    def emit_closing(self) -> None:
        """The device and host tiers are going away, storage is not: one ``BlockRemoved`` per
        medium for what the tree still holds there.  Never ``AllBlocksCleared``: a consumer's
        STORAGE view must stay true across a restart (a fresh node prefetches those pages)."""
        if self.events.enabled:
            nodes = list(self.tree.walk())
            self.emit_removed([n for n in nodes if n.device is RESIDENT], Tier.DEVICE)
            self.emit_removed([n for n in nodes if n.host is RESIDENT], Tier.HOST)

    # ------------------------------------------------------------------ views

    def sidecar_buffer(self, name: str) -> torch.Tensor:
        """Device buffer of sidecar component ``name``.

        Raises:
            InvalidInputError: no component of that name.
        """
        for sc in self.sidecars:
            if sc.component.name == name:
                buf: torch.Tensor = sc.device
                return buf
        names = [sc.component.name for sc in self.sidecars]
        raise InvalidInputError(f"no sidecar component {name!r}; configured: {names}")

    def sidecar_pairs(self) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """(device, host) buffers of every sidecar component, in config order."""
        return tuple((sc.device, sc.host) for sc in self.sidecars)

    def usable_path(self, path: list[Node]) -> list[Node]:
        """Cut ``path`` where every trailing-window component still has its whole window."""
        if not self.trailing or not any(lacking(n) for n in path):
            return path
        p = self.page_size
        sizes = [len(n.key) // p for n in path]
        total = sum(sizes)
        trailing = []
        for name, window in self.trailing:
            valid: list[bool] = []
            for node, k in zip(path, sizes, strict=True):
                valid += [name not in lacking(node)] * k
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


__all__ = ["CacheCore", "SplitHook"]
