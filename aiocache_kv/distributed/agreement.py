"""Agreement across tensor-parallel ranks, in one order on every rank.

Design
------
Every decision that shapes the tree must be taken identically on every rank: which copy acks
and storage acks are applied, and how many prefetched pages are committed.  Ranks see their
completions at different times, so with more than one rank the cache never applies a
completion when it lands: it queues it, and applies it through an agreement.

An agreement is a :class:`Request` that takes a ticket when the serving loop makes the call
(``load_back``, ``prefetch``, ``flush``, ``sync``) - a synchronous step, so tickets follow the
serving loop's call order, which is the same on every rank (the SPMD contract of TP serving).
The :class:`Sequencer` handles tickets strictly in order, in the background:

1. wait until the request is locally ready (the copies it needs have landed, the prefetch's
   reads are done or out of time) - bounded by the copies' and storage deadlines;
2. ``pack()`` the local state into one integer vector (its length is fixed by what existed at
   ticket time, so it is the same on every rank);
3. ONE ``all_reduce(MIN)`` on a dedicated thread - every rank issues the same collectives in
   the same order, so a slow rank or a rank missing pages delays, never deadlocks;
4. ``plan(agreed)``: book what will be applied (so later packs start from the same base).

The agreed decision is *applied* to the tree only when the serving loop awaits an agreement
(:meth:`Sequencer.settle`): every agreement up to that ticket is applied, in order.  So tree
changes happen at the same point of the serving loop on every rank, never in between its
calls.  A request whose caller was cancelled is still agreed (the other ranks wait for its
collective) and applied before the cancellation reaches the caller: at the point of the
serving loop where the other ranks apply it too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiocache_kv.distributed.group import TPGroup
from aiocache_kv.errors import AgreementError
from aiocache_kv.logs import get_logger
from aiocache_kv.outlast import outlast

log = get_logger(__name__)


@dataclass(eq=False)
class Request:
    """One agreement: wait ``ready``, contribute ``pack()``, ``plan`` it, later ``apply`` it."""

    ready: Callable[[], Awaitable[None]]
    pack: Callable[[], list[int]]
    plan: Callable[[list[int]], None]
    apply: Callable[[list[int]], None]
    #: the vector to contribute when ``ready``/``pack`` fail here: same length as ``pack``'s,
    #: chosen so that the MIN makes every rank apply nothing for this ticket
    fallback: Callable[[], list[int]] | None = None
    ticket: int = -1
    agreed: list[int] | None = None
    collected: asyncio.Future[None] = field(init=False)


class Sequencer:
    """Agrees requests in ticket order (one collective each); applies them on ``settle``."""

    def __init__(self, group: TPGroup, loop: asyncio.AbstractEventLoop) -> None:
        self.group = group
        self._loop = loop
        self._todo: asyncio.Queue[Request | None] = asyncio.Queue()
        self._unapplied: deque[Request] = deque()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="akv-tp")
        self._task: asyncio.Task[None] | None = None
        self._tickets = 0
        self.collectives = 0

    def start(self) -> None:
        """Start agreeing requests in the background."""
        self._task = self._loop.create_task(self._run(), name="aiocache-kv-tp-agreement")

    def submit(self, request: Request) -> Request:
        """Give ``request`` the next ticket (synchronously, in call order) and queue it."""
        request.ticket = self._tickets
        self._tickets += 1
        request.collected = self._loop.create_future()
        self._unapplied.append(request)
        self._todo.put_nowait(request)
        return request

    @property
    def pending(self) -> int:
        """Requests submitted and not yet applied."""
        return len(self._unapplied)

    async def _run(self) -> None:
        while True:
            req = await self._todo.get()
            if req is None:
                return
            try:
                await req.ready()
                values = req.pack()
            except Exception as exc:  # local: this rank still joins the collective
                if req.fallback is None:
                    self._fail(req, "tp_agreement_local_failure", exc)
                    continue  # nothing to contribute: the group cannot go on (logged)
                log.error("tp_agreement_local_failure", ticket=req.ticket, error=repr(exc))
                values = req.fallback()
            try:
                agreed = await asyncio.wrap_future(
                    self._pool.submit(self.group.all_reduce_min, values)
                )
            except Exception as exc:  # collective: the group is broken
                self._fail(req, "tp_agreement_failed", exc)
                continue
            self.collectives += 1
            try:
                req.plan(agreed)
            except Exception as exc:
                self._fail(req, "tp_agreement_plan_failed", exc)
                continue
            req.agreed = agreed
            req.collected.set_result(None)

    def _fail(self, req: Request, event: str, exc: BaseException) -> None:
        log.error(event, ticket=req.ticket, error=repr(exc))
        req.collected.set_exception(AgreementError(f"agreement failed: {exc!r}"))
        req.collected.exception()

    async def settle(self, request: Request) -> None:
        """Wait for ``request``'s agreement, then apply every agreement up to it, in order.

        A caller cancelled meanwhile still applies: every other rank applies this agreement at
        this point of its serving loop, so this rank waits for it (bounded as the agreement
        is) and applies it before the cancellation goes on.

        Raises:
            AgreementError: a collective failed.
        """
        cancelled = await outlast(request.collected)
        if request.collected.exception() is None:
            self.apply_collected(request.ticket)
        if cancelled:
            raise asyncio.CancelledError  # (a broken group: the next call raises it)
        request.collected.result()  # AgreementError

    def apply_collected(self, upto: int | None = None) -> None:
        """Apply, in ticket order, every agreed request (up to ticket ``upto``)."""
        while self._unapplied:
            req = self._unapplied[0]
            if (upto is not None and req.ticket > upto) or not req.collected.done():
                return
            self._unapplied.popleft()
            if req.agreed is not None:
                req.apply(req.agreed)

    async def aclose(self) -> None:
        """Agree and apply everything queued, then stop the background task and thread."""
        if self._task is not None:
            self._todo.put_nowait(None)
            await self._task
            self._task = None
            self.apply_collected()
        await asyncio.to_thread(self._pool.shutdown, True)
