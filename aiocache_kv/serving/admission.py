"""Admission: from the queue into the batch, without stalling the step loop.

A request's storage read starts when it arrives (``prefetch`` on arrival: the read overlaps
its time in the queue).  When the engine has room (fewer than ``max_running`` requests in or
entering the batch) a task per request prefetches again (what arrived meanwhile is already
host-resident, so this is cheap), matches, loads the host part back and allocates rows for
the rest of its prompt; then the request joins the batch at the next step.

Waiting for room never holds anything: an admission that finds the device pool short
(``load_back`` or ``alloc`` raising ``CapacityError``) releases its match and waits for the
engine to give rows or pins back (or for copies in flight to land, or a drop's zeroing to
give pages back, checked every :data:`ROOM_POLL` seconds), then starts over.  Rows go first
come, first served: while a request is short of rows, those behind it in the admission line
take none (a big request is not starved by a stream of small ones).  A request is not
admitted while another running request computes pages of its prompt it could reuse
(:func:`~.scheduler.prefix_in_flight`); it is admitted once those pages are in the tree.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import torch

from aiocache_kv.errors import CapacityError, KVCacheError
from aiocache_kv.logs import get_logger
from aiocache_kv.serving.queues import Queues
from aiocache_kv.serving.request import Request, RequestState
from aiocache_kv.serving.scheduler import prefix_in_flight
from aiocache_kv.telemetry import attribute

if TYPE_CHECKING:
    from aiocache_kv.handles import MatchResult
    from aiocache_kv.storage.tier import PrefetchResult

log = get_logger(__name__)

__all__ = ["ROOM_POLL", "Admissions", "ModelView"]

#: seconds between checks for room that nobody announced (write-through copies landing)
ROOM_POLL = 0.02


@dataclasses.dataclass(frozen=True)
class ModelView:
    """What admission needs of the engine's model and limits."""

    page_size: int
    hybrid: bool  #: sliding-window sidecar: matches end where the reuse ends
    max_running: int


class Admissions:
    """The admission side of an engine: one task per request entering the batch."""

    def __init__(self, queues: Queues, model: ModelView) -> None:
        self.queues = queues
        self.cache = queues.cache
        self.model = model
        self._tasks: set[asyncio.Task[None]] = set()
        #: the prefetch each request started on arrival (admission waits for it first)
        self._arrivals: dict[int, asyncio.Task[None]] = {}
        #: admitting requests the device pool was short for: no later one takes rows first
        self._short: set[int] = set()
        #: admitting requests turned back by that rule on their last try (they hold nothing)
        self._gated: set[int] = set()
        #: requests whose admission task runs, by id (one that ended while its task still
        #: gives back pins and reads is an orphan: see :meth:`orphans`)
        self._entering: dict[int, Request] = {}
        #: admitting requests inside their storage read, by id: the read's own task (pins
        #: held until the store answers, or until :meth:`cancel_reads`)
        self._reading: dict[int, asyncio.Task[PrefetchResult]] = {}
        #: a running request is short of rows (set by the step loop each step): admissions
        #: turn back before pinning anything, so the running batch's rows come first
        self.yield_to_running = False

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def on_arrival(self, req: Request) -> None:
        """Start the prompt's storage read now (only with a storage tier)."""
        if self.cache.config.storage is not None:
            task = self._spawn(
                self._prefetch_on_arrival(req), f"aiocache_kv.engine.prefetch-{req.id}"
            )
            req.reading = self._arrivals[req.id] = task
            # (also for a read cancelled before its first step, whose finally never runs: a
            # stale entry said pins were held for good, so a running batch short of rows
            # waited for them forever instead of preempting)
            task.add_done_callback(functools.partial(self._arrived, req))

    async def _prefetch_on_arrival(self, req: Request) -> None:
        try:
            with contextlib.suppress(KVCacheError):  # a failed read is a miss: admission retries
                res = await self.cache.prefetch(
                    self._match_tokens(req), tenant=req.tenant, lora=req.lora
                )
                req.prefetch += res.hit_tokens
        finally:
            self._arrived(req)

    def _arrived(self, req: Request, task: object = None) -> None:
        """``req``'s read on arrival ended (from its ``finally``, or from its done callback:
        ``task``, then only if it is still the request's read)."""
        if task is not None and self._arrivals.get(req.id) is not task:
            return
        self._arrivals.pop(req.id, None)
        req.reading = None
        self.queues.wake.set()  # what it committed may unblock a request waiting for it

    async def _read(self, req: Request, toks: list[int]) -> PrefetchResult | None:
        """``req``'s storage read, in a task of its own so that :meth:`cancel_reads` can end
        it without ending the admission; ``None`` if it did (or ``req`` ended meanwhile).

        Raises:
            KVCacheError: what the prefetch raised.
        """
        read = asyncio.ensure_future(self.cache.prefetch(toks, tenant=req.tenant, lora=req.lora))
        self._reading[req.id] = read
        try:
            await asyncio.wait([read])
        except asyncio.CancelledError:  # the request ended: its read ends with it, and its
            read.cancel()  # pins are back before this task is
            await asyncio.wait([read])
            raise
        finally:
            self._reading.pop(req.id, None)
        return None if read.cancelled() else read.result()

    def cancel_reads(self) -> int:
        """Cancel every storage read that pins cached pages for a request not in the batch
        (read on arrival, or inside admission): their pins come back now.  Their requests
        are admitted without a storage read from then on (a miss: they compute what the
        store held).  For a running request short of rows that waited ``storage_wait`` for
        them.  Returns how many reads were cancelled.  With tensor parallelism none is: a
        read's pins stay until its ranks agree on it, so cancelling gives nothing back
        sooner, and the running request would be judged alone while they are still held."""
        if self.cache.tp_group.world_size > 1:
            return 0
        n = 0
        for req in [*self.queues.waiting, *self.queues.admitting]:
            for task in (self._arrivals.get(req.id), self._reading.get(req.id)):
                if task is not None and not task.done():
                    req.skip_storage = True
                    task.cancel()
                    n += 1
        return n

    def admit_waiting(self) -> None:
        """Start admitting waiting requests, in order, while the batch has room."""
        q = self.queues
        busy = len(q.running) + len(q.admitting)
        for req in list(q.waiting):
            if busy >= self.model.max_running:
                return
            if req.state is not RequestState.WAITING:
                continue
            ahead = prefix_in_flight(req, [*q.running, *q.admitting], self.model.page_size)
            if ahead:
                have = self.cache.cached_len(req.seq[:ahead], tenant=req.tenant, lora=req.lora)
                if have < ahead:  # pages on their way: admit once they are in the tree
                    if not req.waited_for:
                        req.waited_from = have
                    req.waited_for = max(req.waited_for, ahead)
                    continue
            q.move(req, RequestState.ADMITTING)
            busy += 1
            req.admission = self._spawn(self._admit(req), f"aiocache_kv.engine.admit-{req.id}")
            # (also for a task cancelled before its first step, whose finally never runs)
            req.admission.add_done_callback(functools.partial(self._left, req))
            self._entering[req.id] = req

    def _match_tokens(self, req: Request) -> list[int]:
        seq = req.seq
        if self.model.hybrid:  # a whole sliding window is guaranteed only at a match's end
            p = self.model.page_size
            return seq[: max((len(seq) - 1) // p * p, 1)]
        return seq

    async def _admit(self, req: Request) -> None:
        q = self.queues
        try:
            while req.state is RequestState.ADMITTING:
                q.room.clear()
                if await self._try(req):
                    return
                if req.state is RequestState.ADMITTING:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(q.room.wait(), ROOM_POLL)
        except KVCacheError as exc:
            q.fail(req, exc)
        finally:
            self._left(req)

    def _left(self, req: Request, task: object = None) -> None:
        """``req``'s admission task ended (or is ending): nothing of it is waited for.  From
        the done callback of ``task``: not if a newer admission of ``req`` runs (re-admitted
        after a preemption or a restart)."""
        if task is not None and req.admission is not None and req.admission is not task:
            return
        self._short.discard(req.id)
        self._gated.discard(req.id)
        self._entering.pop(req.id, None)
        req.admission = None

    def _behind(self, req: Request) -> bool:
        """Whether a request ahead of ``req`` in the admission line is waiting for rows: then
        ``req`` takes none (first come, first served: a big request is not starved by a
        stream of small ones that each fit the rows given back)."""
        for r in self.queues.admitting:
            if r is req:
                return False
            if r.id in self._short:
                return True
        return False

    def holding(self) -> bool:
        """Whether pins that come back within a storage deadline are held: an ended request's
        admission (:meth:`orphans`), a storage read started on arrival, or an admitting
        request's read (a running request short of rows waits for them instead of failing
        as alone in the pool)."""
        return bool(self._arrivals or self._reading) or self.orphans()

    def orphans(self) -> bool:
        """Whether the admission task of a request that ended meanwhile (aborted, failed)
        still runs: cancelled, it may hold pins until its storage call returns (a bounded
        wait), so a request short of rows now may fit once it ends."""
        return any(r.state is not RequestState.ADMITTING for r in self._entering.values())

    def _stuck(self, req: Request) -> bool:
        """Whether waiting cannot help ``req``: nothing runs, no other admitting request
        could join the batch and give rows back (those turned back behind a short one hold
        nothing and wait), no copy in flight will make pages evictable, and no worker holds
        freed pages (a drop's zeroing) that will come back, and no ended request's admission
        still gives back what it held."""
        q = self.queues
        alone = not q.running and all(r is req or r.id in self._gated for r in q.admitting)
        cache = self.cache
        if not alone or self.holding():  # (reads pin paths for a while, each bounded)
            return False
        return not (cache.copies_in_flight() or cache.device_pages_returning())

    async def _try(self, req: Request) -> bool:
        """One admission attempt; ``True`` once the request is in the batch (or ended).

        Raises:
            CapacityError: the device pool cannot hold the request even alone.
            KVCacheError: what the cache raised (the request fails with it).
        """
        q = self.queues
        cache = self.cache
        p = self.model.page_size
        toks = self._match_tokens(req)
        seq_len = req.length
        reusable = (seq_len - 1) // p * p
        if self._behind(req) or self.yield_to_running:  # (before its prefetch: one turned
            self._gated.add(req.id)  # back holds no pin)
            return False
        self._gated.discard(req.id)  # (holds pins from here: not counted as holding none)
        if cache.config.storage is not None and not req.skip_storage:
            arrival = self._arrivals.get(req.id)
            if arrival is not None:  # the read it started on arrival: one read, not two
                await asyncio.wait([arrival])  # (cancelled by cancel_reads: not this task)
                if not arrival.cancelled() and (exc := arrival.exception()) is not None:
                    raise exc  # (a bug: the request fails with it)
            res = None
            if not req.skip_storage and req.state is RequestState.ADMITTING:
                res = await self._read(req, toks)
            if req.state is not RequestState.ADMITTING:
                return True
            if res is None:  # cancelled for a running request: turn back, holding nothing
                self._gated.add(req.id)
                return False
            req.prefetch += res.hit_tokens
        stored = req.prefetch
        m: MatchResult | None = cache.match_prefix(toks, tenant=req.tenant, lora=req.lora)
        assert m is not None
        try:
            if self._behind(req):  # (someone got short meanwhile)
                self._gated.add(req.id)
                return False  # (the finally releases the match)
            device, host = m.device_len, m.host_len
            if m.host_len:
                await cache.load_back(m)
                if req.state is not RequestState.ADMITTING:
                    return True  # the finally below releases the match
            reused = min(m.device_len, reusable)
            own = cache.alloc(seq_len - reused)
        except CapacityError:
            if self._stuck(req):
                raise
            self._short.add(req.id)
            return False
        else:
            rows = m.device_indices[:reused]
            req.rows = own if not reused else torch.cat([rows, own])
            req.handle, m = m, None
            req.filled = req.inserted = reused
            if req.attribution is None:  # the first admission says where the prompt came from
                storage = min(stored, host)
                req.attribution = attribute(
                    len(req.prompt),
                    min(reused, len(req.prompt)),
                    device=device,
                    host=host - storage,
                    storage=storage,
                )
                req.shared_in_flight = max(0, min(req.waited_for, reused) - req.waited_from)
            if req.admitted_at is None:
                req.admitted_at = time.perf_counter()
            q.move(req, RequestState.RUNNING)
            return True
        finally:
            if m is not None:
                cache.release(m)

    async def aclose(self) -> None:
        """Wait for the admission tasks (each ends soon once its request ended)."""
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
