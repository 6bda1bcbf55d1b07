"""Per-tenant page budgets: a tenant over its budget evicts its own pages first (issue #26).

A :class:`TenantQuota` bounds a tenant's pages per tier (device, host, storage; ``None``:
unlimited).  ``CacheConfig.tenant_quotas`` maps tenants to their own quota and
``CacheConfig.default_tenant_quota`` applies to every other tenant (the default tenant is
``""``); :meth:`HiCache.set_tenant_quota` changes one at run time.

:class:`QuotaBook` is the loop-owned ledger the tree keeps once any quota is configured (none
at all: no book, nothing is counted): pages per tenant per tier, maintained where the tree
accounts pages per tier (``TierBook._acct``), and the set of tenants over their budget per
tier.  The victim heaps then keep one heap per tenant beside the tier's
(:class:`~aiocache_kv.tree.lru.TenantVictims`), so

1. when a tenant goes over its budget (an insert, a load-back, a prefetch or write-through
   landing, a quota lowered), the cache evicts that tenant's own least recently used
   evictable pages down to the budget (device victims with a host copy are demoted, host
   victims deleted), O(log n) per victim; and
2. when a pool is short, victims are taken from over-budget tenants before anyone else's.

So one tenant's burst cannot flush another's working set.  Budgets are best effort against
pages that cannot be evicted: pinned pages (live handles), pages in flight, and host copies of
pages still on device (host victims are host-only leaves) stay until they can go.

Storage budgets are enforced by :class:`~aiocache_kv.storage.file.FileStorage` (it evicts the
tenant's oldest files); for Mooncake they are advisory (its master owns eviction).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass

from aiocache_kv.errors import InvalidInputError, InvalidTypeError

#: tier indices of :attr:`QuotaBook.usage` and :attr:`QuotaBook.over`
DEVICE = 0
HOST = 1
TIER_NAMES = ("device", "host")


@dataclass(frozen=True)
class TenantQuota:
    """Page budgets of one tenant per tier; ``None`` is unlimited.

    Raises:
        InvalidInputError: a budget is not ``None`` or an int >= 0 (``bool`` refused).
    """

    device_pages: int | None = None
    host_pages: int | None = None
    storage_pages: int | None = None

    def __post_init__(self) -> None:
        for name in ("device_pages", "host_pages", "storage_pages"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 0):
                raise InvalidInputError(
                    f"TenantQuota.{name} must be None or an int >= 0, got {value!r}"
                )

    def limit(self, tier: int) -> int | None:
        """The budget of tier ``DEVICE`` or ``HOST``."""
        return self.device_pages if tier == DEVICE else self.host_pages


def check_tenant(tenant: object) -> str:
    """``tenant`` if it is a ``str``.

    Raises:
        InvalidTypeError: naming the value.
    """
    if type(tenant) is not str:
        raise InvalidTypeError(f"tenant must be a str, got {type(tenant).__name__} {tenant!r}")
    return tenant


def check_quota(quota: object, name: str = "quota") -> TenantQuota | None:
    """``quota`` if it is a :class:`TenantQuota` or ``None``.

    Raises:
        InvalidTypeError: naming the value.
    """
    if quota is not None and not isinstance(quota, TenantQuota):
        raise InvalidTypeError(
            f"{name} must be a TenantQuota or None, got {type(quota).__name__} {quota!r}"
        )
    return quota


def tenant_of(ns: Hashable) -> str:
    """The tenant of a namespace (a tree's namespace that is not a ``Namespace``: ``""``)."""
    tenant = getattr(ns, "tenant", "")
    return tenant if type(tenant) is str else ""


#: per-tenant eviction counts kept by name (metric series) before idle tenants are folded
MAX_NAMED_EVICTIONS = 1024


class QuotaBook:
    """Budgets and pages per tenant per tier (device, host) of one tree (loop-owned).

    ``on_over()`` runs (it should only schedule work) whenever a tenant goes over a budget.
    """

    def __init__(self, default: TenantQuota | None, overrides: Mapping[str, TenantQuota]) -> None:
        self.default = default
        self.overrides: dict[str, TenantQuota] = dict(overrides)
        #: tenant -> [device pages, host pages] (tenants with no page are left out)
        self.usage: dict[str, list[int]] = {}
        #: per tier: the tenants over their budget there
        self.over: tuple[set[str], set[str]] = (set(), set())
        #: pages evicted to bring a tenant down to its budget, per tenant (at most about
        #: :data:`MAX_NAMED_EVICTIONS` names: see :meth:`count_evicted`)
        self.evictions: dict[str, int] = {}
        #: those of tenants folded out of :attr:`evictions` (no page, no quota of their own)
        self.evictions_folded = 0
        self._fold_at = MAX_NAMED_EVICTIONS  # names past which the next fold pass runs
        self.on_over: Callable[[], None] | None = None

    def quota(self, tenant: str) -> TenantQuota | None:
        """The quota that applies to ``tenant`` (its own, else the default)."""
        return self.overrides.get(tenant, self.default)

    def set_quota(self, tenant: str, quota: TenantQuota | None) -> None:
        """Give ``tenant`` its own quota (``None``: the default applies again)."""
        if quota is None:
            self.overrides.pop(tenant, None)
        else:
            self.overrides[tenant] = quota
        self._update(tenant, self.usage.get(tenant, [0, 0]))

    def add(self, tenant: str, device: int, host: int) -> None:
        """``tenant`` gained (or lost, negative) pages on device and host."""
        u = self.usage.get(tenant)
        if u is None:
            u = self.usage[tenant] = [0, 0]
        u[0] += device
        u[1] += host
        if not (u[0] or u[1]):
            del self.usage[tenant]
        self._update(tenant, u)

    def _update(self, tenant: str, u: list[int]) -> None:
        q = self.quota(tenant)
        newly = False
        for tier in (DEVICE, HOST):
            limit = None if q is None else q.limit(tier)
            over = self.over[tier]
            if limit is not None and u[tier] > limit:
                if tenant not in over:
                    over.add(tenant)
                    newly = True
            else:
                over.discard(tenant)
        if newly and self.on_over is not None:
            self.on_over()

    def excess(self, tenant: str, tier: int) -> int:
        """Pages ``tenant`` holds in ``tier`` beyond its budget (0 when within)."""
        q = self.quota(tenant)
        limit = None if q is None else q.limit(tier)
        if limit is None:
            return 0
        return max(0, self.usage.get(tenant, [0, 0])[tier] - limit)

    def pages(self, tenant: str) -> dict[str, int]:
        """``{"device": n, "host": n}`` pages of ``tenant``."""
        u = self.usage.get(tenant, [0, 0])
        return {"device": u[DEVICE], "host": u[HOST]}

    def count_evicted(self, tenant: str, pages: int) -> None:
        """``pages`` of ``tenant`` were evicted to bring it down to its budget.

        Tenant names come from requests, so the per-name counts are bounded: past
        :data:`MAX_NAMED_EVICTIONS` names, the counts of every tenant that holds no page
        and has no quota of its own move to :attr:`evictions_folded` (one pass; the next
        runs once the names left have doubled, so the passes cost O(1) a call even when
        most names cannot be folded); the sum of both never decreases."""
        if not pages:
            return
        self.evictions[tenant] = self.evictions.get(tenant, 0) + pages
        if len(self.evictions) > self._fold_at:
            idle = [t for t in self.evictions if t not in self.usage and t not in self.overrides]
            for t in idle:
                self.evictions_folded += self.evictions.pop(t)
            self._fold_at = max(MAX_NAMED_EVICTIONS, 2 * len(self.evictions))

    def check(self, recount: Mapping[str, list[int]]) -> None:
        """The ledger equals ``recount`` (tenant -> pages per tier, from the tree) and the
        over-budget sets match it.

        Raises:
            AssertionError: naming the tenant.
        """
        want = {t: u for t, u in recount.items() if u[0] or u[1]}
        assert self.usage == want, f"tenant pages {self.usage} != recomputed {want}"
        for tier in (DEVICE, HOST):
            over = {t for t in want if self.excess(t, tier) > 0}
            assert self.over[tier] == over, (
                f"{TIER_NAMES[tier]} over-budget tenants {self.over[tier]} != {over}"
            )


__all__ = ["QuotaBook", "TenantQuota", "check_quota", "check_tenant", "tenant_of"]
