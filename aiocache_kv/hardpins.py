"""Hard pins with expiry: ``cache.pin(tokens, ttl=, tier=)`` keeps a cached prefix resident in
one tier until ``cache.unpin(pin)`` or its deadline (issue #26).

A pin covers the leading run of the prompt's pages that is resident in its tier *now*:

* **device**: the path's device-resident run gets one tree pin on its last node
  (:meth:`~aiocache_kv.tree.tiers.TierBook.pin`, like a handle's), so no page of it is evicted
  from device or host;
* **host**: the path's host-resident run gets one *host* pin on its last node
  (:meth:`~aiocache_kv.tree.tiers.TierBook.pin_host`, ``Node.host_pins``): no node of it is a
  host victim and its host pages count as protected, while device copies above it may still
  be demoted (a host pin never keeps device memory).

Pins are bounded: the pages under any pin of a tier (each node counted once, however many pins
share it) stay at most ``max_pinned_fraction`` of that tier's pool, and a pin that would go
beyond raises :class:`~aiocache_kv.errors.PinLimitError` with nothing changed, so pins never
starve a pool.  Every pin has a ``ttl`` (at most ``max_pin_ttl``).  Expiry runs on the loop
without a timer per page: one heap of ``(deadline, token)`` entries (lazy deletion: an entry of
a pin already released is dropped when it comes up) and one ``loop.call_at`` timer for the
earliest deadline, re-armed when it fires and when an earlier pin arrives.  A pin that ends
(released or expired) drops its tree pin; an unpin that leaves a node with no pin runs the
tree's ``on_unpinned`` hook, so requests waiting for device pages are served.  ``close`` (at
``aclose``) cancels the timer and releases every pin.  Rule 1: all of it runs on the loop
thread; nothing here waits.
"""

from __future__ import annotations

import asyncio
import enum
import heapq
import math
from collections.abc import Callable, Hashable

from aiocache_kv.config import CacheConfig
from aiocache_kv.errors import (
    HandleError,
    InvalidInputError,
    InvalidTypeError,
    NotCachedError,
    PinLimitError,
)
from aiocache_kv.logs import get_logger
from aiocache_kv.numeric import check_real
from aiocache_kv.stats import PinCounters
from aiocache_kv.tree import Node, RadixTree, Tier
from aiocache_kv.tree.keycmp import common_len
from aiocache_kv.tree.node import RESIDENT

log = get_logger(__name__)

__all__ = ["CachePin", "HardPins", "PinState", "check_pin_tier"]

_TIERS = {"device": Tier.DEVICE, "host": Tier.HOST}


class PinState(enum.Enum):
    """Lifecycle of a :class:`CachePin`."""

    ACTIVE = "active"  #: its pages are held in its tier
    #: ``cache.unpin``, the cache closing, a ``drop`` of its pages or their failing
    #: verification at load-back (``storage/deferred.py``) ended it
    RELEASED = "released"
    EXPIRED = "expired"  #: its ``ttl`` ran out


class CachePin:
    """A hard pin from ``cache.pin``: what it holds and until when.

    Read-only for its holder: ``tier``, ``pinned_len`` (tokens pinned, whole pages), ``pages``
    (pages pinned), ``expires_at`` (the loop's clock, ``loop.time()``) and ``state`` (set by
    the cache).  ``await pin.wait()`` returns when it ends.  A pin dropped without
    ``cache.unpin`` just runs until its deadline.
    """

    __slots__ = ("expires_at", "issuer", "pages", "pinned_len", "state", "tier", "token")

    def __init__(
        self, issuer: HardPins, token: int, tier: Tier, pinned_len: int, pages: int, at: float
    ) -> None:
        self.issuer = issuer  #: the pin table of the cache that issued it
        self.token = token  #: its key in that table
        self.tier = tier
        self.pinned_len = pinned_len
        self.pages = pages
        self.expires_at = at
        self.state = PinState.ACTIVE

    async def wait(self) -> PinState:
        """Wait until the pin ends (released or expired, or the cache closed); its state.

        Cancelling the wait changes nothing about the pin.
        """
        if self.state is not PinState.ACTIVE:
            return self.state
        return await asyncio.shield(self.issuer.ended(self))

    def __repr__(self) -> str:
        return (
            f"<CachePin tier={self.tier.name.lower()} pinned_len={self.pinned_len} "
            f"pages={self.pages} expires_at={self.expires_at:.3f} {self.state.name}>"
        )


def check_pin_tier(tier: object) -> Tier:
    """``tier`` as ``Tier.DEVICE`` or ``Tier.HOST`` (``"device"``, ``"host"`` or the enum).

    Raises:
        InvalidTypeError: not a ``str`` or ``Tier``.
        InvalidInputError: another tier (storage is not pinned).
    """
    if isinstance(tier, Tier):
        if tier in (Tier.DEVICE, Tier.HOST):
            return tier
    elif isinstance(tier, str):
        tier = str.__str__(tier)  # the name itself: a str subclass's own hash is not asked
        found = _TIERS.get(tier)
        if found is not None:
            return found
    else:
        raise InvalidTypeError(f"tier must be 'device' or 'host', got {type(tier).__name__}")
    raise InvalidInputError(f"tier must be 'device' or 'host', got {tier!r}")


class HardPins:
    """The hard pins of one cache and their expiry timer (loop thread only)."""

    def __init__(self, tree: RadixTree, config: CacheConfig) -> None:
        self._tree = tree
        self._config = config
        self._live: dict[int, tuple[CachePin, Node]] = {}  # token -> (pin, its last node)
        self._heap: list[tuple[float, int]] = []  # (expires_at, token), lazily deleted
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the timer's, at the first pin
        self._timer_at = math.inf
        self._tokens = 0
        self._waits: dict[int, asyncio.Future[PinState]] = {}  # token -> end, if awaited
        self.counters = PinCounters()

    def __len__(self) -> int:
        return len(self._live)

    # ------------------------------------------------------------------ pin / unpin

    def check_ttl(self, ttl: object) -> float:
        """``ttl`` as seconds in ``(0, max_pin_ttl]``.

        Raises:
            InvalidInputError: not a finite number in that range (``bool`` refused).
        """
        return check_real("ttl", ttl, exclusive=True, maximum=self._config.max_pin_ttl)

    def limit(self, tier: Tier) -> int:
        """The most pages pins may hold in ``tier`` at once."""
        cfg = self._config
        pool = cfg.device_pages if tier is Tier.DEVICE else cfg.host_pages
        return int(pool * cfg.max_pinned_fraction)

    def pin(
        self,
        ns: Hashable,
        tokens: list[int],
        tier: Tier,
        ttl: float,
        loop: asyncio.AbstractEventLoop,
    ) -> CachePin:
        """Pin the leading run of ``tokens`` (whole pages) resident in ``tier`` for ``ttl``
        seconds (both checked by the caller); ``loop`` (the cache's) runs the expiry timer.

        Raises:
            NotCachedError: no page of the prefix is resident in ``tier`` (nothing changed).
            PinLimitError: the tier's pinned pages would exceed its cap (nothing changed).
        """
        tree = self._tree
        p = self._config.page_size
        n = len(tokens) // p * p
        cached = tree.peek(ns, tokens, n) if n else 0  # no root is created for a miss
        run = self._resident_run(ns, tokens, cached, tier) if cached else []
        length = sum(covered for _, covered in run)
        if length == 0:
            where = "device" if tier is Tier.DEVICE else "host"
            raise NotCachedError(
                f"pin: none of the {n} page-aligned tokens is resident on {where} "
                f"({cached} cached in any tier)"
            )
        pinned = self._pinned_nodes(tier)
        now = sum(len(node.key) for node in pinned.values()) // p
        more = sum(covered for node, covered in run if id(node) not in pinned) // p
        cap = self.limit(tier)
        if now + more > cap:
            where = tier.name.lower()
            raise PinLimitError(
                f"pin of {length // p} {where} pages ({more} not pinned yet) would make "
                f"{now + more} pinned {where} pages, over the cap of {cap} "
                f"(max_pinned_fraction={self._config.max_pinned_fraction} of the pool); "
                f"{now} pinned now"
            )
        node, matched = tree.match(ns, tokens, length)  # splits where the run ends mid-node
        assert matched == length, f"pin: matched {matched} of the resident run {length}"
        if tier is Tier.DEVICE:
            tree.pin(node)
        else:
            tree.pin_host(node)
        self._loop = loop
        self._tokens += 1
        pin = CachePin(self, self._tokens, tier, length, length // p, loop.time() + ttl)
        self._live[pin.token] = (pin, node)
        heapq.heappush(self._heap, (pin.expires_at, pin.token))
        self.counters.pins_created += 1
        self._arm(loop)
        log.debug("pin", tier=tier.name, tokens=length, ttl=ttl, token=pin.token)
        return pin

    def unpin(self, pin: object) -> bool:
        """End ``pin`` now; ``False`` if it had already expired (nothing to do).

        Raises:
            InvalidTypeError: not a ``CachePin``.
            HandleError: a pin of another cache, or one released already.
        """
        if not isinstance(pin, CachePin):
            raise InvalidTypeError(f"expected a CachePin, got {type(pin).__name__}")
        if pin.issuer is not self:
            raise HandleError("pin belongs to another cache")
        if pin.state is PinState.EXPIRED:
            return False
        if pin.state is PinState.RELEASED:
            raise HandleError("pin already released")
        self._end(pin.token, PinState.RELEASED)
        self._compact()
        if self._loop is not None:
            self._arm(self._loop)  # the earliest deadline may have gone with it
        return True

    def _end(self, token: int, state: PinState) -> None:
        pin, node = self._live.pop(token)
        if pin.tier is Tier.DEVICE:
            self._tree.unpin(node)
        else:
            self._tree.unpin_host(node)
        if state is PinState.EXPIRED:
            self.counters.pins_expired += 1
        else:
            self.counters.pins_released += 1
        pin.state = state
        fut = self._waits.pop(token, None)
        if fut is not None and not fut.done():
            fut.set_result(state)

    def ended(self, pin: CachePin) -> asyncio.Future[PinState]:
        """A future of this table's live ``pin`` that resolves when it ends."""
        fut = self._waits.get(pin.token)
        if fut is None:
            fut = self._waits[pin.token] = asyncio.get_running_loop().create_future()
        return fut

    # ------------------------------------------------------------------ expiry

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        """One timer for the earliest live deadline (none when no pin is live)."""
        heap = self._heap
        while heap and heap[0][1] not in self._live:
            heapq.heappop(heap)
        at = heap[0][0] if heap else math.inf
        if at == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = at
        if heap:
            self._timer = loop.call_at(at, self._fire, loop)

    def _fire(self, loop: asyncio.AbstractEventLoop) -> None:
        """The earliest deadline came: expire every pin due, then re-arm."""
        self._timer = None
        self._timer_at = math.inf
        now = loop.time()
        heap = self._heap
        expired = 0
        while heap and heap[0][0] <= now:
            _, token = heapq.heappop(heap)
            if token in self._live:
                self._end(token, PinState.EXPIRED)
                expired += 1
        if expired:
            log.debug("pins_expired", count=expired, active=len(self._live))
        self._arm(loop)

    def _compact(self) -> None:
        """Drop the heap entries of released pins once they are most of it."""
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = [e for e in self._heap if e[1] in self._live]
            heapq.heapify(self._heap)

    def release_if(self, test: Callable[[Node], bool]) -> int:
        """End (as RELEASED) every live pin with a node on its path that passes ``test``;
        how many.  For a purge: the nodes it is about to remove must hold no pin."""
        doomed = []
        for token, (_, node) in self._live.items():
            while node.parent is not None and not test(node):
                node = node.parent
            if node.parent is not None:
                doomed.append(token)
        for token in doomed:
            self._end(token, PinState.RELEASED)
        if doomed and self._loop is not None:
            self._arm(self._loop)
        return len(doomed)

    def close(self) -> None:
        """The cache closes: cancel the timer and release every pin."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = math.inf
        for token in list(self._live):
            self._end(token, PinState.RELEASED)
        self._heap.clear()

    # ------------------------------------------------------------------ introspection

    def _resident_run(
        self, ns: Hashable, tokens: list[int], n: int, tier: Tier
    ) -> list[tuple[Node, int]]:
        """The nodes of the leading run of ``tokens[:n]`` resident in ``tier``, each with the
        tokens of it the run covers (the last may be covered in part); changes nothing."""
        p = self._config.page_size
        node = self._tree.root(ns)  # exists: the tree holds some of the tokens
        out: list[tuple[Node, int]] = []
        pos = 0
        while pos < n:
            child = node.children.get(tokens[pos] if p == 1 else tuple(tokens[pos : pos + p]))
            state = None if child is None else child.device if tier is Tier.DEVICE else child.host
            if child is None or state is not RESIDENT:
                break
            same = common_len(child.key, tokens, pos, n - pos)
            same -= same % p
            if same == 0:
                break
            out.append((child, same))
            pos += same
            if same < len(child.key):
                break
            node = child
        return out

    def _pinned_nodes(self, tier: Tier) -> dict[int, Node]:
        """Every node under a live pin of ``tier`` (each once), by ``id``."""
        out: dict[int, Node] = {}
        for pin, node in self._live.values():
            if pin.tier is not tier:
                continue
            while node.parent is not None and id(node) not in out:
                out[id(node)] = node
                node = node.parent
        return out

    def pinned_pages(self, tier: Tier) -> int:
        """Pages under any live pin of ``tier`` (each node counted once)."""
        return sum(len(n.key) for n in self._pinned_nodes(tier).values()) // self._config.page_size

    def nodes(self, tier: Tier) -> list[Node]:
        """The last node of every live pin of ``tier`` (one entry per pin)."""
        return [node for pin, node in self._live.values() if pin.tier is tier]

    def check_invariants(self) -> None:
        """Every live pin is ACTIVE on a node in the tree, has a heap entry no later than its
        deadline, the timer is armed for the earliest one, and the caps hold.

        Raises:
            AssertionError: naming the broken invariant.
        """
        for token, (pin, node) in self._live.items():
            assert pin.state is PinState.ACTIVE, f"live pin not active {pin!r}"
            assert pin.token == token and pin.issuer is self, f"pin filed wrongly {pin!r}"
            assert node.alive, f"a pin holds a removed node {pin!r} {node!r}"
        live = {token for _, token in self._heap if token in self._live}
        assert live == set(self._live), "a live pin has no expiry entry"
        if self._live:
            earliest = min(pin.expires_at for pin, _ in self._live.values())
            assert self._timer is not None and self._timer_at <= earliest, (
                f"expiry timer at {self._timer_at} after the earliest deadline {earliest}"
            )
        for tier in (Tier.DEVICE, Tier.HOST):
            pages, cap = self.pinned_pages(tier), self.limit(tier)
            assert pages <= cap, f"{pages} pinned {tier.name} pages over the cap {cap}"
