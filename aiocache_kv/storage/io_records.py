"""The records of :class:`~aiocache_kv.storage.executor.StorageIO`: one call handed to a
worker (:class:`IOCall`), the executor's counters (:class:`StorageIOStats`) and the worker
threads' initializer."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from aiocache_kv.storage.base import PageBuffer

__all__ = ["IOCall", "StorageIOStats", "consume", "init_worker", "settled"]


def consume(fut: asyncio.Future[None]) -> None:
    """Retrieve a done future's outcome, so that nobody logs it as never retrieved."""
    if not fut.cancelled():
        fut.exception()  # a late close failure: logged by nobody, retrieved here


def init_worker(intra_op_threads: int | None) -> None:
    """A storage worker thread starts: cap torch's intra-op threads (``None``: keep)."""
    if intra_op_threads is not None:
        torch.set_num_threads(intra_op_threads)  # this thread only (OpenMP per-thread setting)


def settled(
    timer: asyncio.TimerHandle,
    on_done: Callable[[asyncio.Future[Any]], None],
    fut: asyncio.Future[Any],
) -> None:
    """A started call's future is done (``StorageIO.start``): stop its deadline timer, tell
    the caller."""
    timer.cancel()
    on_done(fut)


@dataclasses.dataclass(frozen=True)
class StorageIOStats:
    """Frozen snapshot of the executor's counters."""

    workers: int
    max_pending: int
    submitted: int  # calls handed to a worker
    completed: int  # calls whose worker finished (including late ones)
    in_flight: int  # handed to a worker, not finished
    waiting: int  # callers waiting for a slot
    timeouts: int  # callers that got StorageTimeoutError
    cancelled: int  # callers cancelled while waiting
    late_results: int  # results discarded because the caller was gone


@dataclasses.dataclass(eq=False)
class IOCall:
    """One call handed to a worker, from its hand-off until the worker returns."""

    id: int
    what: str
    result: asyncio.Future[Any]  # the caller's; completed only if not done
    finished: asyncio.Future[None]  # set when the worker is done (buffers released)
    buffers: Sequence[PageBuffer]  # what the worker may touch (the caller's own list)
    on_release: Callable[[], None] | None = None  # the caller's lease ends with the worker

    @functools.cached_property
    def ranges(self) -> tuple[tuple[int, int], ...]:  # only when asked (not per call: ~us a page)
        return tuple((b.ptr, b.ptr + b.nbytes) for b in self.buffers)
