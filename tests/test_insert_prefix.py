"""``insert(tokens, slots, prefix=m)``: only the slots after the match's device run are passed.

The prefix form must leave the cache exactly as the plain form does (same tree, same pages,
same allocator states), refuse tokens that do not extend the match and any stale or foreign
handle with nothing changed, and ``MatchResult.lens`` (read on every request, with its own
one-walk rule when no window cuts the path) must agree with ``parts()`` in every tier state.
"""

from __future__ import annotations

import asyncio
import os
import random

import pytest
import torch

import aiocache_kv as akv
from aiocache_kv.testing import ManualCopyEngine
from tests.conftest import small_config
from tests.test_components import cfg as component_cfg
from tests.test_split_ack import write_kv


def tree_state(cache: akv.HiCache) -> tuple[object, ...]:
    """What an insert may change: every node (tokens from its root, tier states, pages,
    pins) and the page counts."""
    tree = cache._core.tree
    nodes = []
    for node in tree.walk():
        toks = tuple(t for n in tree.path(node) for t in n.key)
        pages = [
            None if pg is None else tuple(pg.tolist())
            for pg in (node.device_pages, node.host_pages)
        ]
        nodes.append((str(node.ns), toks, node.device.name, node.host.name, *pages, node.pins))
    s = cache.statistics()
    return (tuple(sorted(nodes)), s.device, s.host)


async def finish(
    cache: akv.HiCache, engine: ManualCopyEngine, *handles: akv.MatchResult | akv.InsertResult
) -> None:
    """Release ``handles``, land every copy, and check every invariant."""
    for h in handles:
        cache.release(h)
    engine.complete_all()
    await cache.flush()
    cache.check_invariants()


async def test_prefix_insert_leaves_the_same_state_as_the_plain_insert() -> None:
    """Two caches, the same requests: one passes m.device_indices + new slots, the other
    only the new slots with prefix=m.  Pages, results and KV must agree at every step."""
    rng = random.Random(5)
    prompts = [[rng.randrange(6) for _ in range(rng.randrange(1, 15))] for _ in range(60)]
    async with (
        akv.HiCache(small_config(device_pages=64, host_pages=0)) as a,
        akv.HiCache(small_config(device_pages=64, host_pages=0)) as b,
    ):
        for i, toks in enumerate(prompts):
            ma, mb = a.match_prefix(toks), b.match_prefix(toks)
            assert ma.lens() == mb.lens()
            new = len(toks) - mb.device_len
            sa, sb = a.alloc(new), b.alloc(new)
            assert torch.equal(sa, sb), f"request {i}: allocators diverged"
            write_kv(a, sa, seed=i)
            write_kv(b, sb, seed=i)
            ra = a.insert(toks, torch.cat([ma.device_indices, sa[:new]]))
            rb = b.insert(toks, sb[:new], prefix=mb)
            assert (ra.prefix_len, ra.inserted_len, ra.uncached_len) == (
                rb.prefix_len,
                rb.inserted_len,
                rb.uncached_len,
            ), f"request {i}"
            tail = slice(len(toks) // 2 * 2 - ma.device_len, None)
            a.free(sa[tail])
            b.free(sb[tail])
            for c, h in ((a, ra), (a, ma), (b, rb), (b, mb)):
                c.release(h)
            if i % 7 == 6:
                assert a.evict(3) == b.evict(3)
            assert tree_state(a) == tree_state(b), f"request {i}"
            a.check_invariants()
            b.check_invariants()
        ma, mb = a.match_prefix(prompts[-1]), b.match_prefix(prompts[-1])
        for layer in range(2):
            for x, y in zip(a.device_kv(layer), b.device_kv(layer), strict=True):
                assert torch.equal(x[ma.device_indices], y[mb.device_indices])
        a.release(ma)
        b.release(mb)


async def test_prefix_insert_passes_only_new_slots(engine: ManualCopyEngine) -> None:
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        first = cache.alloc(4)
        cache.release(cache.insert([1, 2, 3, 4], first))
        free0 = cache.statistics().device.free_pages
        m = cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
        assert m.device_len == 4
        own = cache.alloc(3)  # 2 pages: [5, 6] cached, [7] the caller's tail
        r = cache.insert([1, 2, 3, 4, 5, 6, 7], own[:3], prefix=m)
        assert (r.prefix_len, r.inserted_len, r.uncached_len) == (4, 6, 1)
        assert cache.statistics().device.free_pages == free0 - 2
        assert cache.statistics().device.held_pages == 1
        cache.free(own[2:])
        mm = cache.match_prefix([1, 2, 3, 4, 5, 6])
        assert mm.device_indices.tolist() == [*first.tolist(), *own[:2].tolist()]
        await finish(cache, engine, r, m, mm)


async def test_prefix_that_grew_since_the_alloc_retains_the_callers_copies(
    engine: ManualCopyEngine,
) -> None:
    """The caller read m.device_len, allocated the rest, then (while it computed) another
    request loaded m's host part back: its slots still start at the old device_len, which is
    fine; its copies of the pages the tree now holds are retained by the result (it may still
    attend over them) and freed, once, when the result is released."""
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        s = cache.alloc(6)
        cache.release(cache.insert([1, 2, 3, 4, 5, 6], s))
        engine.complete_all()
        await cache.flush()
        cache.release(cache.match_prefix([1, 2, 3, 4]))  # split after [1, 2, 3, 4]
        assert cache.evict(1) == 1  # [5, 6] is host-only now
        m = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
        assert m.lens() == (4, 2)
        own = cache.alloc(8 - m.device_len)  # for [5, 6, 7, 8]
        free0 = cache.statistics().device.free_pages
        other = cache.match_prefix([1, 2, 3, 4, 5, 6])
        task = asyncio.ensure_future(cache.load_back(other))
        await asyncio.sleep(0)
        engine.complete_all()
        await task
        assert m.lens() == (6, 0)  # m grew meanwhile
        r = cache.insert([1, 2, 3, 4, 5, 6, 7, 8], own, prefix=m)
        assert (r.prefix_len, r.inserted_len) == (6, 8)
        st = cache.statistics().device
        # the load took a page; the caller's copy of [5, 6] is retained until release(r)
        assert st.free_pages == free0 - 1 and st.held_pages == 0 and st.retained_pages == 1
        assert r.retained_pages.tolist() == [int(own[0]) // 2]
        assert m.device_indices.tolist()[4:] != own[:2].tolist()  # the tree kept its own
        assert r.device_indices.tolist() == m.device_indices.tolist() + own[2:].tolist()
        cache.check_invariants()
        await finish(cache, engine, r, m, other)
        st = cache.statistics().device
        assert st.free_pages == free0 and st.retained_pages == 0


async def test_prefix_covering_host_pages_adopts_the_callers_slots(
    engine: ManualCopyEngine,
) -> None:
    """A match with a host-only part not loaded back: the caller recomputed it, and its
    slots (the tokens after the device run) become that node's device pages."""
    async with akv.HiCache(small_config(), copy_engine=engine) as cache:
        s = cache.alloc(6)
        cache.release(cache.insert([1, 2, 3, 4, 5, 6], s))
        engine.complete_all()
        await cache.flush()
        m = cache.match_prefix([1, 2, 3, 4])
        cache.release(m)  # split after [1, 2, 3, 4]
        assert cache.evict(1) == 1  # [5, 6] leaves the device, keeps its host copy
        m = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
        assert m.lens() == (4, 2)
        own = cache.alloc(4)
        r = cache.insert([1, 2, 3, 4, 5, 6, 7, 8], own, prefix=m)
        assert (r.prefix_len, r.inserted_len) == (6, 8)
        assert m.lens() == (6, 0)  # the host-only node is on device again, in own's pages
        assert m.device_indices.tolist()[4:] == own[:2].tolist()
        await finish(cache, engine, r, m)


async def test_prefix_insert_refusals_change_nothing(engine: ManualCopyEngine) -> None:
    async with (
        akv.HiCache(small_config(), copy_engine=engine) as cache,
        akv.HiCache(small_config(), copy_engine=ManualCopyEngine()) as other,
    ):
        cache.release(cache.insert([1, 2, 3, 4], cache.alloc(4)))
        cache.release(cache.insert([7, 7, 8, 8], cache.alloc(4)))
        m = cache.match_prefix([1, 2, 3, 4, 5, 6])
        own = cache.alloc(2)
        events = cache.take_events()
        before = tree_state(cache)
        cases: list[tuple[dict[str, object], list[int], torch.Tensor, str]] = [
            # tokens that do not start with the match: the tree has no device run for them
            ({"prefix": m}, [9, 9, 3, 4, 5, 6], own, "do not extend"),
            # ... or it has one, of another prompt: the new rows were computed against m's
            # prefix, so under this one they would be wrong KV
            ({"prefix": m}, [7, 7, 8, 8, 5, 6], own, "do not extend"),
            ({"prefix": m}, [1, 2, 8, 8, 5, 6], own, "do not extend"),
            # slots that start inside a page, or past the match's device run (token 4)
            ({"prefix": m}, [1, 2, 3], own[:0], "start at token 3"),
            ({"prefix": m}, [1, 2, 3, 4, 5, 6, 7, 8], own, "start at token 6"),
            # more slots than tokens
            ({"prefix": m}, [1, 2, 3, 4, 5, 6], torch.cat([own, own, own, own]), "token -2"),
            # another tenant's namespace
            ({"prefix": m, "tenant": "t"}, [1, 2, 3, 4, 5, 6], own, "namespace"),
            # without prefix=, every token needs a slot
            ({}, [1, 2, 3, 4, 5, 6], own, "2 slots for 6 tokens"),
        ]
        for kwargs, toks, slots, words in cases:
            with pytest.raises(akv.InvalidInputError) as info:
                cache.insert(toks, slots, **kwargs)  # type: ignore[arg-type]
            assert words in str(info.value), info.value
            assert tree_state(cache) == before
        om = other.match_prefix([1, 2])
        with pytest.raises(akv.HandleError):
            cache.insert([1, 2, 3, 4, 5, 6], own, prefix=om)
        with pytest.raises(akv.InvalidTypeError):
            cache.insert([1, 2, 3, 4, 5, 6], own, prefix=object())  # type: ignore[arg-type]
        other.release(om)
        assert tree_state(cache) == before
        cache.release(m)
        before = tree_state(cache)
        with pytest.raises(akv.HandleError):  # released: its pin no longer holds the run
            cache.insert([1, 2, 3, 4, 5, 6], own, prefix=m)
        assert tree_state(cache) == before and cache.take_events() == [] and events
        m = cache.match_prefix([1, 2, 3, 4, 5, 6])
        cache.release(cache.insert([1, 2, 3, 4, 5, 6], own, prefix=m))  # still the caller's
        cache.release(m)
        engine.complete_all()
        await cache.flush()
        cache.check_invariants()


@pytest.mark.parametrize("seed", [int(os.environ.get("AKV_PREFIX_SEED", "0")), 1, 2, 3, 678266897])
async def test_lens_agrees_with_parts_in_every_tier_state(seed: int) -> None:
    """Seeded walk through inserts (both forms), evictions (device and host), write-through
    copies and load-backs left in flight, failed or released under: ``lens()`` must equal the
    tokens of ``parts()`` (the general rule) for every match, in every mix of
    RESIDENT/FILLING/ABSENT nodes, and every invariant hold after every step.  More seeds:
    ``AKV_PREFIX_SEED=<n>`` replaces seed 0."""
    rng = random.Random(seed)
    print(f"seed {seed}")  # shown with a failure
    engine = ManualCopyEngine()
    cfg = small_config(device_pages=24, host_pages=24)
    async with akv.HiCache(cfg, copy_engine=engine) as cache:
        held: list[akv.MatchResult | akv.InsertResult] = []
        loads: list[asyncio.Task[akv.MatchResult]] = []
        for step in range(1500):
            toks = [rng.randrange(3) for _ in range(rng.randrange(2, 13))]
            op = rng.random()
            try:
                if op < 0.3:
                    m = cache.match_prefix(toks)
                    dev, host = m.parts()
                    want = (sum(len(n.key) for n in dev), sum(len(n.key) for n in host))
                    assert m.lens() == want, f"seed {seed} step {step}: {m.lens()} != {want}"
                    assert (m.device_len, m.host_len) == want, f"seed {seed} step {step}"
                    if m.host_len and rng.random() < 0.7:
                        loads.append(asyncio.ensure_future(cache.load_back(m)))
                    held.append(m)
                elif op < 0.5:
                    m = cache.match_prefix(toks)
                    try:
                        own = cache.alloc(len(toks) - m.device_len)
                    except akv.CapacityError:
                        cache.release(m)
                        continue
                    dev = m.device_len
                    if rng.random() < 0.5:
                        r = cache.insert(toks, own[: len(toks) - dev], prefix=m)
                    else:
                        r = cache.insert(toks, torch.cat([m.device_indices, own])[: len(toks)])
                    tail = own[len(toks) // 2 * 2 - dev :]  # the unaligned tail's page
                    if tail.numel():
                        cache.free(tail)
                    held += [r, m]
                elif op < 0.65 and held:
                    cache.release(held.pop(rng.randrange(len(held))))
                elif op < 0.8:
                    cache.evict(rng.randrange(1, 6), rng.choice(["device", "device", "host"]))
                elif engine.pending:
                    if rng.random() < 0.8:
                        engine.complete(rng.randrange(len(engine.pending)))
                    else:
                        engine.fail(rng.randrange(len(engine.pending)))
            except akv.CapacityError:
                pass
            while len(held) > 6:  # few pins, so that evictions find victims
                cache.release(held.pop(rng.randrange(len(held))))
            await asyncio.sleep(0)
            cache.check_invariants()  # after every step (the loads ran meanwhile)
        for h in held:
            cache.release(h)
        engine.complete_all()
        await asyncio.gather(*loads, return_exceptions=True)
        await cache.flush()
        cache.check_invariants()


async def test_prefix_result_that_stopped_at_a_loading_node_survives_its_split() -> None:
    """An insert stopped after a node still loading back (its result's ``inserted_len``
    covers it); another request's match splits that node while it loads.  The next insert
    with ``prefix=`` that result skips to its ``inserted_len`` as before: both halves are
    the same load, so the walk goes on through them (it stopped at the first half, and the
    insert was refused as "tokens that do not extend the prefix": the batched interleaving
    test's rare failure)."""
    engine = ManualCopyEngine()
    cfg = small_config(write_policy="write_through")
    async with akv.HiCache(cfg, copy_engine=engine) as cache:
        x = [1, 2, 3, 4]  # one node of two pages
        first = cache.alloc(4)
        write_kv(cache, first, 0)
        r0 = cache.insert(x, first)
        engine.complete_all()
        await cache.flush()
        cache.release(r0)
        cache.evict(100)  # host-only now
        m = cache.match_prefix(x)
        load = asyncio.create_task(cache.load_back(m))
        await asyncio.sleep(0)  # its copy is submitted: the node is FILLING
        assert engine.pending
        rows = cache.alloc(4)
        write_kv(cache, rows, 0)
        r = cache.insert(x, rows)  # walks the loading node, takes nothing: rows retained
        assert r.inserted_len == 4 and r.retained_pages.numel() == 2
        m2 = cache.match_prefix(x[:2])  # splits the loading node in two
        assert m2.matched_len == 2
        more = cache.alloc(2)
        write_kv(cache, more, 1)
        r2 = cache.insert([*x, 5, 6], more, prefix=r)  # was: InvalidInputError
        assert r2.inserted_len == 4  # still loading: nothing hangs below it yet
        engine.complete_all()
        await load
        r3 = cache.insert([*x, 5, 6], more, prefix=r2)
        assert r3.inserted_len == 6
        for h in (m, m2, r, r2, r3):
            cache.release(h)
        engine.complete_all()
        await cache.flush()
        cache.check_invariants()


async def test_prefix_insert_keeps_to_the_device_run_a_window_cuts() -> None:
    """With a trailing-window component, a match's device run ends where every window is
    whole: a node whose device copy lacks the window's pages (it came from storage without
    them) is on the path but not in ``m.device_len``.  Slots starting past that run, at the
    path's end, are refused with nothing changed, as for any prefix."""
    async with akv.HiCache(component_cfg(host_pages=0)) as cache:
        toks = list(range(100, 116))
        cache.release(cache.insert(toks[:8], cache.alloc(8)))
        m0 = cache.match_prefix(toks)
        cache.release(cache.insert(toks, torch.cat([m0.device_indices, cache.alloc(8)])))
        cache.release(m0)
        m = cache.match_prefix(toks)
        assert m.device_len == 16
        window = next(c.name for c in cache.config.components if c.window_pages(2))
        m.node.invalid = frozenset({window})  # as if loaded from storage without it
        m.node.device_complete = False
        assert m.device_len == 8  # the window at token 16 lacks pages: the run ends at 8
        own = cache.alloc(4)
        before = tree_state(cache)
        with pytest.raises(akv.InvalidInputError, match="page boundary"):
            cache.insert([*toks, 1, 2, 3, 4], own, prefix=m)
        assert tree_state(cache) == before
        r = cache.insert([*toks, 1, 2, 3, 4], torch.cat([cache.alloc(8), own]), prefix=m)
        assert r.inserted_len == 20
        cache.release(r)
        cache.release(m)
        cache.check_invariants()


async def test_slots_restrided_in_place_insert_the_rows_they_name() -> None:
    """A slot tensor from ``alloc`` restrided in place (``as_strided_``: the same data
    pointer, other elements) inserts the rows it now names, as a fresh tensor with those
    values would; one reshaped to 2-D in place (``unsqueeze_``) is refused as any 2-D
    tensor is, nothing changed.  (The allocator's table of handed-out tensors must not
    hand back the array behind the original shape.)"""
    async with (
        akv.HiCache(small_config(device_pages=16, host_pages=0, page_size=1)) as a,
        akv.HiCache(small_config(device_pages=16, host_pages=0, page_size=1)) as b,
    ):
        toks = [5, 6, 7, 8]
        sa, sb = a.alloc(8), b.alloc(8)
        sa.as_strided_((4,), (2,))  # rows 0, 2, 4, 6 of the allocation
        fresh = sb[::2].clone()
        ra, rb = a.insert(toks, sa), b.insert(toks, fresh)
        ma, mb = a.match_prefix(toks), b.match_prefix(toks)
        assert ma.device_indices.tolist() == mb.device_indices.tolist() == sa.tolist()
        for c, h in ((a, ra), (a, ma), (b, rb), (b, mb)):
            c.release(h)
        flat = a.alloc(2)
        flat.unsqueeze_(0)
        before = tree_state(a)
        with pytest.raises(akv.InvalidInputError):
            a.insert([1, 2], flat)
        assert tree_state(a) == before
        a.free(flat.squeeze_(0))
        a.free(torch.tensor([r for r in range(16) if r % 2 and r < 8]))  # 1, 3, 5, 7
        a.check_invariants()
