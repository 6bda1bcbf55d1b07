"""An insert never leaves its caller holding rows the tree freed; ``prefix=`` an insert result.

Two requests that computed the same pages: the second inserts after the first, so the tree
already holds those pages and the second's rows are duplicates.  They used to be freed at once,
while the second request was still decoding over them: the next ``alloc`` handed them to
someone else, whose KV then replaced the second request's.  Now the insert's result *retains*
them (``retained_pages``) until it is released.  A batched loop inserts each new page with the
previous result as the prefix (``insert(tokens[:k], rows_after_prev, prefix=r_prev)``) and
releases ``r_prev``; the new result retains ``r_prev``'s rows too, so the request keeps
attending over its own rows throughout and every row is freed exactly once at the end.
"""

from __future__ import annotations

import asyncio
import gc

import pytest
import torch

import aiocache_kv as akv
from aiocache_kv.handles import HandleState
from aiocache_kv.testing import ManualCopyEngine
from tests.conftest import small_config
from tests.test_insert_prefix import tree_state
from tests.test_split_ack import write_kv

P = 2  # small_config's page size


def kv_of(cache: akv.HiCache, slots: torch.Tensor) -> list[torch.Tensor]:
    """A copy of the K and V rows at ``slots`` in every layer."""
    out = []
    for layer in range(cache.config.num_layers):
        out += [buf[slots].clone() for buf in cache.device_kv(layer)]
    return out


def same_kv(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def pages_of(slots: torch.Tensor) -> set[int]:
    return {int(s) // P for s in slots[::P]}


def churn(cache: akv.HiCache, seed: int, avoid: set[int]) -> None:
    """Other requests: take every free page, write their KV, insert some, free the rest,
    evict.  None of them may ever be handed a page in ``avoid``."""
    for i in range(4):
        n = cache.statistics().device.free_pages + cache.statistics().device.evictable_pages
        if n == 0:
            break
        slots = cache.alloc(n * P)
        assert not pages_of(slots) & avoid, "a retained row was handed to another request"
        write_kv(cache, slots, seed=seed * 10 + i)
        toks = [100 + seed, i] + [7] * (slots.numel() - 2)
        r = cache.insert(toks[:4], slots[:4])  # two pages into the tree, the rest freed
        cache.free(slots[4:])
        cache.release(r)
        cache.evict(1 << 20)


async def test_second_insert_keeps_its_own_rows_until_release() -> None:
    async with akv.HiCache(small_config(device_pages=16, host_pages=0)) as cache:
        toks = [1, 2, 3, 4, 5, 6]
        a = cache.alloc(6)
        write_kv(cache, a, seed=1)
        ra = cache.insert(toks, a)
        b = cache.alloc(6)  # the second request computed the same pages into its own rows
        write_kv(cache, b, seed=2)
        mine = kv_of(cache, b)
        rb = cache.insert(toks, b)
        assert (rb.prefix_len, rb.inserted_len) == (6, 6)
        assert sorted(rb.retained_pages.tolist()) == sorted(pages_of(b))
        assert rb.device_indices.tolist() == a.tolist()  # the tree's rows, to switch to
        assert cache.statistics().device.retained_pages == 3
        cache.release(ra)
        cache.check_invariants()
        churn(cache, seed=3, avoid=pages_of(b))  # other requests alloc, insert, evict
        cache.check_invariants()
        assert same_kv(kv_of(cache, b), mine), "the second request's rows were overwritten"
        before = cache.statistics().device.free_pages
        cache.release(rb)
        st = cache.statistics().device
        assert st.retained_pages == 0 and st.free_pages == before + 3
        cache.check_invariants()
        cache.evict(1 << 20)
        assert cache.statistics().device.free_pages == 16  # every row freed exactly once


async def test_full_rows_reinsert_keeps_retained_rows_alive() -> None:
    """The engine's pattern: after each page, insert the whole sequence with the request's own
    rows, then release the previous result.  Rows an earlier result retains are accepted, and
    retained by the new result as well."""
    async with akv.HiCache(small_config(device_pages=16, host_pages=0)) as cache:
        shared = [1, 2, 3, 4]
        cache.release(cache.insert(shared, cache.alloc(4)))
        kept = cache.match_prefix(shared)  # another request keeps the shared pages on device
        rows = cache.alloc(4)
        write_kv(cache, rows, seed=5)
        r = cache.insert(shared, rows)
        for k in range(3):  # decode: one more page each time
            rows = torch.cat([rows, cache.alloc(2)])
            write_kv(cache, rows[-2:], seed=10 + k)
            mine = kv_of(cache, rows)
            toks = [*shared, *range(20, 22 + 2 * k)]
            new = cache.insert(toks, rows)
            assert new.inserted_len == len(toks) and new.prefix_len == len(toks) - 2
            assert sorted(new.retained_pages.tolist()) == sorted(pages_of(rows[:4]))
            cache.release(r)  # the old result goes; the rows stay the new one's
            r = new
            churn(cache, seed=20 + k, avoid=pages_of(rows))
            assert same_kv(kv_of(cache, rows), mine)
            cache.check_invariants()
        cache.release(r)
        cache.release(kept)
        cache.check_invariants()
        cache.evict(1 << 20)
        st = cache.statistics().device
        assert st.free_pages == 16 and st.retained_pages == 0


@pytest.mark.parametrize("order", ["eager", "oldest_first", "newest_first"])
async def test_incremental_insert_chain(order: str) -> None:
    """Prefill in chunks then decode, each insert leaning on the previous result; whatever
    order the results are released in, the pins and rows are exactly right, and every page
    comes back."""
    engine = ManualCopyEngine()
    async with akv.HiCache(small_config(device_pages=24), copy_engine=engine) as cache:
        seq = [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 9, 9, 8, 8]
        other = cache.alloc(6)  # another request already cached the first 6 tokens
        write_kv(cache, other, seed=1)
        cache.release(cache.insert(seq[:6], other))
        m = cache.match_prefix(seq[:2])  # this request matched only the first page
        assert m.device_len == 2
        rows = m.device_indices
        prev: akv.MatchResult | akv.InsertResult = m
        results: list[akv.InsertResult] = []
        done = 2
        for chunk in (3, 3, 2, 1, 1, 2):  # prefill chunks, then decode steps
            if rows.numel() < done + chunk:
                rows = torch.cat([rows, cache.alloc(done + chunk - rows.numel())])
            write_kv(cache, rows[done : done + chunk], seed=done)
            done += chunk
            k = done // P * P
            start = prev.device_len if isinstance(prev, akv.MatchResult) else prev.inserted_len
            if k > start:
                r = cache.insert(seq[:k], rows[start:k], prefix=prev)
                assert r.inserted_len == k
                results.append(r)
                if order == "eager":
                    cache.release(prev)
                prev = r
                cache.check_invariants()
        mine = kv_of(cache, rows[: len(seq)])
        # the request's own copies of the 4 shared tokens after its match, kept alive
        assert isinstance(prev, akv.InsertResult)
        assert sorted(prev.retained_pages.tolist()) == sorted(pages_of(rows[2:6]))
        churn(cache, seed=7, avoid=pages_of(rows))
        assert same_kv(kv_of(cache, rows[: len(seq)]), mine)
        handles: list[akv.MatchResult | akv.InsertResult] = [m, *results]
        live = [h for h in handles if h.state is not HandleState.RELEASED]
        if order == "newest_first":
            live.reverse()
        for h in live:
            cache.release(h)
            cache.check_invariants()
        assert cache.statistics().device.retained_pages == 0
        engine.complete_all()
        await cache.flush()
        assert cache.statistics().device.protected_pages == 0
        cache.evict(1 << 20)
        cache.check_invariants()
        assert cache.statistics().device.free_pages == 24


async def test_prefix_insert_result_refusals_change_nothing() -> None:
    engine = ManualCopyEngine()
    async with (
        akv.HiCache(small_config(), copy_engine=engine) as cache,
        akv.HiCache(small_config(), copy_engine=ManualCopyEngine()) as other,
    ):
        cache.release(cache.insert([7, 7, 8, 8], cache.alloc(4)))
        r = cache.insert([1, 2, 3, 4], cache.alloc(4))
        own = cache.alloc(2)
        before = tree_state(cache)
        cases: list[tuple[dict[str, object], list[int], torch.Tensor, type[Exception], str]] = [
            # another tenant's namespace
            ({"tenant": "t"}, [1, 2, 3, 4, 5, 6], own, akv.InvalidInputError, "namespace"),
            # tokens that do not extend r (none of them, or another prompt's pages)
            ({}, [9, 9, 3, 4, 5, 6], own, akv.InvalidInputError, "do not extend"),
            ({}, [7, 7, 8, 8, 5, 6], own, akv.InvalidInputError, "do not extend"),
            # slots past r's path, inside a page, or more slots than tokens
            ({}, [1, 2, 3, 4, 5, 6, 7, 8], own, akv.InvalidInputError, "start at token 6"),
            ({}, [1, 2, 3], own[:0], akv.InvalidInputError, "start at token 3"),
            ({}, [1, 2, 3, 4, 5, 6], own.repeat(4), akv.InvalidInputError, "token -2"),
            # slots not whole pages the caller holds
            ({}, [1, 2, 3, 4, 5, 6], own.flip(0), akv.InvalidInputError, "whole pages"),
        ]
        for kwargs, toks, slots, err, words in cases:
            with pytest.raises(err) as info:
                cache.insert(toks, slots, prefix=r, **kwargs)  # type: ignore[arg-type]
            assert words in str(info.value), info.value
            assert tree_state(cache) == before
        foreign = other.insert([1, 2], other.alloc(2))
        with pytest.raises(akv.HandleError, match="another cache"):
            cache.insert([1, 2, 3, 4], own, prefix=foreign)
        other.release(foreign)
        assert tree_state(cache) == before
        cache.release(r)
        before = tree_state(cache)
        with pytest.raises(akv.HandleError, match="released"):
            cache.insert([1, 2, 3, 4, 5, 6], own, prefix=r)
        assert tree_state(cache) == before
        cache.check_invariants()
        m = cache.match_prefix([1, 2, 3, 4])
        r2 = cache.insert([1, 2, 3, 4, 5, 6], own, prefix=m)  # the rows are still the caller's
        r3 = cache.insert([1, 2, 3, 4, 5, 6], own[:0], prefix=r2)  # nothing new: fine
        assert r3.inserted_len == 6
        for h in (r2, r3, m):
            cache.release(h)
        engine.complete_all()
        await cache.flush()
        cache.check_invariants()


async def test_dropped_insert_result_frees_its_rows_on_the_loop() -> None:
    async with akv.HiCache(small_config(host_pages=0)) as cache:
        cache.release(cache.insert([1, 2, 3, 4], cache.alloc(4)))
        b = cache.alloc(4)
        rb = cache.insert([1, 2, 3, 4], b)
        assert cache.statistics().device.retained_pages == 2
        free0 = cache.statistics().device.free_pages
        with pytest.warns(ResourceWarning, match="InsertResult .* without cache.release"):
            del rb
            gc.collect()
        await asyncio.sleep(0)  # the release runs on the loop
        st = cache.statistics().device
        assert st.retained_pages == 0 and st.free_pages == free0 + 2
        cache.check_invariants()


async def test_rows_after_a_loading_node_are_retained_then_taken() -> None:
    """An insert that meets a node still loading back caches up to it; the caller's pages
    after it are retained, not freed.  Once the load landed, the caller's next insert hands
    the retained page to the tree, which owns it from then on: releasing the old result
    (which still refers to it) does not free it; the tree's eviction later does, once."""
    engine = ManualCopyEngine()
    async with akv.HiCache(small_config(device_pages=16), copy_engine=engine) as cache:
        s = cache.alloc(6)
        cache.release(cache.insert([1, 2, 3, 4, 5, 6], s))
        engine.complete_all()
        await cache.flush()
        cache.release(cache.match_prefix([1, 2, 3, 4]))  # split after [1, 2, 3, 4]
        assert cache.evict(1) == 1  # [5, 6] is host-only now
        m = cache.match_prefix([1, 2, 3, 4, 5, 6])
        task = asyncio.ensure_future(cache.load_back(m))
        await asyncio.sleep(0)  # [5, 6] is device FILLING
        rows = cache.alloc(8)
        write_kv(cache, rows, seed=3)
        mine = kv_of(cache, rows)
        toks = [1, 2, 3, 4, 5, 6, 7, 8]
        r1 = cache.insert(toks, rows)
        assert (r1.inserted_len, r1.uncached_len) == (6, 2)
        assert sorted(r1.retained_pages.tolist()) == sorted(pages_of(rows))  # all 4 pages
        churn(cache, seed=4, avoid=pages_of(rows))
        assert same_kv(kv_of(cache, rows), mine)
        engine.complete_all()
        await task
        r2 = cache.insert(toks, rows)  # [7, 8]'s retained page joins the tree now
        assert (r2.prefix_len, r2.inserted_len) == (6, 8)
        last = int(rows[6]) // P
        assert last not in r2.retained_pages.tolist()
        cache.check_invariants()
        cache.release(r1)  # its reference on the tree's page ends; the page stays the tree's
        assert cache.statistics().device.retained_pages == 3
        cache.check_invariants()
        assert same_kv(kv_of(cache, rows)[:1], mine[:1])
        for h in (r2, m):
            cache.release(h)
        engine.complete_all()
        await cache.flush()
        cache.evict(1 << 20)
        cache.check_invariants()
        st = cache.statistics().device
        assert st.free_pages == 16 and st.retained_pages == 0
