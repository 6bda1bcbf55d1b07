"""Admission and allocation of a cache's pools (run at start-up, the allocation off the loop)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch

from aiocache_kv.config import CacheConfig
from aiocache_kv.errors import ConfigError
from aiocache_kv.pools.admission import admit_host_bytes, available_host_bytes
from aiocache_kv.pools.kv_pool import DeviceKVPool, HostKVPool, host_slot_bytes
from aiocache_kv.pools.sidecar import SidecarPools


@dataclass(frozen=True)
class Pools:
    """The buffers of one cache."""

    device: DeviceKVPool
    host: HostKVPool | None
    sidecars: list[SidecarPools]
    host_bytes: int  #: host bytes admitted for the host pools


async def build_pools(cfg: CacheConfig, extra_bytes: int) -> Pools:
    """Check that every pool fits, then allocate them on a worker thread.

    ``extra_bytes`` are reserved at the end of every host slot (the storage trailer).

    Raises:
        HostMemoryError: the host pools do not fit in available RAM minus the reserve.
        ConfigError: the device pool does not fit (on cpu: in available RAM; on cuda: in the
            device's free memory), or CUDA was asked for and is not available.
    """
    device = torch.device(cfg.device)
    host_bytes = cfg.host_pages * host_slot_bytes(cfg.page_bytes, extra_bytes)
    host_bytes += sum(
        SidecarPools.host_bytes(c, cfg.host_pages, extra_bytes) for c in cfg.components
    )  # every pool is admitted together
    available = await asyncio.to_thread(available_host_bytes)
    device_bytes = cfg.device_pages * (cfg.page_bytes + sum(c.page_bytes for c in cfg.components))
    if device.type == "cpu":  # the device pool lives in host memory too
        if device_bytes > available - cfg.host_memory_reserve_bytes:
            raise ConfigError(
                f"device pool of {cfg.device_pages} pages needs {device_bytes} bytes "
                f"({device_bytes / 2**30:.2f} GiB) on cpu but only {available} bytes are "
                f"available ({cfg.host_memory_reserve_bytes} reserved); lower device_pages"
            )
        available -= device_bytes
    else:
        await _check_cuda(device, cfg.device_pages, device_bytes)
    admit_host_bytes(host_bytes, cfg.host_memory_reserve_bytes, available)
    pin = device.type == "cuda"

    def build() -> Pools:
        dev = DeviceKVPool(
            cfg.device_pages,
            cfg.num_layers,
            cfg.page_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.dtype,
            device,
        )
        host = (
            HostKVPool(
                cfg.host_pages,
                cfg.num_layers,
                cfg.page_elems,
                cfg.dtype,
                extra_bytes=extra_bytes,
                pin_memory=pin,
            )
            if cfg.host_pages
            else None
        )
        sidecars = [
            SidecarPools(
                c,
                cfg.device_pages,
                cfg.host_pages,
                device,
                extra_bytes=extra_bytes,
                pin_memory=pin,
            )
            for c in cfg.components
        ]
        return Pools(dev, host, sidecars, host_bytes)

    return await asyncio.to_thread(build)


async def _check_cuda(device: torch.device, pages: int, device_bytes: int) -> None:
    if not torch.cuda.is_available():
        raise ConfigError(
            f"device {str(device)!r} but CUDA is not available (torch {torch.__version__}, "
            f"built for CUDA {torch.version.cuda}); use device='cpu'"
        )
    count = torch.cuda.device_count()
    index = device.index if device.index is not None else 0
    if index >= count:
        raise ConfigError(f"device {str(device)!r} but only {count} CUDA device(s) exist")
    free, total = await asyncio.to_thread(torch.cuda.mem_get_info, index)
    if device_bytes > free:
        raise ConfigError(
            f"device pool of {pages} pages needs {device_bytes} bytes "
            f"({device_bytes / 2**30:.2f} GiB) but {device} has {free} bytes free of {total}; "
            "lower device_pages"
        )


__all__ = ["Pools", "build_pools"]
