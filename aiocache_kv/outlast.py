"""Work that must finish whatever its caller does.

Two shapes recur: a close that runs once, in its own task, awaited by every caller shielded
(:class:`Once`: a cancelled caller stops waiting, the work goes on); and a wait that a
cancellation must not cut short because what follows it must happen on this path too
(:func:`outlast`: tensor-parallel ranks apply an agreement at the same point of their loops).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

__all__ = ["Once", "outlast"]


async def outlast(fut: asyncio.Future[Any]) -> bool:
    """Wait until ``fut`` is done, through cancellations of the caller (never cancels
    ``fut``); whether one came: the caller does what must follow ``fut``, then raises
    ``asyncio.CancelledError``.  ``fut``'s own outcome is not raised here."""
    cancelled = False
    while not fut.done():
        try:
            await asyncio.wait([fut])
        except asyncio.CancelledError:
            cancelled = True
    if not fut.cancelled():
        fut.exception()  # (retrieved: a caller that was cancelled may not read it)
    return cancelled


class Once:
    """A coroutine run once, in its own task, that every :meth:`run` awaits shielded."""

    __slots__ = ("task",)

    def __init__(self) -> None:
        self.task: asyncio.Task[None] | None = None

    @property
    def started(self) -> bool:
        """Whether :meth:`run` has started the task."""
        return self.task is not None

    async def run(self, make: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Start ``make()`` on the first call; wait for it (a cancelled caller stops
        waiting, the task goes on).  Raises what the task raised."""
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(make())
            self.task.add_done_callback(_retrieve)
        await asyncio.shield(self.task)


def _retrieve(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()  # (every caller may have stopped waiting)
