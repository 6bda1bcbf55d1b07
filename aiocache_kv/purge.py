"""Purge: ``HiCache.drop`` removes a prefix's subtree, or a tenant's pages, from every tier.

What is dropped
---------------
With ``tokens`` (``L`` whole pages, ``L >= 1``): the page ``L - 1`` of the prompt (its last
whole page) and every cached page that continues it, in every namespace chosen (below).  The
pages before it stay, so a match of ``tokens`` afterwards ends one page short, and a sibling
that leaves the prompt before its last page is untouched.  Without ``tokens``: every page of
the namespaces chosen.  The namespaces: ``(model, tenant, lora)`` with ``tenant=None`` the
default tenant; ``lora=None`` means every adapter of the tenant the cache knows of (the tree's
roots) plus the tenant's base namespace (no adapter).  An adapter this node never saw has a
storage tag only its name can give (a digest): pass ``lora=`` to drop it from storage.

Device and host (``"device"`` and ``"host"`` are dropped together: a node must keep a copy in
one of them).  The subtree's top is *detached* at once (``tree/detach.py``): nothing can match
it again, so a new request for the same tokens is a miss and recomputes, and one
``BlockRemoved`` per medium says so at once for every announced copy.  Its idle nodes are
freed at once, children first; a node still in use (a handle of a running request, a
prefetch's anchor, a copy or backup in flight, a hard pin) keeps its pages until its user is
done, then the reaper frees it (it runs on the loop after every unpin, landed copy and landed
backup: ``CacheCore.idle_hooks``).  A request holding a match on dropped pages reads them
until it releases the match; a copy in flight lands (never announced), then frees.  A hard
pin (``cache.pin``) on dropped pages ends at the drop (``RELEASED``): its pages are gone.

Storage (``"storage"``).  The keys of every dropped node the cache put or read are removed,
and so are the keys of page ``L - 1`` (whoever wrote them: without that page no prefetch can
reach the pages after it).  A tenant drop removes every key of the namespaces' tags
(``TagRemovableStorage.remove_tag``: FileStorage scans its index, Mooncake removes by regex on
the master), so pages other nodes wrote over the same store go too.  A backend without
``remove_tag`` gets the keys the cache knows (nodes and claims).  ``BlockRemoved(STORAGE)`` is
published for the pages this cache claimed (also when the removal fails, times out or is
cancelled: its worker may still remove them).  Pages after ``L - 1`` that only another node
wrote stay (unreachable: a prefetch needs their leading page) until evicted.

Races.  A backup putting dropped pages (queued, in flight, or landed while its worker still
runs) removes what it put once its workers are done, and never claims it; a prefetch that
would commit a dropped page (in flight at the drop, or started while the drop runs) commits
nothing (``PrefetchingTier.fence``); one anchored in a dropped subtree commits nothing either.
An eviction meanwhile finds detached nodes in no victim heap.

Zeroization (``zeroize=True``).  Freed device and host pages (and their sidecar pages) are
leased, freed (so they wait in quarantine: never reused), overwritten with zeros on a worker
thread, after any storage worker still holding a host page returned it, and only then
unleased, so they reach the free list zeroed.  ``drop`` awaits the zeroing of the pages it
freed at once (bounded by its timeout); nodes freed later are zeroed the same way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from aiocache_kv.errors import (
    DropIncompleteError,
    InvalidInputError,
    InvalidTypeError,
    KVCacheError,
)
from aiocache_kv.events import BlockRemoved
from aiocache_kv.logs import get_logger
from aiocache_kv.namespace import Namespace
from aiocache_kv.storage.fences import FenceHold
from aiocache_kv.tree import Node, Tier
from aiocache_kv.tree.hashing import chain_hashes, namespace_seed
from aiocache_kv.tree.node import ABSENT, RESIDENT

if TYPE_CHECKING:
    from aiocache_kv.core import CacheCore
    from aiocache_kv.storage.tier import StorageTier

log = get_logger(__name__)

_NONE = torch.empty(0, dtype=torch.int64)


@dataclasses.dataclass(frozen=True, slots=True)
class DropResult:
    """What one :meth:`HiCache.drop` did."""

    nodes: int  #: tree nodes dropped (detached; freed at once or once idle)
    device_pages: int  #: device pages freed at once
    host_pages: int  #: host pages freed at once
    deferred_nodes: int  #: nodes in use, freed when their users are done
    storage_pages: int  #: keys removed from storage (a tenant's: any node's)
    storage_claims: int  #: pages this cache claimed in storage, published removed
    zeroized_bytes: int  #: bytes of the pages freed at once, overwritten with zeros


class Purger:
    """The drop logic of one cache (loop-owned)."""

    def __init__(self, core: CacheCore, storage: Callable[[], StorageTier | None]) -> None:
        self.core = core
        self._storage = storage
        #: ids of detached nodes whose pages are zeroed when freed
        self._zero: set[int] = set()
        self._scheduled = False
        self._tasks = core.zeroing  # flush waits for them
        core.add_idle_hook(self._poke)

    # ------------------------------------------------------------------ reaper

    def _poke(self) -> None:
        """Dropped nodes may be idle now: free them soon (never inside the caller's step)."""
        if self.core.tree.detached and not self._scheduled and self.core.loop is not None:
            self._scheduled = True
            self.core.loop.call_soon(self._run_reap)

    def _run_reap(self) -> None:
        self._scheduled = False
        self.reap()

    def reap(self) -> tuple[int, int, asyncio.Task[int] | None]:
        """Free the detached nodes that are idle now (on the loop): device and host pages
        freed (zeroed first where asked; their ``BlockRemoved`` went out at the drop).
        Returns the device and host pages freed and the zeroing task, if any."""
        core = self.core
        out = core.tree.reap()
        if not out.nodes:
            return 0, 0, None
        zero = self._zero
        dev_pairs = list(zip(out.device_nodes, out.device_pages, strict=True))
        host_pairs = list(zip(out.host_nodes, out.host_pages, strict=True))
        dz = [p for n, p in dev_pairs if id(n) in zero]
        hz = [p for n, p in host_pairs if id(n) in zero]
        dk = [p for n, p in dev_pairs if id(n) not in zero]
        hk = [p for n, p in host_pairs if id(n) not in zero]
        for node in out.nodes:
            zero.discard(id(node))
        dev = sum(p.size for p in out.device_pages)
        host = sum(p.numel() for p in out.host_pages)
        c = core.counters
        c.dropped_pages_device += dev
        c.dropped_pages_host += host
        if dk:
            core.free_device(dk)
        if hk:
            core.free_host(hk)
        task = self._zeroize(dz, hz) if dz or hz else None
        return dev, host, task

    # ------------------------------------------------------------------ zeroize

    def _zeroize(self, dev: list[np.ndarray], host: list[torch.Tensor]) -> asyncio.Task[int]:
        """Quarantine ``dev`` and ``host`` pages (leased, then freed), zero them on a thread,
        then release them to the free list; the task's result is the bytes zeroed."""
        core = self.core
        dflat = torch.from_numpy(np.concatenate(dev)) if dev else _NONE
        hflat = torch.cat(host) if host else _NONE
        if dflat.numel():
            assert core.dev_alloc is not None
            core.dev_alloc.lease(dflat)
            core.free_device([dflat])
        if hflat.numel():
            assert core.host_alloc is not None
            core.host_alloc.lease(hflat)
            core.free_host([hflat])
        assert core.loop is not None
        task = core.loop.create_task(self._zero_and_release(dflat, hflat))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _zero_and_release(self, dflat: torch.Tensor, hflat: torch.Tensor) -> int:
        core = self.core
        l3 = self._storage()
        if hflat.numel() and l3 is not None:
            await l3.workers_done(hflat)  # a late put still reading them keeps them until then
        try:
            nbytes = await asyncio.to_thread(self._zero_pages, dflat, hflat)
        except Exception as exc:  # never reused unzeroed: they stay quarantined
            log.error(
                "zeroize_failed",
                device_pages=dflat.numel(),
                host_pages=hflat.numel(),
                error=repr(exc),
            )
            raise
        if dflat.numel():
            assert core.dev_alloc is not None
            core.dev_alloc.unlease(dflat)
        if hflat.numel():
            assert core.host_alloc is not None
            core.host_alloc.unlease(hflat)
        core.counters.zeroized_bytes += nbytes
        return nbytes

    def _zero_pages(self, dflat: torch.Tensor, hflat: torch.Tensor) -> int:
        """Overwrite the pages with zeros (a worker thread: nothing else touches them now)."""
        core = self.core
        nbytes = 0
        pool = core.device_pool
        if dflat.numel() and pool is not None:
            buf = pool.buffer
            idx = dflat.to(buf.device)
            buf.index_fill_(2, idx, 0)
            nbytes += dflat.numel() * (pool.nbytes // pool.num_pages)
            for sc in core.sidecars:
                sc.device.index_fill_(0, idx, 0)
                nbytes += dflat.numel() * sc.device[0].numel() * sc.device.element_size()
            if buf.is_cuda:
                torch.cuda.current_stream(buf.device).synchronize()
        host = core.host_pool
        if hflat.numel() and host is not None:
            host.raw.index_fill_(0, hflat, 0)
            nbytes += hflat.numel() * host.raw.shape[1]
            for sc in core.sidecars:
                sc.host_raw.index_fill_(0, hflat, 0)
                nbytes += hflat.numel() * sc.host_raw.shape[1]
        return nbytes

    # ------------------------------------------------------------------ drop

    def _subtree_tops(self, ns: Namespace, tokens: list[int] | None) -> list[Node]:
        """The nodes to detach: the namespace's top nodes, or the node that starts with the
        prompt's last whole page (split there if needed); none if it is not cached."""
        tree = self.core.tree
        if tokens is None:
            return [c for r in tree.roots() if r.ns == ns for c in r.children.values()]
        p = self.core.page_size
        n = len(tokens) // p * p
        if tree.peek(ns, tokens, n) < n:
            return []  # its last page is not in the tree
        node, at = tree.match(ns, tokens, n - p)  # splits at the page boundary
        assert at == n - p, f"peek saw {n} tokens but match {at}"
        key = tokens[n - p] if p == 1 else tuple(tokens[n - p : n])
        child = node.children.get(key)
        return [] if child is None else [child]

    async def drop(
        self,
        namespaces: list[Namespace],
        tokens: list[int] | None,
        *,
        memory: bool,
        storage: bool,
        zeroize: bool,
        timeout: float,
    ) -> DropResult:
        """See :meth:`HiCache.drop` (arguments checked there).

        Raises:
            DropIncompleteError: storage removal failed or timed out (device and host done).
        """
        l3 = self._storage() if storage else None
        p = self.core.page_size
        fences: list[tuple[Namespace, bytes | None]] = []
        lead: dict[Namespace, bytes] = {}  # prefix drops: the hash of the prompt's last page
        if l3 is None:
            return await self._drop(namespaces, tokens, memory, None, lead, zeroize, timeout, None)
        for ns in namespaces:
            if tokens is not None:
                n = len(tokens) // p * p
                lead[ns] = chain_hashes(namespace_seed(ns.tag), tokens[:n], p)[-1]
            fences.append(l3.fence(ns, lead.get(ns)))
        # the fences stand until this drop and every removal it handed a worker are done
        # (cancelled or timed out included: storage/fences.py)
        hold = FenceHold(functools.partial(l3.unfence, *fences))
        try:
            return await self._drop(namespaces, tokens, memory, l3, lead, zeroize, timeout, hold)
        finally:
            hold.done()

    async def _drop(
        self,
        namespaces: list[Namespace],
        tokens: list[int] | None,
        memory: bool,
        l3: StorageTier | None,
        lead: dict[Namespace, bytes],
        zeroize: bool,
        timeout: float,
        hold: FenceHold | None,
    ) -> DropResult:
        core = self.core
        tree = core.tree
        p = core.page_size
        aligned = None if tokens is None else tokens[: len(tokens) // p * p]
        dropped: list[Node] = []
        if memory:
            tops = [t for ns in namespaces for t in self._subtree_tops(ns, tokens)]
            doomed = {id(n) for t in tops for n in _subtree(t)}
            if doomed:  # a hard pin on dropped pages ends (RELEASED): they are gone
                core.hard_pins.release_if(lambda n: id(n) in doomed)
            for top in tops:
                dropped += tree.detach(top)
            # gone for every consumer at once (nothing can match them), whenever freed
            core.emit_removed([n for n in dropped if n.device is RESIDENT], Tier.DEVICE)
            core.emit_removed([n for n in dropped if n.host is RESIDENT], Tier.HOST)
            if zeroize:
                self._zero.update(id(n) for n in dropped)
            if l3 is not None:
                l3.mark_dropped(dropped, frozenset(namespaces), aligned)
        elif l3 is not None:  # storage only: the nodes stay in the tree, storage-ABSENT
            tops = [t for ns in namespaces for t in self._subtree_tops(ns, tokens)]
            dropped = [n for t in tops for n in _subtree(t)]
            # puts still running after they landed (past their deadline; their node may be
            # evicted): what they put is removed when they are done
            l3.mark_dropped([], frozenset(namespaces), aligned, late_only=True)
            busy = l3.backups_of(dropped)
            if busy:  # let them land (bounded: each has its deadline), then remove
                await asyncio.wait(busy, timeout=timeout)
            dropped = [n for n in dropped if n.alive]
        stored = [n for n in dropped if n.storage is not ABSENT]
        claimed = [h for n in dropped if n.storage is RESIDENT for h in tree.block_hashes(n)]
        if not memory:
            for node in stored:
                tree.lose_storage(node)  # a later hit backs it up again, as after an eviction
        dev, host, task = self.reap() if memory else (0, 0, None)
        deferred = sum(1 for n in dropped if memory and not _freed(n))
        removed = 0
        error: BaseException | None = None
        claims: list[bytes] = []  # the namespaces' claims, filled before the removal starts
        try:
            if l3 is not None:
                assert hold is not None, "a storage drop without fences"
                removed = await self._drop_storage(
                    l3, namespaces, tokens, stored, lead, timeout, claims, hold
                )
        except (KVCacheError, asyncio.TimeoutError) as exc:
            error = exc
        finally:
            if hold is not None:
                hold.done()  # the storage part is over (its workers may still hold them)
            # retracted even if the removal failed, timed out or was cancelled: its worker
            # may still remove the keys, and a claim the store does not back is the worse
            # error (a key left unclaimed is only a miss; ``drop`` again removes it)
            claimed = list(dict.fromkeys(claimed + claims))
            if claimed and l3 is not None:
                claimed = l3.forget_claims(claimed)  # (those still claimed: once each)
                if claimed:
                    core.emit(BlockRemoved(claimed, Tier.STORAGE.medium))
        zeroed = 0
        if task is not None:
            done, _ = await asyncio.wait([task], timeout=timeout)
            zeroed = task.result() if done and not task.exception() else 0
        result = DropResult(
            nodes=len(dropped) if memory else 0,
            device_pages=dev,
            host_pages=host,
            deferred_nodes=deferred,
            storage_pages=removed,
            storage_claims=len(claimed),
            zeroized_bytes=zeroed,
        )
        if dropped or removed or claimed:
            core.counters.drops += 1
        log.info("drop", **dataclasses.asdict(result), error=None if error is None else repr(error))
        if error is not None:
            incomplete = DropIncompleteError(
                f"drop: device and host done, but storage removal failed: {error!r}"
            )
            incomplete.result = result
            raise incomplete from error
        return result

    def drop_corrupt(self, node: Node, at: int, timeout: float) -> None:
        """A load-back found that page ``at`` of host-only ``node`` failed its deferred
        verification (``storage/deferred.py``; on the loop, in the load's apply): split
        ``node`` there, mark the rest ``corrupt`` (no match extends through it from now on)
        and drop it and everything below it from host and storage in the background (the
        keys removed, ``BlockRemoved`` for host and storage; ``flush`` waits for it)."""
        core = self.core
        tree = core.tree
        p = core.page_size
        l3 = self._storage()
        if l3 is not None:
            l3.counters.load_back_corrupt_pages += 1
        if not node.alive or core.loop is None:
            node.corrupt = True  # dropped meanwhile: gone for every consumer but its holders
            return
        if at:
            tree.split_at(node, at * p)  # ``node`` keeps the part from the failed page on
        node.corrupt = True
        tokens = [int(t) for n in tree.path(node) for t in n.key]
        tokens = tokens[: len(tokens) - len(node.key) + p]  # up to the failed page
        log.warning("load_back_corrupt", tokens=len(tokens) - p, namespace=str(node.ns))
        task = core.loop.create_task(
            self.drop([node.ns], tokens, memory=True, storage=True, zeroize=False, timeout=timeout)
        )
        core.zeroing.add(task)
        task.add_done_callback(self._dropped_corrupt)

    def _dropped_corrupt(self, task: asyncio.Task[Any]) -> None:
        self.core.zeroing.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("load_back_corrupt_drop_failed", error=repr(task.exception()))

    async def _drop_storage(
        self,
        l3: StorageTier,
        namespaces: list[Namespace],
        tokens: list[int] | None,
        stored: list[Node],
        lead: dict[Namespace, bytes],
        timeout: float,
        claims: list[bytes],
        hold: FenceHold,
    ) -> int:
        """Remove the keys from storage; return how many.  The claims of the pages it
        removes that left the tree (whole namespaces', or below a prefix) are appended to
        ``claims`` before their removal starts.

        Raises:
            StorageError / StorageTimeoutError: the backend failed or was too slow.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout

        def left() -> float:
            return max(deadline - loop.time(), 1e-3)

        keys: list[str] = []
        removed = 0
        if tokens is None:
            for ns in namespaces:
                own = l3.claimed_in(ns)
                claims += own
                n = await l3.remove_tag(ns.tag, timeout=left(), on_release=hold.worker())
                if n is None:  # the backend cannot: the keys the cache knows
                    keys += [k for node in stored if node.ns == ns for k in l3.node_keys(node)]
                    keys += l3.page_keys(ns, own)
                else:
                    removed += n
        else:
            keys = [k for node in stored for k in l3.node_keys(node)]
            for ns, h in lead.items():
                own = l3.claimed_below(ns, h)  # pages of nodes that left the tree too
                claims += own
                keys += l3.page_keys(ns, [h, *own])
        keys = list(dict.fromkeys(keys))
        removed += await l3.remove_keys(keys, timeout=left(), on_release=hold.worker())
        l3.counters.dropped_pages_storage += removed
        return removed


_TIER_NAMES = {"device": Tier.DEVICE, "host": Tier.HOST, "storage": Tier.STORAGE}


def check_drop_tiers(tiers: object) -> frozenset[Tier]:
    """The tiers of a drop: any iterable (list, tuple, set, generator, dict keys, ...) of
    names (``"device"``, ``"host"``, ``"storage"``) or ``Tier``s, read once; device and host
    go together (a node must keep a copy in one of them).

    Raises:
        InvalidTypeError: not an iterable (a bare ``str`` or ``bytes`` is refused too), or
            an item that is neither a ``str`` nor a ``Tier`` (an unhashable one included),
            named.
        InvalidInputError: empty, an unknown tier name, or device without host (or the
            reverse).
    """
    if isinstance(tiers, (str, bytes, bytearray)) or not isinstance(tiers, Iterable):
        raise InvalidTypeError(
            f"tiers must be an iterable of tier names, got {type(tiers).__name__} {tiers!r}"
        )
    names = list(tiers)  # once: a generator or an iterator is consumed here
    out: set[Tier] = set()
    for t in names:
        if isinstance(t, Tier):
            out.add(t)
            continue
        if not isinstance(t, str):
            raise InvalidTypeError(
                f"tiers: {type(t).__name__} {t!r} is not a tier name; use some of "
                f"{sorted(_TIER_NAMES)}"
            )
        name = str.__str__(t)  # (a str subclass's own hash and repr are not asked)
        tier = _TIER_NAMES.get(name)
        if tier is None:
            raise InvalidInputError(
                f"tiers: unknown tier {name!r}; use some of {sorted(_TIER_NAMES)}"
            )
        out.add(tier)
    if not out:
        raise InvalidInputError("tiers must name at least one tier")
    if (Tier.DEVICE in out) != (Tier.HOST in out):
        raise InvalidInputError(
            f"tiers {sorted(t.name.lower() for t in out)}: device and host are dropped "
            "together (a node must keep a copy in one of them; use evict for one tier)"
        )
    return frozenset(out)


def _subtree(top: Node) -> list[Node]:
    out: list[Node] = []
    stack = [top]
    while stack:
        cur = stack.pop()
        out.append(cur)
        stack.extend(cur.children.values())
    return out


def _freed(node: Node) -> bool:
    return node.device is ABSENT and node.host is ABSENT


__all__ = ["DropResult", "Purger", "check_drop_tiers"]
