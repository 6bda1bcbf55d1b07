"""Device and host buffers of one sidecar component (one slot per KV page id).

Both are page-first: slot ``i`` holds the component's state for KV page ``i`` of that tier, so
the KV allocators serve every component and a copy moves the same page ids in every buffer.
Host slots are ``[payload | extra]`` bytes like the KV host pool, for the storage framing.
"""

from __future__ import annotations

import torch

from aiocache_kv.components import Component
from aiocache_kv.pools.kv_pool import host_slot_bytes


class SidecarPools:
    """The L1 and L2 buffers of ``component``."""

    def __init__(
        self,
        component: Component,
        device_pages: int,
        host_pages: int,
        device: torch.device,
        *,
        extra_bytes: int = 0,
        pin_memory: bool = False,
    ) -> None:
        self.component = component
        shape = component.page_shape
        self.device = torch.zeros((device_pages, *shape), dtype=component.dtype, device=device)
        self.page_bytes = component.page_bytes
        self.slot_bytes = host_slot_bytes(self.page_bytes, extra_bytes)
        self.host_raw = torch.empty(
            (host_pages, self.slot_bytes), dtype=torch.uint8, pin_memory=pin_memory
        )
        #: typed payload view ``[host_pages, *page_shape]``
        self.host = (
            self.host_raw[:, : self.page_bytes].view(component.dtype).view(host_pages, *shape)
        )

    @staticmethod
    def host_bytes(component: Component, host_pages: int, extra_bytes: int) -> int:
        """Host bytes the buffers of ``component`` need (for admission before allocating)."""
        return host_pages * host_slot_bytes(component.page_bytes, extra_bytes)
