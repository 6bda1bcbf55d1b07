"""A quota pass due when the cache closes does not run after it.

Releasing the handles still held at ``aclose`` puts an over-budget tenant's pages back in
reach, and the enforcement pass that schedules ran after the close: with ``write_back`` its
eviction staged a copy on the closed engine (an ``AssertionError`` in the loop's exception
handler), with ``write_through`` it removed the blocks a second time after the closing
events.  Events must end with the close's own removals, and nothing may fail on the loop.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import aiocache_kv as akv
from tests.conftest import small_config
from tests.test_split_ack import write_kv


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
async def test_quota_pass_scheduled_by_close_does_not_run(policy: str) -> None:
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    try:
        cache = akv.HiCache(
            small_config(
                write_policy=policy,
                device_pages=16,
                host_pages=32,
                tenant_quotas={"t1": akv.TenantQuota(device_pages=2)},
            )
        )
        await cache.start()
        slots = cache.alloc(8)
        write_kv(cache, slots, 0)
        held = cache.insert([1, 2, 3, 4, 5, 6, 7, 8], slots, tenant="t1")  # over its budget
        await cache.aclose()  # with the handle still held (the close ends it)
        events = cache.take_events()
        for _ in range(5):
            await asyncio.sleep(0.01)
        assert cache.take_events() == []
        assert not errors, errors
        removed: dict[str, list[bytes]] = {}
        for e in events:
            if isinstance(e, akv.BlockRemoved):
                removed.setdefault(e.medium, []).extend(e.block_hashes)
        for medium, hashes in removed.items():
            assert len(hashes) == len(set(hashes)), f"{medium} blocks removed twice"
        del held  # ended by the close: collected without a warning
    finally:
        loop.set_exception_handler(None)
