"""Per-tenant storage budgets of a :class:`~aiocache_kv.storage.file.FileStorage` (issue #26).

A storage key names its namespace tag (``"{tag}/{hash}/{component}"``), not its tenant: the
tag is a digest of (model, tenant, LoRA).  So the cache's storage tier tells the store which
tenant a tag belongs to (:meth:`FileQuotas.tag_tenant`, for every namespace it writes) and
what each tenant may hold (:meth:`FileQuotas.set_storage_quotas`: a default and per-tenant
budgets, in stored pages: files, one per page and component).  The index counts pages per tag
whoever wrote them (a previous run's, another node's: the tag comes from each file's header),
so a tenant's count is the sum over its tags.  After each group a put stores, a tenant over
its budget loses its least recently used pages (chain ends first among the oldest), reported
by ``take_evicted`` like capacity evictions.  Both calls only record (no I/O, no lock: safe on
the event loop); the budget is enforced at the next put.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from types import MappingProxyType
from typing import Protocol, runtime_checkable

from aiocache_kv.errors import InvalidInputError, InvalidTypeError
from aiocache_kv.storage.page_index import PageIndex

__all__ = ["FileQuotas", "TenantQuotaStorage", "tag_of_key"]

_NO_BUDGETS: Mapping[str, int | None] = MappingProxyType({})
_NO_TAGS: Mapping[str, str] = MappingProxyType({})


def tag_of_key(key: str) -> str:
    """The namespace tag of a storage key (what comes before the first ``/``)."""
    return key.split("/", 1)[0]


class FileQuotas:
    """Per-tenant budgets of a ``FileStorage`` (its base; the index and lock are set there)."""

    _lock: threading.Lock
    _index: PageIndex
    _deleting: set[str]
    # replaced whole, never mutated in place: a worker reads a consistent table without a lock
    _tag_tenant: Mapping[str, str] = _NO_TAGS
    _default_budget: int | None = None
    _budgets: Mapping[str, int | None] = _NO_BUDGETS

    def tag_tenant(self, tag: str, tenant: str) -> None:
        """Pages whose key has ``tag`` are ``tenant``'s (its budget counts them).

        Raises:
            InvalidTypeError: ``tag`` or ``tenant`` is not a ``str``.
        """
        if type(tag) is not str or type(tenant) is not str:
            raise InvalidTypeError(f"tag and tenant must be str, got {tag!r}, {tenant!r}")
        if self._tag_tenant.get(tag) != tenant:
            self._tag_tenant = MappingProxyType({**self._tag_tenant, tag: tenant})

    def set_storage_quotas(self, default: int | None, per_tenant: Mapping[str, int | None]) -> None:
        """Every tenant may keep ``per_tenant[tenant]`` pages (files), else ``default``
        (``None``: unlimited).  Enforced at the next put.

        Raises:
            InvalidTypeError / InvalidInputError: a budget that is not ``None`` or an int >= 0,
                or a tenant that is not a ``str`` (nothing changed).
        """
        budgets = dict(per_tenant)
        for tenant, pages in [("<default>", default), *budgets.items()]:
            if type(tenant) is not str:
                raise InvalidTypeError(f"storage quota tenants must be str, got {tenant!r}")
            if pages is not None and (type(pages) is not int or pages < 0):
                raise InvalidInputError(
                    f"storage quota of {tenant!r} must be None or an int >= 0, got {pages!r}"
                )
        self._default_budget = default
        self._budgets = MappingProxyType(budgets)

    def tenant_pages(self, tenant: str) -> int:
        """Pages (files) of ``tenant``'s known tags stored now."""
        tags = [t for t, who in self._tag_tenant.items() if who == tenant]
        with self._lock:
            return sum(self._index.tag_pages(t) for t in tags)

    def _quota_victims_locked(self) -> list[str]:
        """Pages to evict so that every tenant fits its budget (under the index lock)."""
        default, budgets = self._default_budget, self._budgets
        if default is None and not budgets:
            return []
        tags_of: dict[str, list[str]] = {}
        for tag, tenant in self._tag_tenant.items():
            tags_of.setdefault(tenant, []).append(tag)
        victims: list[str] = []
        for tenant, tags in tags_of.items():
            limit = budgets.get(tenant, default)
            if limit is not None:
                victims += self._index.pick_tag_victims(tags, limit)
        return victims


@runtime_checkable
class TenantQuotaStorage(Protocol):
    """A backend that enforces per-tenant storage budgets (``FileStorage``; Mooncake's master
    owns its eviction, so there they are advisory)."""

    def tag_tenant(self, tag: str, tenant: str) -> None:
        """Pages whose key has ``tag`` are ``tenant``'s."""
        ...

    def set_storage_quotas(self, default: int | None, per_tenant: Mapping[str, int | None]) -> None:
        """The budgets, in stored pages: per tenant, else ``default`` (``None``: unlimited)."""
        ...
