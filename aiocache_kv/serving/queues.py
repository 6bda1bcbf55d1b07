"""The engine's requests by state, and every transition between the states.

:class:`Queues` is shared by the step loop (:mod:`.engine`) and the admission tasks
(:mod:`.admission`); both run on the loop thread (rule 1), so nothing is locked.  Every change
of a request's state goes through a method here, which keeps each request in exactly the
queue of its state and gives its rows and pins back exactly once
(:meth:`Queues.check_invariants`).
"""

from __future__ import annotations

import asyncio

import torch

from aiocache_kv.cache import HiCache
from aiocache_kv.errors import CacheClosedError
from aiocache_kv.logs import get_logger
from aiocache_kv.serving.request import ENDED, Request, RequestState
from aiocache_kv.serving.stats import EngineCounters

log = get_logger(__name__)

__all__ = ["Queues"]


class Queues:
    """Waiting, admitting and running requests of one engine over ``cache``."""

    def __init__(self, cache: HiCache, counters: EngineCounters) -> None:
        self.cache = cache
        self.page_size = cache.config.page_size
        self.counters = counters
        self.waiting: list[Request] = []
        self.admitting: list[Request] = []
        self.running: list[Request] = []
        #: set when the step loop has something to do (an arrival, a request joined or ended)
        self.wake = asyncio.Event()
        #: set whenever rows or pins were given back (admissions waiting for room retry)
        self.room = asyncio.Event()

    def _queue(self, state: RequestState) -> list[Request] | None:
        if state is RequestState.WAITING:
            return self.waiting
        if state is RequestState.ADMITTING:
            return self.admitting
        if state is RequestState.RUNNING:
            return self.running
        return None

    def add(self, req: Request) -> None:
        """A new request joins the back of the queue."""
        assert req.state is RequestState.WAITING, f"{req} is new"
        self.waiting.append(req)
        self.wake.set()

    def move(self, req: Request, state: RequestState, *, front: bool = False) -> None:
        """``req`` goes from its queue to ``state``'s (``front``: first in line)."""
        old = self._queue(req.state)
        new = self._queue(state)
        assert old is not None and new is not None, f"{req} cannot become {state.value}"
        old.remove(req)
        req.state = state
        if front:
            new.insert(0, req)
        else:
            new.append(req)
        self.wake.set()

    def give_back(self, req: Request) -> None:
        """Free ``req``'s own rows (those not in the tree) and release its pins."""
        own = req.rows[req.inserted :]
        handle, req.handle = req.handle, None
        req.rows = torch.empty(0, dtype=torch.int64)
        req.filled = req.inserted = 0
        try:
            if own.numel():
                self.cache.free(own)
            if handle is not None:
                self.cache.release(handle)
        except CacheClosedError:
            pass  # the cache closed first: its pools went with it
        self.room.set()

    def fail(
        self, req: Request, exc: BaseException, state: RequestState = RequestState.FAILED
    ) -> None:
        """End ``req`` with ``exc``.  Its rows and pins go back at the next :meth:`settle`
        (after the forward pass in progress, which may still be writing them)."""
        if req.state in ENDED:
            return
        queue = self._queue(req.state)
        req.state = state
        req.error = exc
        if queue is self.admitting and queue is not None:
            queue.remove(req)  # the admission task gives back what it held
        for task in (req.admission, req.reading):  # and they stop waiting for storage now
            if task is not None and task is not asyncio.current_task():
                task.cancel()
        if state is RequestState.FAILED:
            self.counters.failed += 1
        else:
            self.counters.aborted += 1
        if req.sends is not None:
            req.sends.close()
        if not req.future.done():
            req.future.set_exception(exc)
            req.future.exception()  # retrieved: a caller that went away does not log it
        self.wake.set()

    def settle(self) -> None:
        """Give back the rows and pins of waiting and running requests that ended outside a
        step; called between forward passes only."""
        for queue in (self.waiting, self.running):
            ended = [r for r in queue if r.state in ENDED]
            for r in ended:
                queue.remove(r)
                self.give_back(r)

    def preempt(self, req: Request) -> None:
        """Take running ``req`` out of the batch for room: its computed pages stay cached
        (they are inserted), its own rows and pins go back, and it is first in line to match
        them again."""
        self.give_back(req)
        req.preemptions += 1
        self.counters.preemptions += 1
        self.move(req, RequestState.WAITING, front=True)
        log.debug("engine.preempted", request=req.id, generated=len(req.generated))

    def restart(self, req: Request, reason: BaseException) -> None:
        """Re-admit running ``req``: a prefix it extended left the cache (``reason``, a
        :class:`~aiocache_kv.errors.PrefixDroppedError`).  As a preemption: its own rows and
        pins go back (the dropped pages with them, once nobody else holds them), its prompt
        and generated tokens stay, and it is first in line to match again and recompute what
        is gone."""
        self.give_back(req)
        req.restarts += 1
        self.counters.restarts += 1
        self.move(req, RequestState.WAITING, front=True)
        log.info(
            "engine.restarted",
            request=req.id,
            restarts=req.restarts,
            generated=len(req.generated),
            error=str(reason),
        )

    def finish(self, req: Request) -> None:
        """``req`` generated every token: give back, report its result."""
        self.running.remove(req)
        self.give_back(req)
        req.state = RequestState.FINISHED
        self.counters.finished += 1
        result = req.result()
        self.counters.observe_result(result)
        if req.sends is not None:
            req.sends.close()
        if not req.future.done():
            req.future.set_result(result)

    def check_invariants(self) -> None:
        """Assert that every request is queued once, under its state; a running request pins
        its prefix and its rows are whole pages covering what it filled; a waiting one holds
        nothing."""
        seen: set[int] = set()
        for state in (RequestState.WAITING, RequestState.ADMITTING, RequestState.RUNNING):
            queue = self._queue(state)
            assert queue is not None
            for r in queue:
                assert r.state is state or r.state in ENDED, f"{r} queued as {state.value}"
                assert r.id not in seen, f"{r} queued twice"
                seen.add(r.id)
                if r.state is RequestState.RUNNING:
                    assert r.handle is not None, f"{r} runs without pinning its prefix"
                    assert r.rows.numel() % self.page_size == 0, f"{r} rows are not whole pages"
                    assert r.inserted <= r.filled <= r.rows.numel(), f"{r} rows out of order"
                if r.state is RequestState.WAITING:
                    assert r.handle is None and r.rows.numel() == 0, f"{r} waits holding rows"
