"""``flush()`` waits for the work in flight when it was called, not for the cache to idle.

Under sustained inserts (write-through copies and storage backups always in flight) a flush
that waited until nothing at all was in flight never returned.  It must return once the copies
and backups in flight or queued at the call settled, and those pages must then be in storage.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import aiocache_kv as akv
from aiocache_kv.storage import PageBuffer
from aiocache_kv.testing import MemoryStorage
from tests.conftest import small_config

PUT_SECONDS = 0.03
PROMPT_TOKENS = 8  # 4 pages of 2: one node per prompt (distinct first tokens, no splits)


class SlowPuts(MemoryStorage):
    """MemoryStorage whose every put takes about 30 ms (on the worker thread)."""

    def put(
        self, keys: Sequence[str], buffers: Sequence[PageBuffer], *args: Any, **kwargs: Any
    ) -> list[bool]:
        time.sleep(PUT_SECONDS)
        return super().put(keys, buffers, *args, **kwargs)


def prompt(k: int) -> list[int]:
    return list(range(k * PROMPT_TOKENS, (k + 1) * PROMPT_TOKENS))


async def test_flush_returns_under_sustained_inserts_and_stores_what_was_in_flight() -> None:
    store = SlowPuts()
    cfg = small_config(
        storage=store,
        device_pages=512,
        host_pages=2048,
        prefetch_threshold_tokens=0,
        storage_timeout=5.0,
    )
    counter = iter(range(1 << 30))
    inserted: list[list[int]] = []
    stop = asyncio.Event()

    async with akv.HiCache(cfg) as cache:

        async def inserter() -> None:
            while not stop.is_set():
                toks = prompt(next(counter))
                slots = cache.alloc(len(toks))
                cache.release(cache.insert(toks, slots))
                inserted.append(toks)
                await asyncio.sleep(0.01)

        tasks = [asyncio.create_task(inserter()) for _ in range(2)]
        try:
            await asyncio.sleep(0.3)  # copies and backups are in flight from now on
            for _ in range(400):  # call flush while a backup is under way
                if cache.statistics().storage_in_flight:
                    break
                await asyncio.sleep(0.005)
            assert cache.statistics().storage_in_flight, "no backup under way"
            before = [list(t) for t in inserted]  # every prompt inserted before the call
            t0 = time.monotonic()
            await asyncio.wait_for(cache.flush(), 10.0)
            took = time.monotonic() - t0
            assert took < 3.0, f"flush took {took:.2f} s under sustained load"
            assert all(not t.done() for t in tasks), "the inserters stopped during the flush"
            events = cache.take_events()
            grown = len(inserted) - len(before)
        finally:
            stop.set()
            await asyncio.gather(*tasks)
        assert grown > 0, "nothing was inserted while flush ran: no sustained load"
        stored = {
            tuple(e.token_ids)
            for e in events
            if isinstance(e, akv.BlockStored) and e.medium == "STORAGE"
        }
        missing = [t for t in before if tuple(t) not in stored]
        assert not missing, f"{len(missing)} of {len(before)} prompts not stored after flush"
        assert cache.statistics().backup_pages_failed == 0
        assert len(store.contents()) >= len(before) * PROMPT_TOKENS // cfg.page_size
        await cache.flush()  # once the load stopped, flush still drains everything
        assert cache.statistics().storage_in_flight == 0
        cache.check_invariants()
