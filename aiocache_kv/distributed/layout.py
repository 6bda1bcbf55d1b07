"""What tensor-parallel ranks must have in common, checked once when the cache starts.

Every rank of a TP group runs the same tree decisions (evictions, write-through, prefetch
commits), agreed through collectives whose vectors have one layout on every rank.  Ranks
configured differently (one with a storage tier, one without; other pool sizes) would issue
vectors of different lengths: gloo then answers garbage on the shorter rank and fails only at
its timeout, or the trees silently diverge.  So the first collective of a start compares the
settings below, field by field, and a difference is a ``ConfigError`` on every rank, naming
the fields and this rank's values.

Settings that may differ per rank are left out: the device, the KV heads and head size of a
rank's shard, dtypes, the storage object (each rank has its own), worker threads and
timeouts (local outcomes are agreed anyway).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aiocache_kv.config import CacheConfig

__all__ = ["digest", "tp_layout"]


def _plain(value: object) -> object:
    return getattr(value, "value", value)  # an enum member as its value: "wt" == WT


def tp_layout(config: CacheConfig) -> dict[str, str]:
    """The settings every rank must share, each as text."""
    quotas = sorted((str(k), repr(v)) for k, v in config.tenant_quotas.items())
    fields: dict[str, object] = {
        "page_size": config.page_size,
        "num_layers": config.num_layers,
        "device_pages": config.device_pages,
        "host_pages": config.host_pages,
        "write_policy": _plain(config.write_policy),
        "write_through_threshold": config.write_through_threshold,
        "prefetch_policy": _plain(config.prefetch_policy),
        "prefetch_threshold_tokens": config.prefetch_threshold_tokens,
        "prefetch_batch_pages": config.prefetch_batch_pages,
        "storage": config.storage is not None,
        "namespace": config.namespace,
        "enable_kv_events": config.enable_kv_events,
        "components": [(c.name, type(c).__name__) for c in config.components],
        "tenant_quotas": quotas,
        "default_tenant_quota": repr(config.default_tenant_quota),
    }
    return {name: repr(value) for name, value in fields.items()}


def digest(text: str) -> int:
    """A 62-bit digest of ``text`` (its negation fits an int64 too)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 2
