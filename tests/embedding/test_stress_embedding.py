"""Seeded stress test of the embedding cache: two nodes, one faulty store, cancelled callers.

Tasks on two ``EmbeddingCache`` nodes (small pools: eviction all the time) insert and get
overlapping batches; some callers are cancelled at a random await.  The store (the in-memory
Mooncake client under the real ``MooncakeStorage`` logic) delays every call, stalls some past
the cache's deadline (late completions), refuses some puts and reads, and after a put
sometimes flips a byte of a stored object or drops one.

What must hold: a get returns ``None`` or exactly the tensor inserted under that hash, never
another's bytes and never damaged ones; afterwards nothing is left pinned, filling or in a
lookup, the invariants hold, and evicting everything returns the whole pool.

    pytest tests/embedding/test_stress_embedding.py                 # the fixed seeds
    AKV_EMB_STRESS_SEED=123 pytest tests/embedding/test_stress_embedding.py
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Awaitable
from typing import Any

import pytest
import torch

from aiocache_kv.embedding import EmbeddingCache
from aiocache_kv.testing import ChaosMooncakeClient

from .fakes import FakeMooncakeStorage

DIM = 8
HASHES = [f"image-{i}" for i in range(24)]


def embedding(h: str) -> torch.Tensor:
    """The tensor inserted under hash ``h`` (its own length and values)."""
    i = HASHES.index(h)
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(1 + i % 6, DIM, generator=g)


def node(client: ChaosMooncakeClient, pool: int) -> EmbeddingCache:
    store = FakeMooncakeStorage()
    store.client = client
    return EmbeddingCache(pool_bytes=pool, store=store, namespace="stress", timeout=0.1)


async def maybe_cancel(rng: random.Random, aw: Awaitable[Any]) -> Any:
    """Await ``aw`` in a task; sometimes cancel it after a random short time."""
    task = asyncio.ensure_future(aw)
    if rng.random() < 0.25:
        await asyncio.wait([task], timeout=rng.uniform(0, 0.01))
        task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        return None


async def run(seed: int) -> list[str]:
    """One seeded run; the failures it found."""
    failures: list[str] = []
    client = ChaosMooncakeClient(seed)
    rng = random.Random(seed)
    async with node(client, 5 * 512) as a, node(client, 3 * 512) as b:

        async def worker(cache: EmbeddingCache, wseed: int) -> None:
            r = random.Random(wseed)
            for _ in range(12):
                pick = r.sample(HASHES, r.randint(1, 4))
                if r.random() < 0.45:
                    st = await maybe_cancel(
                        r, cache.insert_batch(pick, [embedding(h) for h in pick])
                    )
                    if st is not None and st.new + st.local_hit + st.skipped != len(pick):
                        failures.append(f"insert of {pick} counted {st}")
                else:
                    got = await maybe_cancel(r, cache.get_batch(pick))
                    for h, t in zip(pick, got or [None] * len(pick), strict=True):
                        if t is not None and not torch.equal(t, embedding(h)):
                            failures.append(f"get {h} returned other bytes ({tuple(t.shape)})")
                if r.random() < 0.2:
                    cache.evict(r.randint(1, 3) * 512)
                await asyncio.sleep(r.uniform(0, 0.002))

        tasks = [worker(b if i % 3 == 0 else a, rng.randrange(1 << 30)) for i in range(16)]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        failures += [f"worker raised {r!r}" for r in results if isinstance(r, BaseException)]
        await asyncio.sleep(0.4)  # past every stall: late workers hand their slots back
        for name, cache in (("a", a), ("b", b)):
            for _ in range(50):
                if not cache.statistics().cleanups_pending:
                    break
                await asyncio.sleep(0.02)
            try:
                cache.check_invariants()
            except AssertionError as exc:
                failures.append(f"node {name}: {exc}")
            s = cache.statistics()
            if s.pinned or s.filling or s.lookup or s.cleanups_pending:
                failures.append(f"node {name}: left pinned/filling/lookup/cleanups: {s}")
            cache.evict()
            s = cache.statistics()
            if s.entries or s.free_bytes != s.pool_bytes:
                failures.append(f"node {name}: evicting everything left {s}")
    return failures


SEEDS = (
    [int(os.environ["AKV_EMB_STRESS_SEED"])]
    if "AKV_EMB_STRESS_SEED" in os.environ
    else [
        1,
        2,
        3,
        4,
    ]
)


@pytest.mark.parametrize("seed", SEEDS)
async def test_embedding_cache_under_faults_and_cancellation(seed: int) -> None:
    failures = await run(seed)
    assert not failures, f"embedding stress seed {seed} FAILED:\n  " + "\n  ".join(failures[:10])
