"""What a prefetch reports: :class:`PrefetchStatus`, :class:`PrefetchResult`, and the
deadline of a ``timeout``-policy prefetch (:func:`prefetch_timeout`).

The prefetch path itself is :mod:`aiocache_kv.storage.prefetch` (which re-exports these).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["PrefetchResult", "PrefetchStatus", "prefetch_timeout"]


class PrefetchStatus(enum.Enum):
    """How a prefetch ended."""

    NO_STORAGE = "no_storage"  #: the cache has no storage tier
    BELOW_THRESHOLD = "below_threshold"  #: too few uncached tokens to be worth it
    MISS = "miss"  #: storage has none of the next pages
    COMPLETE = "complete"  #: every page storage reported was loaded and committed
    PARTIAL = "partial"  #: deadline or a bad page cut it short; the leading run was committed
    BACKGROUND = "background"  #: best effort: loading continues, commits when it lands
    FAILED = "failed"  #: storage unreachable or failing; nothing committed


@dataclass(frozen=True, slots=True)
class PrefetchResult:
    """What a prefetch found and committed."""

    status: PrefetchStatus
    cached_tokens: int  #: tokens already in L1/L2 before the prefetch
    storage_hit_tokens: int  #: tokens after those that storage reported present
    hit_tokens: int  #: tokens loaded from storage and committed to the host tier
    error: str | None = None

    @property
    def usable_tokens(self) -> int:
        """Tokens now matchable from device or host (cached + committed)."""
        return self.cached_tokens + self.hit_tokens


def prefetch_timeout(tokens: int, base: float, per_1k: float, cap: float) -> float:
    """Deadline of a ``timeout``-policy prefetch: base + per-1k-tokens, capped."""
    return min(cap, base + per_1k * tokens / 1000.0)
