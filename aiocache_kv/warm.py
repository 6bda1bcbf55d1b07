"""Warm-up: bring a prompt's cached prefix from storage to host, and on to device, as one
bounded operation (``cache.warm``, ``cache.warm_from``; issue #26).

:func:`warm` runs the paths a request would, in order, under one deadline
(an anyio cancel scope):

1. **storage -> host**: prefetches with the ``wait_complete`` policy and no size threshold
   (a warm-up wants short prompts too), repeated while each round commits pages (one round
   reserves at most half the host pool);
2. **host -> device** (``tier="device"``): a pinned match of the prompt and a ``load_back``
   that waits in line for device room (``load_back(m, timeout=)``) up to what is left of the
   deadline; the match is released at the end.

Nothing outlives the call but what it put in the tree: a prefetch cut short commits the
leading run that arrived and frees (or quarantines, rule 2) the rest; a load-back cut short
stops waiting, and the copies it started land and are the tree's.  The result says what is
where when it returns.  Everything here runs on the loop (rule 1); it holds a handle only
while it runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio

from aiocache_kv.config import PrefetchPolicy
from aiocache_kv.core import CacheCore
from aiocache_kv.errors import CacheClosedError, CapacityError, TransferError
from aiocache_kv.handles import HandleState, MatchResult
from aiocache_kv.logs import get_logger
from aiocache_kv.namespace import Namespace
from aiocache_kv.pins import HandleTable
from aiocache_kv.storage.tier import PrefetchStatus, StorageTier
from aiocache_kv.tree import Tier

log = get_logger(__name__)

__all__ = ["WarmResult", "warm"]

#: the facade's ``load_back(m, timeout=)``
LoadBack = Callable[[MatchResult, float | None], Awaitable[object]]
Release = Callable[[MatchResult], None]


@dataclass(frozen=True, slots=True)
class WarmResult:
    """What a warm-up left where (token counts, whole pages)."""

    tokens: int  #: page-aligned tokens of the prompt
    device_len: int  #: leading tokens on device when it returned
    host_len: int  #: tokens after those in host memory (a ``load_back`` would move them)
    #: tokens read from storage and committed to host while it ran (prefetches running
    #: beside it count too; a round cut short counts what it committed)
    storage_tokens: int
    timed_out: bool = False  #: its ``timeout`` cut it short
    error: str | None = None  #: why it stopped early otherwise (storage failure, no room)

    @property
    def cached_len(self) -> int:
        """Leading tokens matchable from device or host."""
        return self.device_len + self.host_len


def lens(core: CacheCore, ns: Namespace, tokens: list[int], n: int) -> tuple[int, int]:
    """``(device_len, host_len)`` of the cached prefix of ``tokens[:n]``, as a match would
    report them (no pin kept, no hit counted; no root created for an unknown namespace)."""
    tree = core.tree
    if not n or not tree.peek(ns, tokens, n):
        return 0, 0
    node, _ = tree.match(ns, tokens, n)
    return MatchResult(core, node).lens()


async def warm(
    core: CacheCore,
    handles: HandleTable,
    l3: StorageTier | None,
    load_back: LoadBack,
    release: Release,
    ns: Namespace,
    tokens: list[int],
    tier: Tier,
    seconds: float | None,
) -> WarmResult:
    """Warm ``tokens`` (checked) into ``tier`` within ``seconds`` (checked; ``None``: each
    step's own deadline bounds it).  See the module docstring.

    Raises:
        CacheClosedError: the cache closed meanwhile.
        asyncio.CancelledError: the caller was cancelled (nothing leaked: see the module
            docstring).
    """
    p = core.page_size
    n = len(tokens) // p * p
    loop = asyncio.get_running_loop()
    deadline = None if seconds is None else loop.time() + seconds
    counters = core.counters
    counters.warms += 1
    read0 = l3.counters.prefetch_hit_tokens if l3 is not None else 0
    cut = False
    error: str | None = None
    done = False
    try:
        with anyio.move_on_at(math.inf if deadline is None else deadline) as scope:
            if l3 is not None and n:
                error = await _from_storage(core, l3, ns, tokens, n)
            if tier is Tier.DEVICE and n and error is None:
                error = await _to_device(core, handles, load_back, release, ns, tokens, n, deadline)
                cut = error is not None and deadline is not None and loop.time() >= deadline
        cut = cut or scope.cancelled_caught
        done = True
    finally:
        # what prefetches committed while it ran (a round cut short commits what arrived)
        got = l3.counters.prefetch_hit_tokens - read0 if l3 is not None else 0
        counters.warm_storage_tokens += got
        if not done or cut:  # cancelled, or the timeout ran out
            counters.warms_cut_short += 1
    dev, host = lens(core, ns, tokens, n)
    log.debug("warm", tokens=n, device=dev, host=host, storage=got, cut=cut, error=error)
    return WarmResult(n, dev, host, got, cut, None if cut else error)


async def _from_storage(
    core: CacheCore, l3: StorageTier, ns: Namespace, tokens: list[int], n: int
) -> str | None:
    """Prefetch rounds until storage has nothing more to give; the error that stopped it."""
    while True:
        core.tree.root(ns, ns.tag)  # the namespace's seed (the prefetch unpins it again)
        res = await l3.prefetch(ns, tokens, n, PrefetchPolicy.WAIT_COMPLETE, 0)
        if res.status is PrefetchStatus.FAILED:
            return res.error or "storage failed"
        if res.hit_tokens == 0 or res.status is not PrefetchStatus.PARTIAL:
            return None
        if res.usable_tokens >= n:
            return None


async def _to_device(
    core: CacheCore,
    handles: HandleTable,
    load_back: LoadBack,
    release: Release,
    ns: Namespace,
    tokens: list[int],
    n: int,
    deadline: float | None,
) -> str | None:
    """Load the host run of the prompt's match to device; the error that stopped it."""
    tree = core.tree
    if not tree.peek(ns, tokens, n):
        return None
    node, _ = tree.match(ns, tokens, n, pin=True)
    m = MatchResult(core, node, release)
    handles.add(m)
    try:
        if m.host_len:
            loop = asyncio.get_running_loop()
            left = None if deadline is None else max(deadline - loop.time(), 0.0)
            await load_back(m, left)
    except (CapacityError, TransferError) as exc:
        return str(exc)
    finally:
        if m.state is HandleState.PINNED:  # the copies it started land and stay the tree's
            with contextlib.suppress(CacheClosedError):  # closed: the table let go of it
                release(m)
    return None
