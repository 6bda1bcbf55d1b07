"""A released handle answers no lengths and no rows: reading them raises ``HandleError``.

Once its pin is gone a handle's pages may be evicted and reallocated to another prompt; a
released handle that still answered ``device_indices`` handed a caller with a use-after-release
bug another sequence's rows, silently (found by an adversarial trial).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import aiocache_kv as akv
from aiocache_kv.errors import HandleError
from tests.conftest import small_config

MATCH_READS: dict[str, Callable[[akv.MatchResult], object]] = {
    "device_len": lambda m: m.device_len,
    "host_len": lambda m: m.host_len,
    "matched_len": lambda m: m.matched_len,
    "device_pages": lambda m: m.device_pages,
    "device_indices": lambda m: m.device_indices,
    "lens": lambda m: m.lens(),
    "parts": lambda m: m.parts(),
}
INSERT_READS: dict[str, Callable[[akv.InsertResult], object]] = {
    "device_len": lambda r: r.device_len,
    "device_pages": lambda r: r.device_pages,
    "device_indices": lambda r: r.device_indices,
    "retained_pages": lambda r: r.retained_pages,
}


def tiny(page: int) -> akv.CacheConfig:
    return small_config(page_size=page, device_pages=8 // page, host_pages=0)


@pytest.mark.parametrize("page", [1, 2])
async def test_a_released_handle_never_answers_rows_reused_by_another_prompt(page: int) -> None:
    async with akv.HiCache(tiny(page)) as cache:
        r = cache.insert([1, 2, 3, 4], cache.alloc(4))
        m = cache.match_prefix([1, 2, 3, 4])
        rows = m.device_indices.tolist()
        cache.release(m)
        cache.release(r)
        cache.evict(100)
        assert cache.cached_len([1, 2, 3, 4]) == 0
        other = cache.insert([9, 9, 9, 9, 8, 8, 8, 8], cache.alloc(8))
        assert set(rows) & set(other.device_indices.tolist()), "the rows were not reused"
        for read in MATCH_READS.values():
            with pytest.raises(HandleError, match="released"):
                read(m)
        for read_r in INSERT_READS.values():
            with pytest.raises(HandleError, match="released"):
                read_r(r)
        assert "RELEASED" in repr(m) and "RELEASED" in repr(r)
        cache.release(other)
        cache.check_invariants()


@pytest.mark.parametrize("name", sorted(MATCH_READS))
async def test_every_match_read_raises_after_release(name: str) -> None:
    async with akv.HiCache(tiny(2)) as cache:
        r = cache.insert([1, 2, 3, 4], cache.alloc(4))
        with cache.match_prefix([1, 2, 3, 4]) as m:
            MATCH_READS[name](m)  # live: answers
        with pytest.raises(HandleError):
            MATCH_READS[name](m)
        cache.release(r)
        cache.check_invariants()


@pytest.mark.parametrize("name", sorted(INSERT_READS))
async def test_every_insert_read_raises_after_release(name: str) -> None:
    async with akv.HiCache(tiny(2)) as cache:
        m = cache.match_prefix([1, 2, 3, 4, 5, 6])
        slots = cache.alloc(6)
        r = cache.insert([1, 2, 3, 4, 5, 6], slots, prefix=m)
        cache.release(m)
        got = INSERT_READS[name](r)
        assert isinstance(got, (int, torch.Tensor))
        cache.release(r)
        with pytest.raises(HandleError):
            INSERT_READS[name](r)
        # the plain numbers the insert reported stay readable (they name no rows)
        assert (r.inserted_len, r.prefix_len) == (6, 0)
        cache.check_invariants()
