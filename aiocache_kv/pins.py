"""The pins held by a cache's handles, and what happens to a handle dropped unreleased.

The table keeps each handle's pinned node, never the handle itself, so a handle the caller
drops is garbage-collected.  Its finalizer then asks the loop to release the pin
(``loop.call_soon_threadsafe``: a collection may run on any thread, or in the middle of a tree
operation on the loop, so the tree is never touched from there) and warns with a
``ResourceWarning`` naming the handle: the serving code leaked a pin, and until now the pages
it covered could not be evicted.  Releasing (``cache.release`` or ``with``) detaches the
finalizer; so does closing the cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import warnings
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiocache_kv.handles import HandleState
from aiocache_kv.logs import get_logger

if TYPE_CHECKING:
    from aiocache_kv.core import CacheCore
    from aiocache_kv.handles import Handle
    from aiocache_kv.tree.node import Node

__all__ = ["HandleTable"]

log = get_logger(__name__)


@dataclass(slots=True)
class _Pin:
    node: Node
    finalizer: weakref.finalize[..., Any]
    what: str


def _dropped(
    table: weakref.ref[HandleTable], token: int, loop: asyncio.AbstractEventLoop, what: str
) -> None:
    """Finalizer of a pinned handle: hand the release to the loop, then warn."""
    live = table()
    if live is not None:
        with contextlib.suppress(RuntimeError):  # a closed loop: the cache is closed too
            loop.call_soon_threadsafe(live.dropped, token)
    # after the release is scheduled: under ``-W error`` this raises (and is reported)
    warnings.warn(
        f"{what} was garbage-collected without cache.release(); its pin is released now. "
        "Release every handle (or use `with cache.match_prefix(...) as m:`).",
        ResourceWarning,
        stacklevel=2,
    )


class HandleTable:
    """Pins by handle token (see the module docstring).  Loop thread only, except the
    finalizers, which only schedule :meth:`dropped`."""

    def __init__(self, core: CacheCore) -> None:
        self._core = core
        self._pins: dict[int, _Pin] = {}
        self._tokens = itertools.count(1)
        self.leaked = 0  #: handles garbage-collected while pinned

    def __len__(self) -> int:
        return len(self._pins)

    def add(self, handle: Handle) -> None:
        """Track the pin ``handle`` holds on ``handle.node`` (taken by the caller)."""
        loop = self._core.loop
        assert loop is not None, "handles are issued by a running cache"
        token = next(self._tokens)
        handle.token = token
        what = f"{type(handle).__name__} #{token}"
        fin = weakref.finalize(handle, _dropped, weakref.ref(self), token, loop, what)
        fin.atexit = False  # nothing to release at interpreter exit
        self._pins[token] = _Pin(handle.node, fin, what)

    def release(self, handle: Handle) -> None:
        """Drop the pin of ``handle`` (checked by the caller: pinned, of this cache); the
        handle is ``RELEASED`` from now on."""
        handle.state = HandleState.RELEASED
        pin = self._pins.pop(handle.token)
        pin.finalizer.detach()
        self._core.tree.unpin(pin.node)

    def dropped(self, token: int) -> None:
        """On the loop: a pinned handle was garbage-collected; release its pin."""
        pin = self._pins.pop(token, None)
        if pin is None:
            return  # released meanwhile, or the cache closed
        self.leaked += 1
        self._core.tree.unpin(pin.node)
        log.warning("handle_leaked", handle=pin.what, leaked=self.leaked)

    def nodes(self) -> list[Node]:
        """The pinned node of every live handle (one entry per pin)."""
        return [pin.node for pin in self._pins.values()]

    def close(self) -> None:
        """The cache closed: its pins go with the tree; dropped handles no longer warn."""
        for pin in self._pins.values():
            pin.finalizer.detach()
        self._pins.clear()
