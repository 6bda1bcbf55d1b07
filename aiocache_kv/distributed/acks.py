"""Completions queued for agreement: applied in submission order, as many as every rank has.

An :class:`AckQueue` holds the operations of one kind (device->host writes, host->device
loads, storage backups) from submission until they are applied.  ``land`` records a local
completion; an agreement packs, for the operations that existed at ticket time, how many have
landed in order and whether each succeeded; the MIN over ranks says how many to apply and
with which outcome, and :meth:`apply_next` applies them - the same ones, with the same
outcome, in the same order, on every rank.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class AckQueue(Generic[T]):
    """Operations of one kind awaiting agreed application."""

    def __init__(self, name: str, apply: Callable[[T, bool], None]) -> None:
        self.name = name
        #: applies one operation with its (local or agreed) outcome, on the loop
        self.apply = apply
        self._ops: deque[T] = deque()
        self._landed: dict[int, tuple[bool, asyncio.Future[None]]] = {}
        self._waiters: dict[int, asyncio.Future[None]] = {}
        self.applied = 0  #: operations applied so far
        self.planned = 0  #: operations booked for application by agreements so far
        self.submitted = 0  #: operations ever pushed
        self._plans: deque[tuple[int, list[int]]] = deque()

    def __len__(self) -> int:
        return len(self._ops)

    def push(self, op: T, loop: asyncio.AbstractEventLoop) -> None:
        """Queue a just-submitted operation."""
        self._ops.append(op)
        self._waiters[id(op)] = loop.create_future()
        self.submitted += 1

    def land(self, op: T, ok: bool) -> None:
        """Record that ``op`` finished locally (not applied yet)."""
        fut = self._waiters[id(op)]
        self._landed[id(op)] = (ok, fut)
        if not fut.done():
            fut.set_result(None)

    def _window(self, upto: int) -> list[T]:
        start = self.planned - self.applied
        return [self._ops[i] for i in range(start, upto - self.applied)]

    async def wait_landed(self, upto: int) -> None:
        """Wait until every operation not yet planned, up to index ``upto``, has landed."""
        waits = [self._waiters[id(op)] for op in self._window(upto)]
        if waits:
            await asyncio.wait(waits)

    def pack(self, upto: int) -> list[int]:
        """``[landed-in-order count, ok flag per operation]`` for operations up to ``upto``."""
        flags: list[int] = []
        n = 0
        counting = True
        for op in self._window(upto):
            state = self._landed.get(id(op))
            if state is None:
                counting = False
                flags.append(1)
                continue
            if counting:
                n += 1
            flags.append(1 if state[0] else 0)
        return [n, *flags]

    def width(self, upto: int) -> int:
        """Length of :meth:`pack`'s vector for ``upto``."""
        return 1 + upto - self.planned

    def plan(self, agreed: list[int]) -> None:
        """Book the agreed count and outcomes (``agreed`` is this queue's slice of the vector)."""
        n = agreed[0]
        self._plans.append((n, agreed[1 : 1 + n]))
        self.planned += n

    def apply_next(self) -> None:
        """Apply the oldest booked agreement: its operations, with the agreed outcomes."""
        n, flags = self._plans.popleft()
        for i in range(n):
            op = self._ops.popleft()
            del self._landed[id(op)]
            del self._waiters[id(op)]
            self.applied += 1
            self.apply(op, flags[i] == 1)
