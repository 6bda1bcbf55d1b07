"""Seeded random interleavings of a continuous-batching loop's requests on one cache.

A few tasks play requests with shared prefixes: match, maybe load the host part back (bounded
wait), then compute in chunks (prefill) and single tokens (decode), allocating rows with
bounded waits, inserting every completed page either with the previous handle as the prefix
or with all their own rows, and releasing older handles as they go.  Beside them, one task
evicts and one lands copies in random order.  Every request keeps reading its own rows (those
the tree gave it and those it computed): the KV there must stay what was written for those
tokens, whatever the others allocate meanwhile.  ``check_invariants`` holds after every step,
and at the end every page of both pools is free again.  ``AKV_BATCH_SEED=<n>`` adds a seed
(the seed fixes every choice; the clock-bounded waits make the interleaving vary a little).
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

P = 2
DEVICE_PAGES, HOST_PAGES = 24, 32
BASES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [7, 8, 7, 8, 7, 8]]


def value(tenant: str | None, seq: list[int], i: int) -> float:
    """The KV a model would write for token ``i`` of ``seq``: a function of its prefix."""
    return float(hash((tenant, tuple(seq[: i + 1]))) % 1_000_003)


class Run:
    def __init__(self, cache: akv.HiCache, rng: random.Random) -> None:
        self.cache = cache
        self.rng = rng
        self.stop = False
        self.inserts = self.prefix_inserts = self.retaining = self.waits_timed_out = 0

    def write(self, rows: torch.Tensor, tenant: str | None, seq: list[int], a: int, b: int) -> None:
        k, _ = self.cache.device_kv(0)
        k[rows[a:b], 0, 0] = torch.tensor([value(tenant, seq, i) for i in range(a, b)])

    def check(self, rows: torch.Tensor, tenant: str | None, seq: list[int], n: int) -> None:
        k, _ = self.cache.device_kv(0)
        got = k[rows[:n], 0, 0].tolist()
        want = [value(tenant, seq, i) for i in range(n)]
        assert got == want, f"a request's rows changed under it: {got} != {want}"

    async def request(self, seq: list[int], tenant: str | None) -> None:
        cache, rng = self.cache, self.rng
        m = cache.match_prefix(seq, tenant=tenant)
        live: list[akv.MatchResult | akv.InsertResult] = [m]
        rows = torch.empty(0, dtype=torch.int64)
        inserted = 0
        try:
            if m.host_len and rng.random() < 0.6:
                try:
                    await cache.load_back(m, timeout=rng.choice([0, 0.002, 0.01]))
                except akv.CapacityError:
                    self.waits_timed_out += 1
            dev = m.device_len
            rows = m.device_indices  # the tree's rows, held by m's pin
            self.check(rows, tenant, seq, dev)
            done = inserted = dev
            prev: akv.MatchResult | akv.InsertResult = m
            while done < len(seq):
                chunk = min(rng.choice([1, 1, 2, 3, 5]), len(seq) - done)
                need = done + chunk - rows.numel()
                if need > 0:
                    try:
                        if rng.random() < 0.8:
                            t = rng.choice([0, 0.001, 0.005, 0.02, 0.05])
                            new = await cache.alloc_wait(need, timeout=t)
                        else:
                            new = cache.alloc(need)
                    except akv.CapacityError:
                        self.waits_timed_out += 1
                        return  # preempted: give everything back
                    rows = torch.cat([rows, new])
                self.write(rows, tenant, seq, done, done + chunk)
                done += chunk
                k = done // P * P
                if k > inserted:
                    if rng.random() < 0.6:
                        start = inserted if prev is m else prev.inserted_len  # type: ignore[union-attr]
                        r = cache.insert(seq[:k], rows[start:k], prefix=prev, tenant=tenant)
                        self.prefix_inserts += 1
                    else:
                        r = cache.insert(seq[:k], rows[:k], tenant=tenant)
                    self.inserts += 1
                    self.retaining += r.retained_pages.numel() > 0
                    live.append(r)
                    inserted, prev = k, r
                    if rng.random() < 0.7:  # the loop lets the older handles go
                        for h in live[:-1]:
                            if h is not m or rng.random() < 0.5:
                                cache.release(h)
                                live.remove(h)
                    cache.check_invariants()
                await asyncio.sleep(0)
                self.check(rows, tenant, seq, done)
        finally:
            if rows.numel() > inserted:
                cache.free(rows[inserted:])  # allocated, never inserted: still HELD
            rng.shuffle(live)
            for h in live:
                cache.release(h)
            cache.check_invariants()

    async def client(self, n: int) -> None:
        rng = self.rng
        for _ in range(n):
            base = rng.choice(BASES)
            seq = base[: rng.randrange(2, len(base) + 1)] if rng.random() < 0.3 else base
            seq = seq + [rng.randrange(3) for _ in range(rng.randrange(0, 12))]
            await self.request(seq, rng.choice([None, None, "t"]))
            await asyncio.sleep(0)

    async def evictor(self) -> None:
        while not self.stop:
            n = self.rng.choice([1, 2, 3, 3, DEVICE_PAGES])  # now and then: all it can
            self.cache.evict(n, self.rng.choice(["device", "device", "host"]))
            self.cache.check_invariants()
            await asyncio.sleep(self.rng.choice([0, 0.001]))

    async def copier(self, engine: ManualCopyEngine) -> None:
        while not self.stop:
            for _ in range(self.rng.choice([1, 2, 8])):
                if engine.pending:
                    engine.complete(self.rng.randrange(len(engine.pending)))
            await asyncio.sleep(self.rng.choice([0, 0, 0.001]))


@pytest.mark.parametrize("seed", [int(os.environ.get("AKV_BATCH_SEED", "0")), 1, 2, 3, 4])
async def test_batched_requests_interleave_safely(seed: int) -> None:
    print(f"seed {seed}")  # shown with a failure
    engine = ManualCopyEngine()
    cfg = small_config(device_pages=DEVICE_PAGES, host_pages=HOST_PAGES)
    async with akv.HiCache(cfg, copy_engine=engine) as cache:
        run = Run(cache, random.Random(seed))
        helpers = [asyncio.ensure_future(run.evictor()), asyncio.ensure_future(run.copier(engine))]
        await asyncio.wait_for(asyncio.gather(*(run.client(12) for _ in range(4))), 60)
        run.stop = True
        await asyncio.gather(*helpers)
        assert run.inserts > 20 and run.prefix_inserts > 5, vars(run)
        engine.complete_all()
        await cache.flush()
        cache.check_invariants()
        st = cache.statistics()
        assert st.device.retained_pages == st.device.held_pages == st.device.protected_pages == 0
        cache.evict(1 << 20, "device")
        cache.evict(1 << 20, "host")
        cache.check_invariants()
        st = cache.statistics()
        assert st.device.free_pages == DEVICE_PAGES and st.host.free_pages == HOST_PAGES, st
        assert len(cache._waiters) == 0
