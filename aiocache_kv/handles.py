"""Handles returned by ``match_prefix`` and ``insert``: each owns one pin on its path.

A handle's numbers are derived from the tree when read (never stored), so they stay right
when a pinned node is split by another insert or loaded back by another request.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from aiocache_kv.errors import HandleError, InvalidTypeError
from aiocache_kv.tree.node import ABSENT, FILLING, RESIDENT, Node
from aiocache_kv.tree.pathwalk import path_lens
from aiocache_kv.validate import page_slots

if TYPE_CHECKING:
    from aiocache_kv.core import CacheCore


H = TypeVar("H", bound="Handle")

_NO_IDS = np.empty(0, dtype=np.int64)


class HandleState(enum.IntEnum):
    """Lifecycle of a handle's pin."""

    PINNED = 1
    RELEASED = 2


# bound once: on Python 3.11 an enum class attribute read takes the slow ``__getattr__`` hook
# (~90 ns), and every request reads these several times
_PINNED = HandleState.PINNED


class Handle:
    """A pin on one path of the tree, owned by the caller until ``cache.release``.

    Also a context manager: ``with cache.match_prefix(tokens) as m: ...`` releases ``m`` at
    the end of the block (unless it was released already).
    """

    __slots__ = ("_releaser", "core", "node", "on_drop", "state", "token")

    def __init__(
        self,
        core: CacheCore,
        node: Node,
        releaser: Callable[[Any], None] | None = None,
    ) -> None:
        self.core = core  #: the state of the cache that issued the handle
        #: the last node of the handle's path (a root when nothing matched); read-only (a
        #: plain attribute, not a property: the per-request path reads it several times)
        self.node = node
        self._releaser = releaser  # the issuing cache's ``release``
        self.state = _PINNED
        self.token = 0  #: the issuing cache's key for this handle's pin
        #: called with ``token`` and the class name if the handle is collected while pinned
        #: (see ``pins``)
        self.on_drop: Callable[[int, str], None] | None = None

    def __del__(self) -> None:
        on_drop = getattr(self, "on_drop", None)  # None too if __init__ did not finish
        if on_drop is not None and self.state is _PINNED:
            on_drop(self.token, type(self).__name__)

    def __enter__(self: H) -> H:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.state is _PINNED and self._releaser is not None:
            self._releaser(self)

    def _path(self) -> list[Node]:
        if self.state is not _PINNED:
            raise self._released()
        return self.core.tree.path(self.node)

    def _released(self) -> HandleError:
        """What reading a released handle's numbers or rows raises: once the pin is gone its
        pages may be evicted and hold another prompt's KV."""
        return HandleError(
            f"{type(self).__name__} was released: its lengths and rows are gone (its pages "
            "may hold other tokens now); match again"
        )


class MatchResult(Handle):
    """The cached prefix of a prompt.  Release it with ``cache.release(m)``.

    With trailing-window components (SWA, Mamba state) the match is cut where every window is
    complete at its end.  Reuse exactly this prefix: to reuse less, match the shorter prefix
    again - a window is only guaranteed complete at the end of a match.
    """

    __slots__ = ()

    def _runs(self) -> tuple[list[Node], int, int, int]:
        """The path and its runs: ``path[:d]`` the device part (device-resident, ending where
        every trailing window is whole), ``path[d:u]`` what a load-back adds (``u``: the last
        such end once the host run is on device), ``path[i:u]`` the host-only nodes it
        moves (``path[:i]`` is the whole device-resident run).  Returns ``(path, d, i, u)``.

        The device part is cut on its own: a device run may end on a node that lacks a
        window's pages (it came from storage without them) while the path goes on in host
        memory to an end where every window is whole; serving that run alone would hand the
        model a state that was never stored."""
        path = self._path()
        core = self.core
        i = 0
        while i < len(path) and path[i].device is RESIDENT:
            i += 1
        j = i
        while j < len(path) and path[j].host is RESIDENT and path[j].device is not RESIDENT:
            if path[j].corrupt:  # failed verification at load-back: a miss from here on
                break
            j += 1
        d = len(core.usable_path(path[:i]))
        u = len(core.usable_path(path[:j]))  # >= d; when > d, also > i (d is the last <= i)
        return path, d, i, u

    def parts(self) -> tuple[list[Node], list[Node]]:
        """The device part, and the host-only nodes ``load_back`` moves to extend it."""
        path, d, i, u = self._runs()
        return path[:d], path[i:u]

    def lens(self) -> tuple[int, int]:
        """``(device_len, host_len)``: the tokens of the device part and of what a
        load-back adds to it, without the lists."""
        if self.core.trailing:  # windows may cut the path: the general rule
            path, d, _, u = self._runs()
            dev = sum(len(path[k].key) for k in range(d))
            return dev, sum(len(path[k].key) for k in range(d, u))
        if self.state is not _PINNED:
            raise self._released()
        return path_lens(self.node)  # one walk up, no lists (every request reads these)

    @property
    def matched_len(self) -> int:
        """Tokens matched in any tier (and usable for every component)."""
        path = self._path()
        cut = next((k for k, n in enumerate(path) if n.corrupt), len(path))
        return sum(len(n.key) for n in self.core.usable_path(path[:cut]))

    @property
    def device_len(self) -> int:
        """Tokens of the leading device-resident part.

        Raises (as every length and row of a handle, :class:`InsertResult`'s too):
            HandleError: the handle was released.
        """
        # (lens, inline: a serving loop reads this on every request)
        if self.state is not _PINNED:
            raise self._released()
        return self.lens()[0] if self.core.trailing else path_lens(self.node)[0]

    @property
    def host_len(self) -> int:
        """Tokens after the device part that are host-resident (``load_back`` moves them)."""
        return self.lens()[1]

    def _ids(self, own: bool = True) -> np.ndarray:
        path, d, _, _ = self._runs()
        return _joined([path[k].device_pages for k in range(d)], own=own)

    @property
    def device_pages(self) -> torch.Tensor:
        """Device page ids of the device-resident part (the caller's copy)."""
        return torch.from_numpy(self._ids())

    @property
    def device_indices(self) -> torch.Tensor:
        """Device token slots of the device-resident part (rows of ``device_kv`` views; the
        caller's copy)."""
        p = self.core.page_size
        return page_slots(self._ids(own=p == 1), p)  # (page_slots makes a new array at p > 1)

    def __repr__(self) -> str:
        if self.state is not _PINNED:
            return f"<MatchResult {self.state.name}>"
        return (
            f"<MatchResult device_len={self.device_len} host_len={self.host_len} {self.state.name}>"
        )


class WriteAck:
    """Awaitable completion of a write-through.  Awaiting it never cancels the copy."""

    __slots__ = ("_future",)

    def __init__(self, future: asyncio.Future[None]) -> None:
        self._future = future

    def done(self) -> bool:
        """Whether the ack has been applied."""
        return self._future.done()

    def __await__(self) -> Generator[Any, None, None]:
        return asyncio.shield(self._future).__await__()


class InsertResult(Handle):
    """What ``insert`` did.  Holds a pin on the inserted path until released.

    ``inserted_len`` is normally every whole page of the tokens.  It is shorter when the insert
    met a node whose ``load_back`` was still in flight: nothing may hang below such a node on
    device (a failed load turns it back into host-only), so the insert stops right after it
    and pins only that far: the KV of the pages after it is not cached.

    The caller's rows stay valid until the result is released: the rows it passed that the tree
    did not take (its own copies of pages the tree already held, the pages after a loading
    node) are *retained* (``retained_pages``), not freed: never evicted or reallocated, and
    freed when the last result retaining them is released.  ``device_indices`` are the tree's
    rows for the inserted path, which a caller may switch to (it never has to).  Passed as
    ``insert(..., prefix=r)``, the new result retains ``r``'s rows too, so ``r`` may be
    released right after.
    """

    __slots__ = ("_retained", "inserted_len", "prefix_len", "uncached_len", "write_through")

    def __init__(
        self,
        core: CacheCore,
        node: Node,
        prefix_len: int,
        inserted_len: int,
        write_through: WriteAck | None,
        releaser: Callable[[Any], None] | None = None,
        uncached_len: int = 0,
        retained: np.ndarray = _NO_IDS,
    ) -> None:
        super().__init__(core, node, releaser)
        #: tokens of the insert that are not cached: the unaligned tail (its slots stay the
        #: caller's) plus whatever followed a node still loading back
        self.uncached_len = uncached_len
        self.prefix_len = prefix_len  #: tokens that were already cached (any tier)
        self.inserted_len = inserted_len  #: page-aligned tokens now cached and pinned
        self.write_through = write_through  #: awaitable host backup, or None
        self._retained = retained  # int64 ids (shared with the handle table: never written)

    @property
    def retained_pages(self) -> torch.Tensor:
        """Device page ids of the caller's rows this result keeps allocated until released
        (rows the tree did not take, and those of a ``prefix=`` insert result); a copy.

        Raises:
            HandleError: the result was released (the rows were freed).
        """
        if self.state is not _PINNED:
            raise self._released()
        return torch.from_numpy(self._retained.copy())

    def _device_part(self) -> list[Node]:
        path = self._path()
        i = 0
        while i < len(path) and path[i].device is RESIDENT:
            i += 1
        return self.core.usable_path(path[:i])

    @property
    def device_len(self) -> int:
        """Tokens of the leading device-resident part of the inserted path (normally
        ``inserted_len``; less while a node it ends on is still loading back)."""
        return sum(len(n.key) for n in self._device_part())

    @property
    def device_pages(self) -> torch.Tensor:
        """The tree's device page ids of the device-resident part (the canonical rows; the
        caller's copy)."""
        return torch.from_numpy(_joined([n.device_pages for n in self._device_part()]))

    @property
    def device_indices(self) -> torch.Tensor:
        """The tree's token slots for the device-resident part: rows of ``device_kv`` views
        holding the same KV as the caller's own (retained) rows for those tokens (the
        caller's copy)."""
        p = self.core.page_size
        ids = _joined([n.device_pages for n in self._device_part()], own=p == 1)
        return page_slots(ids, p)

    def __repr__(self) -> str:
        return (
            f"<InsertResult prefix_len={self.prefix_len} inserted_len={self.inserted_len} "
            f"uncached_len={self.uncached_len} retained={self._retained.size} "
            f"{self.state.name}>"
        )


def _joined(pages: list[np.ndarray | None], *, own: bool = True) -> np.ndarray:
    """The nodes' device page ids in path order (device-resident nodes: none is ``None``):
    a new array, never a node's own (a caller writing to what it was handed must not change
    the tree's pages), unless ``own=False`` (the caller makes its own array from it)."""
    if len(pages) == 1:
        return pages[0].copy() if own else pages[0]  # type: ignore[union-attr,return-value]
    return np.concatenate(pages) if pages else _NO_IDS.copy()  # type: ignore[arg-type]


def check_handle(handle: object, kind: type[Handle], core: CacheCore) -> None:
    """Raise unless ``handle`` is a pinned ``kind`` issued by the cache whose core is ``core``.

    Raises:
        InvalidTypeError: not a ``kind``.
        HandleError: another cache's handle, or already released.
    """
    if isinstance(handle, kind) and handle.core is core and handle.state is _PINNED:
        return  # the per-request case, checked in one line
    if not isinstance(handle, kind):
        raise InvalidTypeError(f"expected a {kind.__name__}, got {type(handle).__name__}")
    if handle.core is not core:
        raise HandleError("handle belongs to another cache")
    raise HandleError(f"handle already {handle.state.name.lower()}")


#: the handle classes the caches issue, and their live state: ``type(h) in HANDLE_TYPES and
#: h.core is core and h.state is PINNED`` is :func:`check_handle`'s passing case, which the
#: per-request calls test inline
HANDLE_TYPES = frozenset((MatchResult, InsertResult))
PINNED = HandleState.PINNED

__all__ = [
    "ABSENT",
    "FILLING",
    "HANDLE_TYPES",
    "PINNED",
    "Handle",
    "HandleState",
    "InsertResult",
    "MatchResult",
    "WriteAck",
]
