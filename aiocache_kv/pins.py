"""The pins held by a cache's handles, and what happens to a handle dropped unreleased.

The table keeps each handle's pinned node, never the handle itself, so a handle the caller
drops is garbage-collected.  Its ``__del__`` then calls :meth:`HandleTable.dropped_soon`, which
asks the loop to release the pin (``loop.call_soon_threadsafe``: a collection may run on any
thread, or in the middle of a tree operation on the loop, so the tree is never touched from
there; with TP at the next ``sync`` instead, the same point on every rank) and warns with
a ``ResourceWarning`` naming the handle: the serving code leaked a pin, and until now the
pages it covered could not be evicted.  A released handle, or one of a
closed cache, does nothing when collected.

An insert result may also retain device rows (its caller's pages the tree did not take); the
table keeps their ids by handle token too, and drops those references with the pin, whether
the handle is released or collected.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import warnings
from typing import TYPE_CHECKING

import numpy as np

from aiocache_kv.handles import HandleState
from aiocache_kv.logs import get_logger

if TYPE_CHECKING:
    from aiocache_kv.core import CacheCore
    from aiocache_kv.handles import Handle
    from aiocache_kv.tree.node import Node

__all__ = ["HandleTable"]

log = get_logger(__name__)
_RELEASED = HandleState.RELEASED  # bound once: an enum attribute read is slow on 3.11


class HandleTable:
    """Pins by handle token (see the module docstring).  Loop thread only, except
    :meth:`dropped_soon`, which only schedules :meth:`dropped`."""

    def __init__(self, core: CacheCore) -> None:
        self._core = core
        self._pins: dict[int, Node] = {}  # handle token -> its pinned node
        self._retained: dict[int, np.ndarray] = {}  # handle token -> device rows it retains
        self._tokens = itertools.count(1)
        self._closed = False
        self.leaked = 0  #: handles garbage-collected while pinned
        self._on_drop = self.dropped_soon  # bound once: every handle gets it
        #: with TP, handles collected while pinned, released at the next ``sync`` (below)
        self._dropped_tp: collections.deque[tuple[int, str]] = collections.deque()

    def __len__(self) -> int:
        return len(self._pins)

    def add(self, handle: Handle, retained: np.ndarray | None = None) -> None:
        """Track the pin ``handle`` holds on ``handle.node`` (taken by the caller), and the
        references it holds on the device pages ``retained`` (taken by the caller)."""
        token = next(self._tokens)
        handle.token = token
        handle.on_drop = self._on_drop
        self._pins[token] = handle.node
        if retained is not None and retained.size:
            self._retained[token] = retained

    def retained_by(self, handle: Handle) -> np.ndarray | None:
        """The device pages a live ``handle`` retains (``None``: none)."""
        return self._retained.get(handle.token)

    def release(self, handle: Handle) -> None:
        """Drop the pin of ``handle`` (checked by the caller: pinned, of this cache) and its
        retained rows; the handle is ``RELEASED`` from now on."""
        handle.state = _RELEASED
        handle.on_drop = None
        token = handle.token
        node = self._pins.pop(token)
        if self._retained:  # (_drop, inline: every request releases two handles)
            rows = self._retained.pop(token, None)
            if rows is not None:
                self._core.unretain(rows)
        self._core.tree.unpin(node)

    def _drop(self, token: int, node: Node) -> None:
        rows = self._retained.pop(token, None)
        if rows is not None:
            self._core.unretain(rows)
        self._core.tree.unpin(node)

    def dropped_soon(self, token: int, what: str) -> None:
        """From a pinned handle's ``__del__`` (any thread): schedule :meth:`dropped` on the
        loop, then warn.  ``what`` is the handle's class name."""
        loop = self._core.loop
        if token not in self._pins or loop is None or self._closed:
            return
        if self._core.coordinator.deferred:
            # TP: released where every rank releases it, at the next ``sync`` (a loop
            # callback runs wherever each rank's loop happens to yield: the trees would part)
            self._dropped_tp.append((token, what))  # (a deque's append is thread-safe)
        else:
            with contextlib.suppress(RuntimeError):  # a closed loop: the cache is closed too
                loop.call_soon_threadsafe(self.dropped, token, what)
        # after the release is scheduled: under ``-W error`` this raises (and is reported)
        warnings.warn(
            f"{what} #{token} was garbage-collected without cache.release(); its pin is "
            "released now. Release every handle (or use `with cache.match_prefix(...) as m:`).",
            ResourceWarning,
            stacklevel=2,
        )

    def release_dropped(self) -> None:
        """With TP: release the pins of the handles collected since the last call (on the
        loop, at ``sync``: the same point of every rank's serving loop)."""
        while self._dropped_tp:
            self.dropped(*self._dropped_tp.popleft())

    def dropped(self, token: int, what: str) -> None:
        """On the loop: a pinned handle was garbage-collected; release its pin."""
        node = self._pins.pop(token, None)
        if node is None or self._closed:
            return  # released meanwhile, or the cache closed
        self.leaked += 1
        self._drop(token, node)
        log.warning("handle_leaked", handle=f"{what} #{token}", leaked=self.leaked)

    def nodes(self) -> list[Node]:
        """The pinned node of every live handle (one entry per pin)."""
        return list(self._pins.values())

    def retained(self) -> list[np.ndarray]:
        """The device pages each live handle retains (one array per handle that does)."""
        return list(self._retained.values())

    def close(self) -> None:
        """The cache closed: its pins and retained rows go with the tree and the pools;
        dropped handles no longer warn.  Its hard pins are released and their expiry timer
        cancelled (``hardpins.py``)."""
        self._closed = True
        self._core.hard_pins.close()
        for token, node in self._pins.items():  # the tree's counts agree with no handles
            self._drop(token, node)
        self._pins.clear()
        self._retained.clear()
