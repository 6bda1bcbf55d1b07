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

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aiocache_kv.pools.allocator import PageAllocator, PageIds

__all__ = ["WorkerPages"]


class WorkerPages:
    """The host ``pages`` of ``alloc`` one worker call uses (see the module docstring)."""

    __slots__ = ("alloc", "leased", "pages", "returned")

    def __init__(self, alloc: PageAllocator, pages: PageIds) -> None:
        self.alloc = alloc
        self.pages = pages
        self.returned = False  #: the worker is done with them
        self.leased = False  #: :meth:`keep` leased them

    def keep(self) -> None:
        """The loop stops waiting for the worker: if it has not returned, its pages are
        leased until it does (whatever is freed meanwhile waits in quarantine)."""
        if not self.returned and not self.leased:
            self.alloc.lease(self.pages)
            self.leased = True

    def release(self) -> None:
        """The worker returned (``on_release``): a lease :meth:`keep` took ends."""
        self.returned = True
        if self.leased:
            self.leased = False
            self.alloc.unlease(self.pages)
