"""Entries of the embedding cache and their states.

One :class:`Entry` per hash in the cache's table.  Its :class:`EntryState` says what its slot
holds, and only :meth:`Entry.transition` changes it (every legal edge listed in
:data:`TRANSITIONS`, asserted)::

    LOOKUP ──(size known, slot reserved)──► FILLING ──(read + verified)──► READY
      │                                        │                             │
      └──────────── (miss / failure / cancelled, slot released) ─────────────┴──► GONE
                                                              (evicted) ─────┘

* ``LOOKUP``: a ``get_batch`` is asking the global store for the object's size; no slot.
* ``FILLING``: a slot is reserved and a worker is writing the object into it.  Never read.
* ``READY``: the slot holds the whole, verified entry.  Readable; evictable when
  ``pushes == 0``.  ``insert_batch`` creates entries directly in ``READY``: it copies the
  caller's tensor into the slot synchronously, on the loop, before any await.
* ``GONE``: out of the table, slot released (terminal; kept only for assertions).

Readers copy out of ``READY`` entries only, synchronously, so a half-written slot is never seen.
A task that finds an entry in ``LOOKUP``/``FILLING`` waits for :attr:`Entry.settled` (set when
it reaches ``READY`` or ``GONE``) and looks again.  ``pushes`` counts in-flight global-store
puts reading the slot; such an entry is pinned (not evictable), and its ``idle`` future is set
when the count returns to zero, after the worker released the bytes.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable

from aiocache_kv.embedding.layout import EntryShape
from aiocache_kv.storage.base import PageBuffer

__all__ = ["TRANSITIONS", "Entry", "EntryState"]


class EntryState(enum.IntEnum):
    """Where an entry's bytes are; see the module docstring."""

    LOOKUP = 0
    FILLING = 1
    READY = 2
    GONE = 3


#: legal state changes
TRANSITIONS: dict[EntryState, frozenset[EntryState]] = {
    EntryState.LOOKUP: frozenset({EntryState.FILLING, EntryState.GONE}),
    EntryState.FILLING: frozenset({EntryState.READY, EntryState.GONE}),
    EntryState.READY: frozenset({EntryState.GONE}),
    EntryState.GONE: frozenset(),
}


class Entry:
    """One cached (or being-cached) embedding.  Loop-owned; mutated by the cache only."""

    __slots__ = ("buffer", "hash", "idle", "key", "offset", "pushes", "settled", "shape", "state")

    def __init__(
        self,
        h: bytes,
        key: str,
        state: EntryState,
        settled: asyncio.Future[None] | None = None,
    ) -> None:
        self.hash = h
        self.key = key
        self.state = state
        self.shape: EntryShape | None = None
        self.offset: int | None = None  # extent in the pool, None in LOOKUP / GONE
        self.buffer: PageBuffer | None = None  # the slot: exactly shape.slot_nbytes bytes
        self.pushes = 0
        self.settled = settled  # set on READY / GONE (entries born READY have none)
        self.idle: asyncio.Future[None] | None = None  # set when pushes drops to 0

    def __repr__(self) -> str:
        shape = f"{self.shape.num_tokens}x{self.shape.dim}" if self.shape is not None else "?"
        return (
            f"Entry({self.key!r}, {self.state.name}, shape={shape}, offset={self.offset}, "
            f"pushes={self.pushes})"
        )

    @property
    def evictable(self) -> bool:
        """``READY`` and not read by an in-flight push."""
        return self.state is EntryState.READY and self.pushes == 0

    def transition(self, new: EntryState) -> None:
        """Move to ``new``; settles waiters on ``READY``/``GONE``.  Asserts the edge is legal."""
        assert new in TRANSITIONS[self.state], (
            f"illegal entry transition {self.state.name} -> {new.name} for {self.key!r}"
        )
        if new is EntryState.READY:
            assert self.buffer is not None and self.shape is not None, "READY needs a slot"
        if new is EntryState.GONE:
            assert self.pushes == 0, f"{self.key!r} leaves while {self.pushes} pushes read it"
        self.state = new
        settles = new in (EntryState.READY, EntryState.GONE)
        if settles and self.settled is not None and not self.settled.done():
            self.settled.set_result(None)

    def pin_push(self) -> None:
        """One more in-flight push reads the slot."""
        assert self.state is EntryState.READY, f"push of a {self.state.name} entry {self.key!r}"
        self.pushes += 1

    def unpin_push(self) -> None:
        """An in-flight push is done with the slot (its worker released the bytes)."""
        assert self.pushes > 0, f"unbalanced unpin of {self.key!r}"
        self.pushes -= 1
        if self.pushes == 0 and self.idle is not None:
            if not self.idle.done():
                self.idle.set_result(None)
            self.idle = None


async def wait_settled(
    waits: list[asyncio.Future[None]],
    woken: asyncio.Future[None] | None,
    deadline: float,
    check: Callable[[], None],
) -> bool:
    """Wait for every future of ``waits`` until ``deadline`` (loop time) or until ``woken``
    (the cache closing) is done; returns whether all of ``waits`` are.  The shared futures are
    never cancelled.  An entry a worker holds past its timeout settles only when the worker
    returns, which a stuck store call may never do: a caller waits on it this long at most.

    Raises:
        What ``check`` raises once woken (the cache closed meanwhile).
    """
    loop = asyncio.get_running_loop()
    pending = [w for w in waits if not w.done()]
    while pending:
        left = deadline - loop.time()
        if left <= 0:
            break
        await asyncio.wait(
            [*pending, *([woken] if woken is not None else [])],
            timeout=left,
            return_when=asyncio.FIRST_COMPLETED,
        )
        check()
        pending = [w for w in pending if not w.done()]
    return not pending
