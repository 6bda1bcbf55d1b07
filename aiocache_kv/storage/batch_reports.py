"""``BatchReports``: the results of a worker's read batches on their way to the event loop.

:meth:`~aiocache_kv.storage.executor.StorageIO.get_into_batches` runs a list of batches on one
worker; each batch's result is :meth:`BatchReports.put` by the worker and reported on the loop
by :meth:`BatchReports.drain`, in order.  The loop may also tell the worker to start no batch
after a given one (:meth:`BatchReports.stop_after`: a prefetch that read ahead of its existence
check learns where the leading run ends).
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Callable

__all__ = ["BatchReports"]


class BatchReports:
    """The results of :meth:`StorageIO.get_into_batches`' batches on their way to the loop.

    The worker :meth:`put` s each batch's result as it ends; :meth:`drain`, on the loop, runs
    ``on_batch(i, result)`` for every result put so far, in order (the worker wakes the loop
    to drain; a caller may drain at any time, e.g. when its deadline passes).
    """

    __slots__ = ("_on_batch", "_ready", "last")

    def __init__(self, on_batch: Callable[[int, list[bool] | BaseException], None]) -> None:
        self._on_batch = on_batch
        self._ready: collections.deque[tuple[int, list[bool] | BaseException]] = collections.deque()
        #: the worker starts no batch after this index (set by the loop: :meth:`stop_after`)
        self.last = sys.maxsize

    def put(self, i: int, result: list[bool] | BaseException) -> None:
        """Worker thread: batch ``i`` ended with ``result`` (deque appends are thread-safe)."""
        self._ready.append((i, result))

    def drain(self) -> None:
        """Loop thread: report every batch put so far, in order."""
        ready = self._ready
        while ready:
            i, result = ready.popleft()
            self._on_batch(i, result)

    def stop_after(self, i: int) -> None:
        """Loop thread: start no batch after batch ``i`` (-1: none more); a batch already
        running ends and reports as usual.  (One int written under the GIL, read by the
        worker before each batch, like the deadline.)"""
        self.last = i
