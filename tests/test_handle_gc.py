"""A handle dropped without ``release``: a ``ResourceWarning``, and its pin released on the loop.

Before, the cache kept a strong reference to every handle, so a leaked handle pinned its pages
forever, silently.  Now the table holds only the pinned node, and the handle's finalizer hands
the release to the loop (from whatever thread the collection ran on).
"""

from __future__ import annotations

import asyncio
import gc
import threading
import warnings

import pytest

import aiocache_kv as akv
from tests.conftest import small_config
from tests.test_split_ack import insert


def pinned_pages(cache: akv.HiCache) -> int:
    return cache.statistics().device.protected_pages


async def test_dropped_match_warns_and_its_pin_is_released() -> None:
    async with akv.HiCache(small_config(host_pages=0)) as cache:
        cache.release(insert(cache, [1, 2, 3, 4]))
        m = cache.match_prefix([1, 2, 3, 4])
        assert pinned_pages(cache) == 2
        with pytest.warns(ResourceWarning, match="MatchResult .* without cache.release"):
            del m
            gc.collect()
        assert pinned_pages(cache) == 2  # not from the finalizer: on the loop, next
        await asyncio.sleep(0)
        assert pinned_pages(cache) == 0
        cache.check_invariants()
        assert cache.evict(2, tier="device") == 2  # evictable again


async def test_released_or_closed_handles_do_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        async with akv.HiCache(small_config()) as cache:
            r = insert(cache, [1, 2])
            cache.release(r)
            with cache.match_prefix([1, 2]) as m:
                assert m.device_len == 2
            del r, m
            gc.collect()
            kept = cache.match_prefix([1, 2])  # still pinned when the cache closes
        del kept
        gc.collect()  # closed: its pins went with the tree, nothing to warn about


async def test_handle_collected_on_another_thread_is_released_on_the_loop() -> None:
    async with akv.HiCache(small_config(host_pages=0)) as cache:
        box = [insert(cache, [5, 6, 7, 8])]
        caught: list[warnings.WarningMessage] = []

        def drop() -> None:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                box.clear()  # the last reference dies here, off the loop
                gc.collect()
            caught.extend(seen)

        t = threading.Thread(target=drop)
        t.start()
        await asyncio.to_thread(t.join)
        assert [w.category for w in caught] == [ResourceWarning]
        await asyncio.sleep(0)
        assert pinned_pages(cache) == 0  # unpinned on the loop (the tree checks its owner)
        cache.check_invariants()
