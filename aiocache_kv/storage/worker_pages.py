"""``WorkerPages``: host pages a storage worker reads or writes, leased only if the loop stops
waiting for the worker before it returns.

A put of nodes that are storage-FILLING, or a read into pages a prefetch reserved, needs no
lease while the loop waits for its worker: nothing evicts, frees or reuses those pages until
the loop has the worker's answer.  Only when the loop gives up first (a deadline, a
cancellation) do the pages become the worker's alone, and then they are leased
(:meth:`WorkerPages.keep`) before anything can free them, so a freed page waits in quarantine
until the worker returns (:meth:`WorkerPages.release`, ``StorageIO``'s ``on_release``).  A
call answered in time costs no lease at all: two numpy passes less per call, on the loop,
right after the worker woke it (where a first numpy call costs ~100 us beside a store's
copies).  Loop thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from aiocache_kv.pools.allocator import as_ids

if TYPE_CHECKING:
    from aiocache_kv.pools.allocator import PageAllocator, PageIds

__all__ = ["InFlightPages", "WorkerPages", "joined"]


class WorkerPages:
    """The host pages of ``alloc`` one worker call uses, given in ``parts`` (one per node of
    a backup group; see the module docstring): joined into one id array only when leased."""

    __slots__ = ("alloc", "leased", "pages", "parts", "returned")

    def __init__(self, alloc: PageAllocator, parts: Sequence[PageIds]) -> None:
        self.alloc = alloc
        self.parts = parts
        self.pages: np.ndarray | None = None  #: what :meth:`keep` leased
        self.returned = False  #: the worker is done with them
        self.leased = False  #: :meth:`keep` leased them

    def keep(self) -> None:
        """The loop stops waiting for the worker: if it has not returned, its pages are
        leased until it does (whatever is freed meanwhile waits in quarantine)."""
        if not self.returned and not self.leased:
            self.pages = joined(self.parts)
            self.alloc.lease(self.pages)
            self.leased = True

    def release(self) -> None:
        """The worker returned (``on_release``): a lease :meth:`keep` took ends."""
        self.returned = True
        if self.leased:
            self.leased = False
            assert self.pages is not None, "leased without pages"
            self.alloc.unlease(self.pages)


def joined(parts: Sequence[PageIds]) -> np.ndarray:
    """The int64 page ids of ``parts`` (tensors or arrays) in one array, in order (numpy:
    ``torch.cat`` lets go of the GIL, and taking it back from a storage worker may wait a
    switch interval)."""
    ids = [as_ids(p) for p in parts]
    return ids[0] if len(ids) == 1 else np.concatenate(ids) if ids else np.empty(0, np.int64)


class InFlightPages(WorkerPages):
    """The host pages of the parts that workers sharing one order of read parts may still
    write (:attr:`.batch_reports.BatchReports.in_flight`; ``pages_of(i)``: part ``i``'s
    pages).  :meth:`keep` leases those of the parts in flight then; call it only once no
    worker may start another part (``BatchReports.stop_after(-1)`` first).  :meth:`release`
    when every worker returned."""

    __slots__ = ("in_flight", "pages_of")

    def __init__(
        self, alloc: PageAllocator, pages_of: Callable[[int], PageIds], in_flight: set[int]
    ) -> None:
        super().__init__(alloc, [])
        self.pages_of = pages_of
        self.in_flight = in_flight

    def keep(self) -> None:
        """Lease the pages of the parts still in flight (none: nothing is leased)."""
        if self.returned or self.leased:
            return
        self.parts = [self.pages_of(i) for i in sorted(self.in_flight)]
        if self.parts:
            super().keep()
