"""The pins held by a cache's handles, and what happens to a handle dropped unreleased.

The table keeps each handle's pinned node, never the handle itself, so a handle the caller
drops is garbage-collected.  Its ``__del__`` then calls :meth:`HandleTable.dropped_soon`, which
asks the loop to release the pin (``loop.call_soon_threadsafe``: a collection may run on any
thread, or in the middle of a tree operation on the loop, so the tree is never touched from
there) and warns with a ``ResourceWarning`` naming the handle: the serving code leaked a pin,
and until now the pages it covered could not be evicted.  A released handle, or one of a
closed cache, does nothing when collected.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from typing import TYPE_CHECKING

from aiocache_kv.handles import HandleState
from aiocache_kv.logs import get_logger

if TYPE_CHECKING:
    from aiocache_kv.core import CacheCore
    from aiocache_kv.handles import Handle
    from aiocache_kv.tree.node import Node

__all__ = ["HandleTable"]

log = get_logger(__name__)


class HandleTable:
    """Pins by handle token (see the module docstring).  Loop thread only, except
    :meth:`dropped_soon`, which only schedules :meth:`dropped`."""

    def __init__(self, core: CacheCore) -> None:
        self._core = core
        self._pins: dict[int, Node] = {}  # handle token -> its pinned node
        self._tokens = itertools.count(1)
        self._closed = False
        self.leaked = 0  #: handles garbage-collected while pinned

    def __len__(self) -> int:
        return len(self._pins)

    def add(self, handle: Handle) -> None:
        """Track the pin ``handle`` holds on ``handle.node`` (taken by the caller)."""
        token = next(self._tokens)
        handle.token = token
        handle.on_drop = self.dropped_soon
        self._pins[token] = handle.node

    def release(self, handle: Handle) -> None:
        """Drop the pin of ``handle`` (checked by the caller: pinned, of this cache); the
        handle is ``RELEASED`` from now on."""
        handle.state = HandleState.RELEASED
        handle.on_drop = None
        self._core.tree.unpin(self._pins.pop(handle.token))

    def dropped_soon(self, token: int, what: str) -> None:
        """From a pinned handle's ``__del__`` (any thread): schedule :meth:`dropped` on the
        loop, then warn.  ``what`` is the handle's class name."""
        loop = self._core.loop
        if token not in self._pins or loop is None or self._closed:
            return
        with contextlib.suppress(RuntimeError):  # a closed loop: the cache is closed too
            loop.call_soon_threadsafe(self.dropped, token, what)
        # after the release is scheduled: under ``-W error`` this raises (and is reported)
        warnings.warn(
            f"{what} #{token} was garbage-collected without cache.release(); its pin is "
            "released now. Release every handle (or use `with cache.match_prefix(...) as m:`).",
            ResourceWarning,
            stacklevel=2,
        )

    def dropped(self, token: int, what: str) -> None:
        """On the loop: a pinned handle was garbage-collected; release its pin."""
        node = self._pins.pop(token, None)
        if node is None or self._closed:
            return  # released meanwhile, or the cache closed
        self.leaked += 1
        self._core.tree.unpin(node)
        log.warning("handle_leaked", handle=f"{what} #{token}", leaked=self.leaked)

    def nodes(self) -> list[Node]:
        """The pinned node of every live handle (one entry per pin)."""
        return list(self._pins.values())

    def close(self) -> None:
        """The cache closed: its pins go with the tree; dropped handles no longer warn."""
        self._closed = True
        self._pins.clear()
