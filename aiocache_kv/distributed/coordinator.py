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
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, TypeVar

from aiocache_kv.distributed.acks import AckQueue
from aiocache_kv.distributed.agreement import Request, Sequencer
from aiocache_kv.distributed.group import TPGroup
from aiocache_kv.distributed.layout import digest
from aiocache_kv.errors import ConfigError

T = TypeVar("T")


async def _nothing() -> None:
    return None


def _plan_nothing(agreed: list[int]) -> None:
    return None


class Coordinator(Protocol):
    """Applies tracked completions to the tree, locally or by agreement."""

    #: completions wait for an agreement (more than one rank)
    deferred: bool

    @property
    def started(self) -> bool:
        """Its agreement task runs (TP, between ``start`` and ``aclose``)."""
        ...

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

    async def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start agreeing in the background (TP), once every rank has the same layout."""
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

    @property
    def started(self) -> bool:
        """Nothing runs."""
        return False

    async def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Nothing to start."""

    async def aclose(self) -> None:
        """Nothing to stop."""


class AgreedCoordinator:
    """Tensor parallelism: completions are applied by agreements, in ticket order."""

    deferred = True

    def __init__(self, group: TPGroup, layout: Mapping[str, str] | None = None) -> None:
        self.group = group
        #: settings every rank must share (:mod:`.layout`), checked at :meth:`start`
        self.layout = dict(layout or {})
        self._queues: list[AckQueue[Any]] = []
        self._seq: Sequencer | None = None
        self._closed = False  # (aclose ran on the sequencer of the last start)
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def started(self) -> bool:
        """Its agreement task runs (between ``start`` and ``aclose``)."""
        return self._seq is not None and not self._closed

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

    async def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the background agreement task; its first collective checks that every rank
        has the same :attr:`layout` and agreement queues (:mod:`.layout`).

        Raises:
            ConfigError: the ranks differ (on every rank, naming the fields that differ and
                this rank's values); the task is stopped again.
            AgreementError: the collective failed.
        """
        self._loop = loop
        self._closed = False
        seq = self._seq = Sequencer(self.group, loop)
        seq.start()
        fields = {**self.layout, "agreement queues": repr([q.name for q in self._queues])}
        names = sorted(fields)
        sums = [digest(fields[n]) for n in names]
        differ: list[str] = []

        def pack() -> list[int]:
            return [v for x in sums for v in (x, -x)]

        def compare(agreed: list[int]) -> None:  # MIN of x and of -x: the same iff all equal
            differ.extend(n for i, n in enumerate(names) if agreed[2 * i] != -agreed[2 * i + 1])

        try:
            await seq.settle(seq.submit(Request(_nothing, pack, _plan_nothing, compare)))
            if differ:
                shown = ", ".join(f"{n} (this rank: {fields[n]})" for n in differ)
                raise ConfigError(f"tensor-parallel ranks are configured differently: {shown}")
        except BaseException:
            self._seq = None  # (a start that gave up may unregister its queues)
            await seq.aclose()
            raise

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
            self._closed = True
            await self._seq.aclose()


def coordinator_for(
    group: TPGroup, layout: Mapping[str, str] | None = None
) -> LocalCoordinator | AgreedCoordinator:
    """The coordinator for ``group``'s world size (``layout``: what its ranks must share).

    Raises:
        ConfigError: the group's rank or world size is out of range.
    """
    rank, world = group.rank, group.world_size
    if not (type(world) is int and type(rank) is int and 0 <= rank < world):
        raise ConfigError(
            f"a TP group needs 0 <= rank < world_size, got rank={rank!r} world_size={world!r}"
        )
    return AgreedCoordinator(group, layout) if world > 1 else LocalCoordinator()


__all__ = ["AgreedCoordinator", "Coordinator", "LocalCoordinator", "coordinator_for"]
