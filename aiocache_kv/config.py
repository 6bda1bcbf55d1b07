"""Cache configuration: one frozen, validated dataclass."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from aiocache_kv.errors import ConfigError
from aiocache_kv.numeric import MAX_THREADS, check_real, shown
from aiocache_kv.quotas import TenantQuota


class WritePolicy(str, enum.Enum):
    """When device pages are backed up to host."""

    WRITE_THROUGH = "write_through"  #: on insert
    WRITE_THROUGH_SELECTIVE = "write_through_selective"  #: on the N-th hit (default 2nd)
    WRITE_BACK = "write_back"  #: when evicted from device


class PrefetchPolicy(str, enum.Enum):
    """How long ``prefetch`` waits for storage."""

    BEST_EFFORT = "best_effort"
    WAIT_COMPLETE = "wait_complete"
    TIMEOUT = "timeout"


GiB = 1 << 30


@dataclass(frozen=True)
class CacheConfig:
    """Shape of the KV, sizes of the tiers and policies.

    Every number must be finite and in range (an int where it counts something; ``bool`` is
    not a number), so nothing a config holds can become a NaN or infinite deadline.

    Raises:
        ConfigError: on any inconsistent value (the message names it).
    """

    page_size: int = 16
    num_layers: int = 1
    num_kv_heads: int = 1
    head_dim: int = 64
    dtype: torch.dtype = torch.float16
    device: str | torch.device = "cpu"
    device_pages: int = 1024
    host_pages: int = 4096
    write_policy: WritePolicy | str = WritePolicy.WRITE_THROUGH
    write_through_threshold: int = 2
    prefetch_policy: PrefetchPolicy | str = PrefetchPolicy.TIMEOUT
    storage: Any = None
    namespace: str = "default"
    enable_kv_events: bool = True
    host_memory_reserve_bytes: int = 10 * GiB
    components: tuple[Any, ...] = field(default_factory=tuple)
    #: CPU copy worker: torch intra-op threads, at most ``MAX_THREADS`` (1024) (None: torch's
    #: default; 1 favours loop latency)
    copy_threads: int | None = None
    #: background workers (the CPU copy worker): nice increment over the loop's thread, so
    #: the loop wins a contended core (Linux; 0 leaves their priority alone)
    worker_nice: int = 10
    #: the CPU copy worker's page copies on idle helpers (Linux; C threads under
    #: ``SCHED_IDLE`` that never hold the GIL): they take a core only when no other thread
    #: wants one, so the loop always preempts them; where they starve (every core busy with
    #: other work) the worker, at ``worker_nice``, relieves them (:mod:`aiocache_kv.priority`)
    worker_idle: bool = True
    #: storage tier: worker threads, per-call deadline (s), back-off (s) after a backup the
    #: store took nothing of (the call failed, or every page was refused)
    storage_workers: int = 2
    storage_timeout: float = 5.0
    storage_retry_seconds: float = 1.0
    #: storage tier: deadline (s) for opening the backend at start, which can take far longer
    #: than one call (a FileStorage rebuilds its index from the directory; Mooncake connects)
    storage_open_timeout: float = 60.0
    #: prefetch: minimum uncached tokens, deadline = base + per_1k * tokens / 1000 (capped),
    #: pages per storage read call
    prefetch_threshold_tokens: int = 256
    prefetch_timeout_base: float = 0.5
    prefetch_timeout_per_1k: float = 0.25
    prefetch_timeout_max: float = 5.0
    prefetch_batch_pages: int = 32
    #: hard pins (``cache.pin``): the longest ``ttl`` (s), and the share of each tier's pool
    #: that pins may hold at once, in (0, 1] (a pin beyond it raises ``PinLimitError``)
    max_pin_ttl: float = 3600.0
    max_pinned_fraction: float = 0.5
    #: per-tenant page budgets (``quotas.py``): a tenant's own quota, and the one every
    #: other tenant gets (the default tenant is ``""``); none at all: nothing is counted
    tenant_quotas: Mapping[str, TenantQuota] = field(default_factory=dict, hash=False)
    default_tenant_quota: TenantQuota | None = None

    def __post_init__(self) -> None:
        for name in ("page_size", "num_layers", "num_kv_heads", "head_dim", "device_pages"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        if type(self.host_pages) is not int or self.host_pages < 0:
            raise ConfigError(f"host_pages must be an int >= 0, got {self.host_pages!r}")
        if type(self.write_through_threshold) is not int or self.write_through_threshold < 1:
            raise ConfigError(
                f"write_through_threshold must be an int >= 1, got {self.write_through_threshold!r}"
            )
        if type(self.host_memory_reserve_bytes) is not int or self.host_memory_reserve_bytes < 0:
            raise ConfigError(
                f"host_memory_reserve_bytes must be an int >= 0, "
                f"got {self.host_memory_reserve_bytes!r}"
            )
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ConfigError(f"dtype must be a floating torch.dtype, got {self.dtype!r}")
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise ConfigError(f"bad device {self.device!r}: {exc}") from None
        if device.type not in ("cpu", "cuda"):
            raise ConfigError(f"device must be cpu or cuda, got {device}")
        object.__setattr__(self, "device", device)
        try:
            object.__setattr__(self, "write_policy", WritePolicy(self.write_policy))
        except ValueError:
            raise ConfigError(
                f"write_policy must be one of {[p.value for p in WritePolicy]}, "
                f"got {self.write_policy!r}"
            ) from None
        try:
            object.__setattr__(self, "prefetch_policy", PrefetchPolicy(self.prefetch_policy))
        except ValueError:
            raise ConfigError(
                f"prefetch_policy must be one of {[p.value for p in PrefetchPolicy]}, "
                f"got {self.prefetch_policy!r}"
            ) from None
        if self.copy_threads is not None and (
            type(self.copy_threads) is not int or not 1 <= self.copy_threads <= MAX_THREADS
        ):
            raise ConfigError(
                f"copy_threads must be None or an int in [1, {MAX_THREADS}], "
                f"got {shown(self.copy_threads)}"
            )
        if type(self.worker_nice) is not int or not 0 <= self.worker_nice <= 19:
            raise ConfigError(f"worker_nice must be an int in [0, 19], got {self.worker_nice!r}")
        if type(self.worker_idle) is not bool:
            raise ConfigError(f"worker_idle must be a bool, got {self.worker_idle!r}")
        for name, most in (("storage_workers", MAX_THREADS), ("prefetch_batch_pages", None)):
            value = getattr(self, name)
            if type(value) is not int or value < 1 or (most is not None and value > most):
                bound = "a positive int" if most is None else f"an int in [1, {most}]"
                raise ConfigError(f"{name} must be {bound}, got {shown(value)}")
        if type(self.prefetch_threshold_tokens) is not int or self.prefetch_threshold_tokens < 0:
            raise ConfigError(
                f"prefetch_threshold_tokens must be an int >= 0, "
                f"got {self.prefetch_threshold_tokens!r}"
            )
        # seconds: finite (a NaN deadline breaks the loop's timer heap), >= 0 (> 0 for the
        # deadlines of storage calls), at most MAX_SECONDS
        for name in (
            "storage_timeout",
            "storage_retry_seconds",
            "storage_open_timeout",
            "prefetch_timeout_base",
            "prefetch_timeout_per_1k",
            "prefetch_timeout_max",
        ):
            positive = name in ("storage_timeout", "storage_open_timeout")
            check_real(name, getattr(self, name), exclusive=positive, error=ConfigError)
        check_real("max_pin_ttl", self.max_pin_ttl, exclusive=True, error=ConfigError)
        check_real(
            "max_pinned_fraction",
            self.max_pinned_fraction,
            exclusive=True,
            maximum=1.0,
            error=ConfigError,
        )
        self._check_quotas()
        if self.storage is not None:
            from aiocache_kv.storage.base import StorageBackend

            if not isinstance(self.storage, StorageBackend):
                raise ConfigError(
                    f"storage must be a StorageBackend (FileStorage, MooncakeStorage) or None, "
                    f"got {type(self.storage).__name__}"
                )
            if self.host_pages == 0:
                raise ConfigError("a storage tier needs host_pages > 0")
        from aiocache_kv.components import Component

        if isinstance(self.components, (str, bytes, Mapping)) or not isinstance(
            self.components, Iterable
        ):
            raise ConfigError(
                f"components must be a sequence of Component instances (SlidingWindow, ...), "
                f"got {type(self.components).__name__} {self.components!r}"
            )
        comps = tuple(self.components)
        bad = [c for c in comps if not isinstance(c, Component)]
        if bad:
            raise ConfigError(
                f"components must be Component instances (SlidingWindow, ...), got {bad[0]!r}"
            )
        names = [c.name for c in comps]
        if len(set(names)) != len(names):
            raise ConfigError(f"component names must be unique, got {names}")
        object.__setattr__(self, "components", comps)
        if not isinstance(self.namespace, str) or not self.namespace:
            raise ConfigError(f"namespace must be a non-empty str, got {self.namespace!r}")
        policy = WritePolicy(self.write_policy)
        if policy is not WritePolicy.WRITE_THROUGH and self.host_pages == 0:
            raise ConfigError(f"{policy.value} needs host_pages > 0")

    def _check_quotas(self) -> None:
        if not isinstance(self.tenant_quotas, Mapping):
            raise ConfigError(
                f"tenant_quotas must be a mapping of tenant to TenantQuota, "
                f"got {type(self.tenant_quotas).__name__}"
            )
        quotas = dict(self.tenant_quotas)
        for tenant, quota in quotas.items():
            if type(tenant) is not str or not isinstance(quota, TenantQuota):
                raise ConfigError(
                    f"tenant_quotas maps str tenants to TenantQuota, got {tenant!r}: {quota!r}"
                )
        object.__setattr__(self, "tenant_quotas", MappingProxyType(quotas))
        if self.default_tenant_quota is not None and not isinstance(
            self.default_tenant_quota, TenantQuota
        ):
            raise ConfigError(
                f"default_tenant_quota must be a TenantQuota or None, "
                f"got {self.default_tenant_quota!r}"
            )

    @property
    def quotas_configured(self) -> bool:
        """Whether any tenant has a budget (then the tree keeps a per-tenant ledger)."""
        return bool(self.tenant_quotas) or self.default_tenant_quota is not None

    @property
    def page_elems(self) -> int:
        """Elements of one page of one layer's K (or V)."""
        return self.page_size * self.num_kv_heads * self.head_dim

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all layers, K and V."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.page_elems * itemsize
