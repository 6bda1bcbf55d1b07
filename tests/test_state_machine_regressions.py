"""Deterministic regressions for failures the state machine (``test_state_machine.py``) found.

Each one is an explicit sequence of steps: no hypothesis draws, so it runs the same way on every
machine and in well under a second.
"""

from __future__ import annotations

import asyncio

import pytest

import aiocache_kv as akv
from aiocache_kv.errors import TransferError
from aiocache_kv.testing import ManualCopyEngine
from tests.conftest import small_config
from tests.test_state_machine import HiCacheMachine, WriteBackP1


def _replay(machine: HiCacheMachine, steps: list[tuple[str, dict[str, object]]]) -> None:
    """Run rules by hand, with every invariant after each, then the teardown (leak check)."""
    try:
        for name, kwargs in steps:
            getattr(machine, name)(**kwargs)
            machine.cache_invariants()
            machine.events_agree_with_tiers()
            machine.handles_keep_their_prefix_and_data()
    finally:
        machine.teardown()


def test_machine_insert_under_loading_node() -> None:
    """``--hypothesis-seed=7``, ``TestWriteBackP1``: an insert that meets a node whose load-back
    is in flight caches up to that node (``inserted_len=1``); the model expected all of it."""
    _replay(
        WriteBackP1(),
        [
            ("insert", dict(toks=[1], tenant="tenant-b", keep=False)),
            ("evict", dict(tier="device", n=1)),  # write-back: staged to host
            ("finish_copy", dict(i=0, ok=True)),  # landed: [1] is host-only
            ("match", dict(toks=[1], tenant="tenant-b")),  # a host hit
            ("start_load_back", dict(i=0, start=True)),  # [1] is device FILLING
            ("insert", dict(toks=[1, 0], tenant="tenant-b", keep=False)),  # stops after [1]
            ("await_load_back", dict(i=0, order=[])),
            ("insert", dict(toks=[1, 0], tenant="tenant-b", keep=False)),  # now all of it
            ("match", dict(toks=[1, 0], tenant="tenant-b")),
        ],
    )


def test_machine_seed7_shrunk() -> None:
    """The same failure as hypothesis shrank it from ``--hypothesis-seed=7`` (20 examples): the
    load-back of ``[1]`` in tenant-b is still in flight at the last insert."""
    _replay(
        WriteBackP1(),
        [
            ("insert", dict(keep=False, tenant=None, toks=[0, 0, 0, 0, 0, 0, 0])),
            ("insert", dict(keep=False, tenant="tenant-b", toks=[1, 0])),
            ("insert", dict(keep=False, tenant=None, toks=[0, 0, 0, 0])),
            ("match", dict(tenant=None, toks=[0])),
            ("release", dict(i=0)),
            # (the insert above staged one victim; it used to stage every idle page, tenant-b's
            # [1, 0] too: stage it by hand, so [1] is host-only as when this was found)
            ("evict", dict(tier="device", n=2)),
            ("finish_copy", dict(i=1, ok=True)),
            ("match", dict(tenant="tenant-b", toks=[1])),
            ("same_tokens_both_tenants", dict(base=0)),
            ("match", dict(tenant=None, toks=[0])),
            ("start_load_back", dict(i=0, start=False)),
            ("finish_copy", dict(i=0, ok=True)),
            ("release", dict(i=0)),
            ("insert", dict(keep=False, tenant="tenant-b", toks=[1, 0])),  # inserted_len=1
        ],
    )


def test_machine_prefix_len_under_loading_node() -> None:
    """Explorer, ``--hypothesis-seed=19``: an insert that stops at a loading node reports
    ``prefix_len`` up to there only, though a live match pins more of the same tokens; the
    model took that match as a lower bound."""
    _replay(
        WriteBackP1(),
        [
            ("insert", dict(toks=[2, 1, 0], tenant=None, keep=False)),
            ("evict", dict(tier="device", n=3)),  # write-back: staged to host
            ("finish_copy", dict(i=0, ok=True)),  # [2, 1, 0] is host-only
            ("match", dict(toks=[2], tenant=None)),  # splits it: [2] -> [1, 0]
            ("start_load_back", dict(i=0, start=True)),  # [2] is device FILLING
            ("match", dict(toks=[2, 1, 0], tenant=None)),  # pins all three
            ("insert", dict(toks=[2, 1, 0, 0], tenant=None, keep=False)),  # prefix_len 1
        ],
    )


async def test_insert_under_loading_node_caches_up_to_it() -> None:
    """The cache side of the same sequence, including a load-back node that the insert
    splits: the insert keeps the path up to the loading node (or the part of it the tokens
    share), retains the caller's pages after it (and its copies of the loading pages) until
    the result is released, and caches all of it once the load landed."""
    engine = ManualCopyEngine()
    cfg = small_config(page_size=1, write_policy="write_back")
    async with akv.HiCache(cfg, copy_engine=engine) as cache:
        total = cache.statistics().device.free_pages
        cache.release(cache.insert([1, 2], cache.alloc(2), tenant="t"))
        assert cache.evict(2, "device") == 0  # write-back: staged, freed when it lands
        engine.complete_all()
        assert cache.statistics().device.free_pages == total  # [1, 2] is host-only
        m = cache.match_prefix([1, 2], tenant="t")
        assert (m.device_len, m.host_len) == (0, 2)
        task = asyncio.create_task(cache.load_back(m))
        await asyncio.sleep(0)  # load-back submitted: [1, 2] is device FILLING

        r = cache.insert([1, 0, 0], cache.alloc(3), tenant="t")  # splits the loading node
        assert (r.prefix_len, r.inserted_len) == (1, 1)
        # the walk goes on through [2], the other half of the same load, and stops there
        r2 = cache.insert([1, 2, 0], cache.alloc(3), tenant="t")
        assert (r2.prefix_len, r2.inserted_len) == (2, 2)
        s = cache.statistics().device
        assert s.held_pages == 0  # the caller's pages the tree did not take are retained
        assert s.retained_pages == 6 and r.retained_pages.numel() == 3
        assert s.free_pages == total - 2 - 6  # the load-back's destination pages, and those
        cache.check_invariants()
        m2 = cache.match_prefix([1, 0, 0], tenant="t")
        assert m2.matched_len == 1

        engine.complete(0)
        assert await task is m
        assert (m.device_len, m.host_len) == (2, 0)
        r3 = cache.insert([1, 0, 0], cache.alloc(3), tenant="t")
        assert (r3.prefix_len, r3.inserted_len) == (1, 3)
        cache.check_invariants()
        for h in (m, m2, r, r2, r3):
            cache.release(h)
        assert cache.statistics().device.retained_pages == 0
        cache.check_invariants()


async def test_failed_load_back_under_a_second_load_back() -> None:
    """Explorer, ``--hypothesis-seed=19``, ``TestWriteBackP1``: a second ``load_back`` whose
    match reaches below a node still loading for the first started its own copy of the child
    right away; when the first copy failed, the parent went back to host-only with a device
    child (``device-absent node with device children``)."""
    engine = ManualCopyEngine()
    async with akv.HiCache(small_config(page_size=1), copy_engine=engine) as cache:
        total = cache.statistics().device.free_pages
        cache.release(cache.insert([0], cache.alloc(1)))
        cache.release(cache.insert([0, 1], cache.alloc(2)))
        engine.complete_all()  # write-through: [0] and [0]->[1] on device and host
        assert cache.evict(2, "device") == 2  # both host-only
        m1 = cache.match_prefix([0])
        t1 = asyncio.create_task(cache.load_back(m1))
        await asyncio.sleep(0)  # [0] is device FILLING
        m2 = cache.match_prefix([0, 1])
        assert (m2.device_len, m2.host_len) == (0, 2)
        t2 = asyncio.create_task(cache.load_back(m2))
        await asyncio.sleep(0)
        cache.check_invariants()
        engine.fail(0)  # the load of [0] fails
        cache.check_invariants()
        with pytest.raises(TransferError):
            await t1
        with pytest.raises(TransferError):
            await t2
        engine.complete_all()
        await asyncio.sleep(0)
        cache.check_invariants()
        assert (m2.device_len, m2.host_len) == (0, 2)  # back to host-only, both
        cache.release(m1)
        cache.release(m2)
        assert cache.evict(1 << 30, "device") == 0
        assert cache.statistics().device.free_pages == total  # no page leaked


async def test_load_back_below_a_loading_node_loads_the_rest_once_it_landed() -> None:
    """The same two load-backs when the first copy succeeds: the second one copies the child
    after it, and then reports the whole match on device."""
    engine = ManualCopyEngine()
    async with akv.HiCache(small_config(page_size=1), copy_engine=engine) as cache:
        cache.release(cache.insert([0], cache.alloc(1)))
        cache.release(cache.insert([0, 1], cache.alloc(2)))
        engine.complete_all()
        assert cache.evict(2, "device") == 2
        m1 = cache.match_prefix([0])
        t1 = asyncio.create_task(cache.load_back(m1))
        await asyncio.sleep(0)
        m2 = cache.match_prefix([0, 1])
        t2 = asyncio.create_task(cache.load_back(m2))
        await asyncio.sleep(0)
        assert len(engine.pending) == 1  # only [0]: [1] waits for it
        engine.complete(0)
        assert await t1 is m1
        await asyncio.sleep(0)
        assert len(engine.pending) == 1  # now [1]
        cache.check_invariants()
        engine.complete(0)
        assert await t2 is m2
        assert (m2.device_len, m2.host_len) == (2, 0)
        cache.check_invariants()
        cache.release(m1)
        cache.release(m2)
