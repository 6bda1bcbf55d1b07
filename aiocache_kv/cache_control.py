"""Operator controls of :class:`~aiocache_kv.cache.HiCache`: what stays cached, for whom and
for how long (issue #26).

This module is the public face only: each method validates its input and delegates to the
module that owns the concern (``tree/retention.py`` and ``quotas.py``: retention priority and
per-tenant budgets; ``hardpins.py``: pins with expiry; ``warm.py``: warm-up; ``purge.py``:
drop with zeroization).  ``HiCache`` inherits it; the attributes below are the facade's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aiocache_kv.config import CacheConfig
    from aiocache_kv.core import CacheCore
    from aiocache_kv.namespace import Namespace
    from aiocache_kv.pins import HandleTable
    from aiocache_kv.storage.tier import StorageTier
    from aiocache_kv.transfer.ops import Transfers


class CacheControls:
    """Mixin of :class:`~aiocache_kv.cache.HiCache`: pins with expiry, warm-up, purge and
    per-tenant quotas.  Every method runs on the loop thread of a running cache."""

    # the facade's state (set by HiCache.__init__)
    config: CacheConfig
    _core: CacheCore
    _handles: HandleTable
    _l3: StorageTier | None
    _transfers: Transfers

    def _check(self) -> None:  # HiCache's: running, on the loop thread
        raise NotImplementedError

    def _ns(self, tenant: str | None, lora: str | None) -> Namespace:  # HiCache's
        raise NotImplementedError

    # ------------------------------------------------------------------ pins with expiry

    # ------------------------------------------------------------------ warm-up

    # ------------------------------------------------------------------ purge

    # ------------------------------------------------------------------ quotas


__all__ = ["CacheControls"]
