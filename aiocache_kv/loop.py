"""An asyncio loop whose timers wake on time, not up to a millisecond late.

On Linux asyncio waits in ``epoll_wait``, whose timeout is whole milliseconds: the stdlib
selector rounds every wait up (``math.ceil(timeout * 1e3)``).  A loop woken early (a worker
thread's ``call_soon_threadsafe``: a copy landed, a forward pass returned) goes back to sleep
for the rest of its timer's wait, rounded up again, so a timer due 0.1 ms later fires up to
1 ms late.  A serving loop is woken that way hundreds of times a second; measured with
``aiocache-kv bench lag`` on the project machine, that rounding is about half of the
loop's p99 lag (see ``docs/ARCHITECTURE.md``, "Event-loop lag under a full batch").

:class:`PreciseEpollSelector` waits for the epoll set itself with ``select()``, whose timeout
is in microseconds, then collects the ready events with a zero-timeout ``epoll_wait``: the
same events, the wait as long as asked.  :func:`new_event_loop` makes a loop over it and
:func:`run` runs a coroutine on one, as :func:`asyncio.run` does.  Elsewhere (no epoll:
``kqueue`` waits to the nanosecond already) both give asyncio's default loop.

Nothing in the runtime depends on it: :class:`~aiocache_kv.cache.HiCache` and the engine
run on any asyncio loop.  The command line's demo and benchmarks use it.
"""

from __future__ import annotations

import asyncio
import select
import selectors
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["PRECISE", "PreciseEpollSelector", "new_event_loop", "run"]

T = TypeVar("T")

#: ``select()`` takes descriptors below this only; an epoll set numbered above it waits the
#: stdlib's way (rounded up to the millisecond)
FD_SETSIZE = 1024
#: whether :func:`new_event_loop` makes a precise loop on this platform
PRECISE = hasattr(selectors, "EpollSelector")
#: :func:`run` uses ``asyncio.Runner`` where it exists (a test turns it off for the 3.10 path)
_RUNNER = sys.version_info >= (3, 11)


if PRECISE:

    class PreciseEpollSelector(selectors.EpollSelector):
        """``EpollSelector`` whose ``select(timeout)`` waits ``timeout`` to the microsecond."""

        def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
            """The ready ``(key, events)`` pairs, waiting at most ``timeout`` seconds
            (``None``: until one is ready; ``<= 0``: not at all).

            Raises:
                OSError: from the system calls, as ``EpollSelector.select`` does.
            """
            if timeout is not None and timeout > 0:
                fd = self.fileno()
                if fd < FD_SETSIZE:
                    # readable once an event is ready; interrupted by a signal, it resumes
                    # with what is left of the timeout (PEP 475)
                    select.select([fd], [], [], timeout)
                    timeout = 0
            return super().select(timeout)

else:  # pragma: no cover - exercised only where epoll is missing

    class PreciseEpollSelector(selectors.DefaultSelector):  # type: ignore[no-redef]
        """The platform's default selector (its waits are precise already, or nothing
        better is at hand)."""


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop over :class:`PreciseEpollSelector` on Linux; asyncio's default loop
    elsewhere."""
    if not PRECISE:  # pragma: no cover
        return asyncio.new_event_loop()
    return asyncio.SelectorEventLoop(PreciseEpollSelector())


class _Policy(asyncio.DefaultEventLoopPolicy):
    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        return new_event_loop()


def run(main: Coroutine[Any, Any, T], *, debug: bool | None = None) -> T:
    """Run ``main`` on a new loop from :func:`new_event_loop` and close it, as
    :func:`asyncio.run` does (the same shutdown of async generators and the default
    executor).

    Raises:
        RuntimeError: called from a running event loop.
        Whatever ``main`` raises.
    """
    try:  # checked first, as asyncio.run does (a Runner made its loop before it checks)
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise RuntimeError("aiocache_kv.loop.run() cannot be called from a running event loop")
    runner_type = getattr(asyncio, "Runner", None) if _RUNNER else None
    if runner_type is not None:
        with runner_type(debug=debug, loop_factory=new_event_loop) as runner:
            result: T = runner.run(main)
            return result
    # Python 3.10: asyncio.run takes no loop factory; it asks the policy for the loop
    saved = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(_Policy())
    try:
        return asyncio.run(main, debug=debug)
    finally:
        asyncio.set_event_loop_policy(saved)
