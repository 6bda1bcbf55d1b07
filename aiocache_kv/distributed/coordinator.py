"""How completions reach the tree: at once (one rank) or through agreements (TP).

A collaborator that starts work whose completion shapes the tree (a device<->host copy, a
storage backup) registers an :class:`~aiocache_kv.distributed.acks.AckQueue` for that kind of
work, ``track``\\ s each operation when it starts and ``land``\\ s it when it finishes.  The
coordinator decides when the queue's ``apply`` runs:

* :class:`LocalCoordinator` (one rank) applies an operation the moment it lands;
* :class:`AgreedCoordinator` (tensor parallelism) queues it, and applies it only through an
  agreement taken in the serving loop's call order (see :mod:`.agreement`), so every rank
  applies the same completions, with the same outcome, at the same point.

The rest of the cache asks the coordinator instead of branching on the world size.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from aiocache_kv.distributed.acks import AckQueue
from aiocache_kv.distributed.agreement import Request, Sequencer
from aiocache_kv.distributed.group import TPGroup

T = TypeVar("T")


async def _nothing() -> None:
    return None


class Coordinator(Protocol):
    """Applies tracked completions to the tree, locally or by agreement."""

    #: completions wait for an agreement (more than one rank)
    deferred: bool

    def register(self, queue: AckQueue[Any]) -> None:
        """Add a queue whose operations this coordinator applies."""
        ...

    def unregister(self, queue: AckQueue[Any]) -> None:
        """Remove a queue registered before ``start`` (a start that gave up built it)."""
        ...

    def track(self, queue: AckQueue[T], op: T) -> None:
        """``op`` started (call when it is submitted, in the serving loop's order)."""
        ...

    def land(self, queue: AckQueue[T], op: T, ok: bool) -> None:
        """``op`` finished locally with outcome ``ok`` (on the loop)."""
        ...

    async def settle_landed(self, queue: AckQueue[Any]) -> None:
        """Return once every operation of ``queue`` tracked so far is applied or agreed."""
        ...

    async def settle_all(self) -> None:
        """Return once every tracked operation of every queue is applied."""
        ...

    async def sync(self) -> None:
        """Apply what every rank has (one agreement with TP; nothing with one rank)."""
        ...

    @property
    def pending(self) -> int:
        """Agreements taken and not applied yet (0 with one rank)."""
        ...

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start agreeing in the background (TP)."""
        ...

    async def aclose(self) -> None:
        """Agree and apply what is queued, then stop."""
        ...


class LocalCoordinator:
    """One rank: a completion is applied the moment it lands."""

    deferred = False

    def register(self, queue: AckQueue[Any]) -> None:
        """Nothing to remember: queues apply directly."""

    def unregister(self, queue: AckQueue[Any]) -> None:
        """Nothing to forget."""

    def track(self, queue: AckQueue[T], op: T) -> None:
        """Nothing to track."""

    def land(self, queue: AckQueue[T], op: T, ok: bool) -> None:
        """Apply now."""
        queue.apply(op, ok)

    async def settle_landed(self, queue: AckQueue[Any]) -> None:
        """Operations apply as they land: nothing to wait for here."""

    async def settle_all(self) -> None:
        """Nothing to agree."""

    async def sync(self) -> None:
        """Nothing to agree."""

    @property
    def pending(self) -> int:
        """No agreements exist."""
        return 0

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Nothing to start."""

    async def aclose(self) -> None:
        """Nothing to stop."""


class AgreedCoordinator:
    """Tensor parallelism: completions are applied by agreements, in ticket order."""

    deferred = True

    def __init__(self, group: TPGroup) -> None:
        self.group = group
        self._queues: list[AckQueue[Any]] = []
        self._seq: Sequencer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def collectives(self) -> int:
        """All-reduces issued so far."""
        return self._seq.collectives if self._seq is not None else 0

    def register(self, queue: AckQueue[Any]) -> None:
        """Agreements cover ``queue`` from now on (register every queue before ``start``)."""
        self._queues.append(queue)

    def unregister(self, queue: AckQueue[Any]) -> None:
        """Agreements no longer cover ``queue`` (only before ``start``: a start that gave up
        built it; every rank's vectors must keep one width)."""
        assert self._seq is None, "a queue unregistered after the agreements started"
        self._queues.remove(queue)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the background agreement task."""
        self._loop = loop
        self._seq = Sequencer(self.group, loop)
        self._seq.start()

    def track(self, queue: AckQueue[T], op: T) -> None:
        """Queue ``op`` for agreement."""
        assert self._loop is not None, "coordinator not started"
        queue.push(op, self._loop)

    def land(self, queue: AckQueue[T], op: T, ok: bool) -> None:
        """Record the local outcome; the agreement applies it."""
        queue.land(op, ok)

    @property
    def pending(self) -> int:
        """Agreements taken and not applied yet."""
        return self._seq.pending if self._seq is not None else 0

    def agreement(
        self,
        ready: Callable[[], Awaitable[None]],
        width: int = 0,
        pack: Callable[[], list[int]] | None = None,
        apply: Callable[[list[int]], None] | None = None,
    ) -> Request:
        """Take the next ticket for an agreement on every queue plus ``width`` extra ints.

        ``pack`` gives the extra local values, ``apply`` receives the agreed ones.  If this
        rank cannot pack (a local failure), it still joins the collective, with a vector that
        makes every rank apply nothing for this ticket.
        """
        assert self._seq is not None, "coordinator not started"
        queues = list(self._queues)
        upto = [q.submitted for q in queues]
        widths: list[int] = []

        def pack_all() -> list[int]:
            vec: list[int] = []
            widths.clear()
            for q, u in zip(queues, upto, strict=True):
                part = q.pack(u)
                widths.append(len(part))
                vec += part
            extra = pack() if pack is not None else []
            assert len(extra) == width, f"agreement extra width {len(extra)} != {width}"
            return vec + extra

        def empty() -> list[int]:
            widths[:] = [q.width(u) for q, u in zip(queues, upto, strict=True)]
            return [0] * (sum(widths) + width)

        def plan(agreed: list[int]) -> None:
            pos = 0
            for q, w in zip(queues, widths, strict=True):
                q.plan(agreed[pos : pos + w])
                pos += w

        def apply_all(agreed: list[int]) -> None:
            for q in queues:
                q.apply_next()
            if apply is not None:
                apply(agreed[sum(widths) :])

        return self._seq.submit(Request(ready, pack_all, plan, apply_all, fallback=empty))

    async def settle(self, request: Request) -> None:
        """Wait for ``request``'s agreement and apply every agreement up to it.

        Raises:
            AgreementError: a collective failed.
        """
        assert self._seq is not None, "coordinator not started"
        await self._seq.settle(request)

    async def agree(self, ready: Callable[[], Awaitable[None]] = _nothing) -> None:
        """One agreement after ``ready``, applied before returning."""
        await self.settle(self.agreement(ready))

    async def settle_landed(self, queue: AckQueue[Any]) -> None:
        """Agree once every operation of ``queue`` tracked so far has landed here."""
        upto = queue.submitted
        await self.agree(lambda: queue.wait_landed(upto))

    async def settle_all(self) -> None:
        """Agree once everything tracked so far has landed on this rank."""
        queues = list(self._queues)
        upto = [q.submitted for q in queues]

        async def ready() -> None:
            for q, u in zip(queues, upto, strict=True):
                await q.wait_landed(u)

        await self.agree(ready)

    async def sync(self) -> None:
        """One agreement: apply what every rank has."""
        await self.agree()

    async def aclose(self) -> None:
        """Agree and apply what is queued, then stop."""
        if self._seq is not None:
            await self._seq.aclose()


def coordinator_for(group: TPGroup) -> LocalCoordinator | AgreedCoordinator:
    """The coordinator for ``group``'s world size."""
    return AgreedCoordinator(group) if group.world_size > 1 else LocalCoordinator()


__all__ = ["AgreedCoordinator", "Coordinator", "LocalCoordinator", "coordinator_for"]
