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
where when it returns, and ``error`` why it stopped short otherwise: the storage failed, a
round found no host room (``"host pool full"``) or a bad page, or the load-back failed or
found no device room.  A storage phase that stops short for want of room still loads what
host holds to device; one whose storage failed does not.  Everything here runs on the loop
(rule 1); it holds a handle only while it runs.

A cache that closes meanwhile ends it: after every wait (each prefetch round, the
load-back) the cache's lifecycle is checked, and a cache no longer running raises
:class:`CacheClosedError` once the warm-up's match is released (the prefetch that returned
already let go of its anchor and reservation).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio

from aiocache_kv.config import PrefetchPolicy
from aiocache_kv.core import CacheCore
from aiocache_kv.errors import CacheClosedError, CapacityError, TransferError
from aiocache_kv.handles import HandleState, MatchResult
from aiocache_kv.lifecycle import Lifecycle
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
#: the facade's lifecycle now (``HiCache``'s state)
State = Callable[[], Lifecycle]


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
    #: why it stopped short otherwise: the storage failed, a prefetch round found no host
    #: room (``"host pool full"``) or a bad page, the load-back failed or found no device room
    error: str | None = None

    @property
    def cached_len(self) -> int:
        """Leading tokens matchable from device or host."""
        return self.device_len + self.host_len


def check_alive(state: State) -> None:
    """Raise if the cache stopped running while the warm-up waited.

    Raises:
        CacheClosedError: naming the state (``closing`` or ``closed``).
    """
    now = state()
    if now is not Lifecycle.RUNNING:
        raise CacheClosedError(f"warm: cache is {now.value} (closed meanwhile)")


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
    state: State,
    ns: Namespace,
    tokens: list[int],
    tier: Tier,
    seconds: float | None,
) -> WarmResult:
    """Warm ``tokens`` (checked) into ``tier`` within ``seconds`` (checked; ``None``: each
    step's own deadline bounds it) on a running cache (``state``: its lifecycle, checked
    after every wait).  See the module docstring.

    Raises:
        CacheClosedError: the cache closed meanwhile (nothing of the warm-up held: its
            match released, its prefetches done).
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
    failed = False  # the storage failed: nothing more is tried
    done = closed = False
    try:
        with anyio.move_on_at(math.inf if deadline is None else deadline) as scope:
            if l3 is not None and n:
                error, failed = await _from_storage(core, l3, state, ns, tokens, n)
            if tier is Tier.DEVICE and n and not failed:
                args = (core, handles, load_back, release, state)
                why = await _to_device(*args, ns, tokens, n, deadline)
                cut = why is not None and deadline is not None and loop.time() >= deadline
                error = why or error  # the load-back's, else why storage stopped short
        cut = cut or scope.cancelled_caught
        done = True
    except CacheClosedError:
        closed = True
        raise
    finally:
        # what prefetches committed while it ran (a round cut short commits what arrived)
        got = l3.counters.prefetch_hit_tokens - read0 if l3 is not None else 0
        counters.warm_storage_tokens += got
        if not (done or closed) or cut:  # cancelled, or the timeout ran out
            counters.warms_cut_short += 1
    dev, host = lens(core, ns, tokens, n)
    log.debug("warm", tokens=n, device=dev, host=host, storage=got, cut=cut, error=error)
    return WarmResult(n, dev, host, got, cut, None if cut else error)


async def _from_storage(
    core: CacheCore,
    l3: StorageTier,
    state: State,
    ns: Namespace,
    tokens: list[int],
    n: int,
) -> tuple[str | None, bool]:
    """Prefetch rounds until storage has nothing more to give.  Returns why it stopped
    short of ``n`` (``None``: it did not, or storage has no more of the prompt) and whether
    the storage failed.

    Raises:
        CacheClosedError: the cache closed during a round.
    """
    error: str | None = None
    while True:
        core.tree.root(ns, ns.tag)  # the namespace's seed (the prefetch unpins it again)
        res = await l3.prefetch(ns, tokens, n, PrefetchPolicy.WAIT_COMPLETE, 0)
        check_alive(state)  # the round is over: its anchor and reservation are let go
        if res.status is PrefetchStatus.FAILED:
            return res.error or "storage failed", True
        if res.error is not None:  # no host room, a bad page: the round stopped there
            error = res.error
        elif res.hit_tokens:  # a round that only ran out of its share of the pool
            error = None
        if res.usable_tokens >= n:
            return None, False
        if res.hit_tokens == 0 or res.status is not PrefetchStatus.PARTIAL:
            return error, False  # storage has no more of it (``error``: why)


async def _to_device(
    core: CacheCore,
    handles: HandleTable,
    load_back: LoadBack,
    release: Release,
    state: State,
    ns: Namespace,
    tokens: list[int],
    n: int,
    deadline: float | None,
) -> str | None:
    """Load the host run of the prompt's match to device; the error that stopped it.

    Raises:
        CacheClosedError: the cache closed meanwhile (the match released first).
    """
    check_alive(state)  # (a storage phase that awaited checked already)
    tree = core.tree
    if not tree.peek(ns, tokens, n):
        return None
    node, _ = tree.match(ns, tokens, n, pin=True)
    m = MatchResult(core, node, release)
    handles.add(m)
    error: str | None = None
    closed: CacheClosedError | None = None
    try:
        if m.host_len:
            loop = asyncio.get_running_loop()
            left = None if deadline is None else max(deadline - loop.time(), 0.0)
            await load_back(m, left)
    except (CapacityError, TransferError) as exc:
        error = str(exc)
    except CacheClosedError as exc:
        closed = exc  # raised below, once the match is released
    finally:
        # the copies it started land and stay the tree's; a closing cache refuses
        # ``release``, so the table lets go of the match itself (a closed one already did)
        if m.state is HandleState.PINNED and state() is not Lifecycle.CLOSED:
            handles.release(m)
    check_alive(state)
    if closed is not None:  # (a cache never runs again once it closed)
        raise closed
    return error
