"""Operator controls of :class:`~aiocache_kv.cache.HiCache`: what stays cached, for whom and
for how long (issue #26).

This module is the public face only: each method validates its input and delegates to the
module that owns the concern (``tree/retention.py`` and ``quotas.py``: retention priority and
per-tenant budgets; ``hardpins.py``: pins with expiry; ``warm.py``: warm-up; ``purge.py``:
drop with zeroization).  ``HiCache`` inherits it; the attributes below are the facade's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from aiocache_kv.errors import InvalidInputError, InvalidTypeError
from aiocache_kv.hardpins import CachePin, check_pin_tier
from aiocache_kv.lifecycle import Lifecycle
from aiocache_kv.namespace import Namespace
from aiocache_kv.numeric import check_real
from aiocache_kv.purge import DropResult, Purger, check_drop_tiers
from aiocache_kv.quotas import TenantQuota, check_quota, check_tenant
from aiocache_kv.tree import Node, Tier
from aiocache_kv.validate import check_names, check_tokens
from aiocache_kv.warm import LoadBack, Release, State, WarmResult, check_alive, warm

if TYPE_CHECKING:
    from aiocache_kv.config import CacheConfig
    from aiocache_kv.core import CacheCore
    from aiocache_kv.handles import InsertResult, MatchResult
    from aiocache_kv.pins import HandleTable
    from aiocache_kv.storage.tier import StorageTier
    from aiocache_kv.transfer.ops import Transfers


class CacheControls:
    """Mixin of :class:`~aiocache_kv.cache.HiCache`: pins with expiry, warm-up, purge and
    per-tenant quotas.  Every method runs on the loop thread of a running cache."""

    # the facade's state (set by HiCache.__init__)
    config: CacheConfig
    _state: Lifecycle
    _core: CacheCore
    _handles: HandleTable
    _l3: StorageTier | None
    _transfers: Transfers

    def _check(self) -> None:  # HiCache's: running, on the loop thread
        raise NotImplementedError

    def _ns(self, tenant: str | None, lora: str | None) -> Namespace:  # HiCache's
        raise NotImplementedError

    if TYPE_CHECKING:  # HiCache's

        async def load_back(
            self, m: MatchResult, *, timeout: float | None = None
        ) -> MatchResult: ...

        def release(self, handle: MatchResult | InsertResult) -> None: ...

    # ------------------------------------------------------------------ pins with expiry

    def pin(
        self,
        tokens: Sequence[int] | torch.Tensor,
        *,
        ttl: float,
        tier: str | Tier = "device",
        tenant: str | None = None,
        lora: str | None = None,
    ) -> CachePin:
        """Keep the cached prefix of ``tokens`` that is resident in ``tier`` now resident
        there until :meth:`unpin` or ``ttl`` seconds pass (see ``hardpins.py``).

        ``tier="device"``: the leading device-resident pages stay on device (and their host
        copies in host memory).  ``tier="host"``: the leading host-resident pages stay in
        host memory; their device copies may still be evicted.  The pages under pins of a
        tier are capped at ``config.max_pinned_fraction`` of its pool.

        Raises:
            InvalidTypeError / InvalidInputError: bad tokens, names or tier (storage is not
                pinned); ``ttl`` not a finite number in ``(0, config.max_pin_ttl]``; a pin
                with tensor parallelism (a deadline is one rank's clock).
            NotCachedError: no page of the prefix is resident in ``tier``.
            PinLimitError: the tier's pinned pages would exceed the cap.
            CacheClosedError: the cache is not running.
            (Nothing changed on any error.)
        """
        self._check()
        toks = check_tokens(tokens)
        ns = self._ns(tenant, lora)
        where = check_pin_tier(tier)
        hard = self._core.hard_pins
        seconds = hard.check_ttl(ttl)
        if self._core.coordinator.deferred:
            raise InvalidInputError(
                "pins with expiry are refused with tensor parallelism (a deadline is one "
                "rank's clock; ranks that expired differently would hold different trees)"
            )
        loop = self._core.loop
        assert loop is not None, "a running cache has a loop"
        return hard.pin(ns, toks, where, seconds, loop)

    def unpin(self, pin: CachePin) -> bool:
        """End ``pin`` now: its pages are evictable again (unless something else holds them).

        Returns ``False`` if it had already expired (nothing to do), ``True`` otherwise.

        Raises:
            InvalidTypeError: not a ``CachePin``.
            HandleError: a pin of another cache, or one already released.
            CacheClosedError: the cache is not running (closing released every pin).
        """
        self._check()
        return self._core.hard_pins.unpin(pin)

    # ------------------------------------------------------------------ warm-up

    async def warm(
        self,
        tokens: Sequence[int] | torch.Tensor,
        *,
        tier: str | Tier = "device",
        tenant: str | None = None,
        lora: str | None = None,
        timeout: float | None = None,
    ) -> WarmResult:
        """Bring the prefix of ``tokens`` from storage to host and, with ``tier="device"``,
        on to device, as one bounded operation (see ``warm.py``); returns what is where.

        ``timeout`` (seconds, finite, >= 0) bounds the whole call; ``None``: each step's own
        deadline does (the storage deadline; a load-back that finds no device room stops at
        once).  Cut short or cancelled, it leaks nothing: what arrived is committed, the
        copies it started land in the tree, and it holds no pin afterwards.  The result's
        ``error`` says why it stopped short otherwise (the storage failed, no host room for
        what storage holds, no device room).

        Raises:
            InvalidTypeError / InvalidInputError: bad tokens, names, tier or ``timeout``, or
                a ``timeout`` with tensor parallelism (nothing changed).
            CacheClosedError: the cache is not running, or it closed meanwhile (checked
                after every wait; raised once the warm-up holds nothing: no pin, no handle,
                no reserved host page).
        """
        self._check()
        toks = list(check_tokens(tokens))  # a copy: the caller's list may change meanwhile
        ns, where, seconds = self._warm_args(tenant, lora, tier, timeout, "timeout")
        return await warm(*self._warm_parts(), ns, toks, where, seconds)

    async def warm_from(
        self,
        prompts: Iterable[Sequence[int]],
        *,
        tier: str | Tier = "device",
        tenant: str | None = None,
        lora: str | None = None,
        timeout_each: float | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> list[WarmResult]:
        """Warm each of ``prompts`` in turn (e.g. a node's known system prompts at start):
        :meth:`warm` with ``timeout=timeout_each``, then ``progress(done, total)``.  Every
        prompt is checked before the first is warmed.  A cache that closes meanwhile ends
        it: no later prompt is warmed and ``progress`` is not called again.

        Raises:
            InvalidTypeError / InvalidInputError: as :meth:`warm` (naming the prompt's index),
                or ``progress`` not callable (nothing changed).
            CacheClosedError: the cache is not running, or it closed meanwhile (as
                :meth:`warm`; the warm-ups before it are kept in the tree).
            Whatever ``progress`` raises (the warm-ups before it are kept).
        """
        self._check()
        ns, where, seconds = self._warm_args(tenant, lora, tier, timeout_each, "timeout_each")
        if progress is not None and not callable(progress):
            raise InvalidTypeError(f"progress must be callable, got {type(progress).__name__}")
        given: object = prompts  # checked: a caller may pass anything
        if isinstance(given, (str, bytes)) or not isinstance(given, Iterable):
            raise InvalidTypeError(f"prompts must be token lists, got {type(given).__name__}")
        lists: list[list[int]] = []
        for i, prompt in enumerate(given):
            try:
                lists.append(list(check_tokens(prompt)))
            except (InvalidTypeError, InvalidInputError) as exc:
                raise type(exc)(f"prompts[{i}]: {exc}") from None
        out: list[WarmResult] = []
        parts = self._warm_parts()
        for toks in lists:
            check_alive(self._lifecycle)  # (``progress`` may have started a close)
            out.append(await warm(*parts, ns, toks, where, seconds))
            if progress is not None:
                check_alive(self._lifecycle)
                progress(len(out), len(lists))
        return out

    def _warm_parts(
        self,
    ) -> tuple[CacheCore, HandleTable, StorageTier | None, LoadBack, Release, State]:
        """The facade's parts a warm-up uses (``warm.warm``'s leading arguments)."""
        return self._core, self._handles, self._l3, self._load, self.release, self._lifecycle

    def _lifecycle(self) -> Lifecycle:
        """The cache's lifecycle now (a warm-up checks it after every wait)."""
        return self._state

    def _warm_args(
        self, tenant: str | None, lora: str | None, tier: object, timeout: object, name: str
    ) -> tuple[Namespace, Tier, float | None]:
        ns = self._ns(tenant, lora)
        where = check_pin_tier(tier)
        seconds = None if timeout is None else check_real(name, timeout)
        if seconds is not None and self._core.coordinator.deferred:
            raise InvalidInputError(f"{name} is refused with tensor parallelism")
        return ns, where, seconds

    async def _load(self, m: MatchResult, timeout: float | None) -> MatchResult:
        return await self.load_back(m, timeout=timeout)

    # ------------------------------------------------------------------ purge

    _purger: Purger | None = None  # made on the first drop

    async def drop(
        self,
        tokens: Sequence[int] | torch.Tensor | None = None,
        *,
        tenant: str | None = None,
        lora: str | None = None,
        tiers: Iterable[str | Tier] = ("device", "host", "storage"),
        zeroize: bool = False,
        timeout: float | None = None,
    ) -> DropResult:
        """Remove cached pages from ``tiers`` (see ``purge.py``): with ``tokens``, the page
        holding the prompt's last whole page and every cached page continuing it; without,
        everything of the tenant (``None``: the default tenant) and adapter (``lora=None``:
        every adapter of the tenant this cache knows, and its base namespace).  Nothing
        dropped can be matched again; pages in use are freed when their users are done.
        Storage loses the keys (for a tenant: every key of its namespaces, any node's).
        ``zeroize``: freed device and host pages are overwritten with zeros before reuse.
        ``timeout`` (default ``storage_timeout``) bounds the storage calls and the wait for
        the zeroing.  ``tiers``: any iterable of names or ``Tier``s (a generator, dict keys,
        ...), read once.

        Raises:
            InvalidTypeError: ``tokens``, ``tenant``, ``lora`` or ``zeroize`` of the wrong
                type; ``tiers`` a ``str``/``bytes`` or not iterable, or an item of it neither
                a ``str`` nor a ``Tier`` (named).
            InvalidInputError: tokens shorter than a page or out of range, an unknown tier,
                ``"device"`` without ``"host"`` (or the reverse), no tier, a ``timeout`` not
                finite and >= 0, or tensor parallelism (nothing changed).
            DropIncompleteError: device and host were dropped but removing from storage
                failed or timed out (``exc.result`` says what was done).
            CacheClosedError / OwnershipError: not running, or not on the loop thread.
        """
        self._check()
        # a copy: the caller's list may change while the drop waits for storage
        toks = None if tokens is None else list(check_tokens(tokens))
        p = self.config.page_size
        if toks is not None and len(toks) < p:
            raise InvalidInputError(f"drop: tokens must hold a whole page ({p}), got {len(toks)}")
        names = check_names(tenant, lora)
        where = check_drop_tiers(tiers)
        if type(zeroize) is not bool:
            raise InvalidTypeError(f"zeroize must be a bool, got {type(zeroize).__name__}")
        seconds = self.config.storage_timeout if timeout is None else check_real("timeout", timeout)
        if self._core.coordinator.deferred:
            raise InvalidInputError("drop is refused with tensor parallelism")
        namespaces = [self._ns(*names)]
        if lora is None:  # every adapter of the tenant the tree knows
            key = (self.config.namespace, names[0])
            for root in self._core.tree.roots():
                ns = root.ns
                if isinstance(ns, Namespace) and ns.lora and (ns.model, ns.tenant) == key:
                    namespaces.append(ns)
        if self._purger is None:
            self._purger = Purger(self._core, lambda: self._l3)
        memory = Tier.DEVICE in where
        return await self._purger.drop(
            namespaces,
            toks,
            memory=memory,
            storage=Tier.STORAGE in where,
            zeroize=zeroize and memory,
            timeout=seconds,
        )

    def _rotten(self, node: Node, at: int) -> None:
        """A load-back's deferred verification failed at page ``at`` of ``node`` (on the
        loop): drop it from there on (``Purger.drop_corrupt``)."""
        if self._purger is None:
            self._purger = Purger(self._core, lambda: self._l3)
        self._purger.drop_corrupt(node, at, self.config.storage_timeout)

    # ------------------------------------------------------------------ quotas

    def set_tenant_quota(self, tenant: str, quota: TenantQuota | None) -> None:
        """Give ``tenant`` its own page budgets (``None``: the config's default applies
        again).  Takes effect at once: a tenant now over a budget has its own evictable pages
        evicted down to it (least recently used, lowest priority first).  Pinned and
        in-flight pages cannot go, so a budget is best effort against them; the storage
        budget is enforced by ``FileStorage`` and advisory for Mooncake.

        Raises:
            InvalidTypeError: ``tenant`` is not a ``str`` or ``quota`` not a ``TenantQuota``
                or ``None`` (nothing changed).
            CacheClosedError: the cache is not running.
        """
        self._check()
        tenant = check_tenant(tenant)
        quota = check_quota(quota)
        book = self._core.quota_book()
        book.set_quota(tenant, quota)
        self._core.enforce_quotas()
        if self._l3 is not None:
            self._l3.apply_storage_quotas(book)

    def tenant_quota(self, tenant: str) -> TenantQuota | None:
        """The budgets that apply to ``tenant`` (its own, else the default; ``None``: none).

        Raises:
            InvalidTypeError: ``tenant`` is not a ``str``.
            CacheClosedError: the cache is not running.
        """
        self._check()
        tenant = check_tenant(tenant)
        book = self._core.tree.tenants
        if book is None:
            return self.config.tenant_quotas.get(tenant, self.config.default_tenant_quota)
        return book.quota(tenant)

    def tenant_usage(self, tenant: str) -> dict[str, int]:
        """Pages ``tenant`` holds now per tier: ``{"device": n, "host": n}`` (a page on
        device and host counts in both; with quotas configured read from the ledger, else
        counted from the tree).

        Raises:
            InvalidTypeError: ``tenant`` is not a ``str``.
            CacheClosedError: the cache is not running.
        """
        self._check()
        tenant = check_tenant(tenant)
        book = self._core.tree.tenants
        if book is not None:
            return book.pages(tenant)
        dev, host = self._core.tree.tenant_pages().get(tenant, [0, 0])
        return {"device": dev, "host": host}

    # ------------------------------------------------------------------ scheduler probes

    def copies_in_flight(self) -> int:
        """Device <-> host copies in flight now: ``statistics().ops_in_flight`` without the
        snapshot (~0.1 us instead of ~100 us), for a scheduler that asks on every step whether
        waiting can free device pages (a landing write-through makes its pages evictable).

        Raises:
            CacheClosedError: the cache is not running.
        """
        self._check()
        return len(self._transfers.inflight)

    def device_pages_returning(self) -> int:
        """Device pages freed while a worker still holds them (a drop's zeroing, a copy still
        reading them): each becomes free when its worker lets go, so a scheduler that cannot
        allocate now may wait for them rather than give up (cheap, as
        :meth:`copies_in_flight`).

        Raises:
            CacheClosedError: the cache is not running.
        """
        self._check()
        alloc = self._core.dev_alloc
        return 0 if alloc is None else alloc.quarantined


__all__ = ["CacheControls"]
