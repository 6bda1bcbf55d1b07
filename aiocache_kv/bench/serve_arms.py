"""The arms of ``aiocache-kv bench serve`` and the paced multi-turn driver they share.

:func:`paced_drive` sends a :class:`~aiocache_kv.bench.engine_sides.Workload` the way SGLang's
``benchmark/hicache/bench_multiturn.py`` does: each client's first turn arrives by a Poisson
process (``request_rate`` per second; ``inf``: all at once), each next turn is sent when the
previous reply arrived (its history grows by the reply and a new user message), at most
``max_in_flight`` requests are outstanding, and with ``round_barrier`` no client starts round
``r + 1`` before every client finished round ``r``.

The engine arms serve it through :class:`~aiocache_kv.serving.Engine` over caches that differ
only in their tiers (:data:`ARMS`); the ``transformers`` arm is
:func:`~aiocache_kv.bench.engine_sides.serve_transformers` under the same driver.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from aiocache_kv.bench import SERVE_ARMS
from aiocache_kv.bench.engine_sides import (
    Served,
    SideRun,
    Turn,
    Workload,
    serve_transformers,
)
from aiocache_kv.cache import HiCache
from aiocache_kv.config import CacheConfig
from aiocache_kv.serving import Engine

__all__ = [
    "ARMS",
    "ENGINE_ARMS",
    "Pacing",
    "Tiered",
    "paced_drive",
    "serve_engine_arm",
    "serve_transformers_arm",
]

#: every arm, in the order they run, with what it is
ARMS = {
    "no-cache": "engine, no prefix reuse: every request in its own tenant namespace, no host tier",
    "device": "engine, radix reuse on device only (host_pages=0): plain prefix caching",
    "device+host": "engine, device + host tiers (HiCache L2, write-through)",
    "device+host+storage": "engine, device + host + FileStorage (L3) in a temp dir",
    "storage-restart": "engine, a fresh cache over the previous arm's storage dir, whole "
    "workload replayed (warm only from storage)",
    "transformers": "transformers' continuous batching with its prefix sharing",
}
ENGINE_ARMS = tuple(a for a in ARMS if a != "transformers")
assert tuple(ARMS) == SERVE_ARMS  # the CLI's choices (listed without importing this module)
#: arms whose cache needs a host tier / a storage directory
HOST_ARMS = ("device+host", "device+host+storage", "storage-restart")
STORAGE_ARMS = ("device+host+storage", "storage-restart")

Serve = Callable[[list[int]], Awaitable[Served]]


@dataclasses.dataclass(frozen=True)
class Tiered(Served):
    """A reply with its prompt's reuse split by tier (``reused == device + host + storage``)."""

    device: int = 0
    host: int = 0
    storage: int = 0


def tiers(s: Served) -> tuple[int, int, int]:
    """(device, host, storage) reused prompt tokens of ``s`` (untiered reuse counts as device:
    ``transformers`` and OpenAI servers report one number)."""
    if isinstance(s, Tiered):
        return s.device, s.host, s.storage
    return s.reused, 0, 0


@dataclasses.dataclass(frozen=True)
class Pacing:
    """How :func:`paced_drive` sends the workload."""

    max_in_flight: int = 16
    request_rate: float = math.inf  #: clients' first turns per second (Poisson); inf: at once
    round_barrier: bool = False
    seed: int = 0


async def paced_drive(
    wl: Workload,
    serve: Serve,
    pacing: Pacing,
    on_done: Callable[[Turn], None] | None = None,
) -> list[Turn]:
    """Send ``wl`` through ``serve`` paced by ``pacing``; the turns in (client, round) order."""
    clients = len(wl.users)
    rng = random.Random(pacing.seed)
    starts = [0.0] * clients
    if math.isfinite(pacing.request_rate) and pacing.request_rate > 0:
        starts = list(itertools.accumulate(rng.expovariate(pacing.request_rate) for _ in starts))
    slots = asyncio.Semaphore(pacing.max_in_flight)
    barrier = _Barrier(clients) if pacing.round_barrier else None
    done: list[list[Turn]] = [[] for _ in wl.users]
    t0 = time.perf_counter()

    async def client(c: int) -> None:
        await asyncio.sleep(max(0.0, t0 + starts[c] - time.perf_counter()))
        history = list(wl.system)
        for t, user in enumerate(wl.users[c]):
            prompt = history + user
            async with slots:
                s = await serve(prompt)
            turn = Turn(c, t, len(prompt), s)
            done[c].append(turn)
            if on_done is not None:
                on_done(turn)
            history = prompt + s.tokens
            if barrier is not None:
                await barrier.wait()

    async with anyio.create_task_group() as tg:
        for c in range(clients):
            tg.start_soon(client, c)
    return [t for turns in done for t in turns]


class _Barrier:
    """``n`` tasks wait until all ``n`` arrived, again and again (``asyncio.Barrier`` is 3.11+)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.count = 0
        self.event = asyncio.Event()

    async def wait(self) -> None:
        event = self.event
        self.count += 1
        if self.count == self.n:
            self.count = 0
            self.event = asyncio.Event()
            event.set()
        else:
            await event.wait()


def engine_serve(engine: Engine, reply_tokens: int, *, isolate: bool = False) -> Serve:
    """``serve`` over ``engine``; with ``isolate`` each request gets its own tenant (its own
    key namespace), so nothing is ever reused across requests."""
    ids = itertools.count()

    async def serve(prompt: list[int]) -> Served:
        tenant = f"no-reuse-{next(ids)}" if isolate else None
        r = await engine.generate(prompt, max_new_tokens=reply_tokens, tenant=tenant)
        a = r.attribution
        return Tiered(
            r.tokens, r.ttft, r.itl, r.total, a.cached, a.computed, a.device, a.host, a.storage
        )

    return serve


async def serve_engine_arm(
    arm: str,
    model: Any,
    wl: Workload,
    cfg: CacheConfig,
    pacing: Pacing,
    *,
    max_batch_tokens: int,
    max_running: int,
    on_done: Callable[[Turn], None] | None = None,
) -> SideRun:
    """One engine arm: a warm-up request (untimed; the restart arm skips it, so its cache
    starts empty but for storage), then the paced workload.  With a storage tier the cache
    is flushed before it closes (every backup landed, for the restart arm)."""
    async with HiCache(cfg) as cache:
        async with Engine(
            model, cache, max_batch_tokens=max_batch_tokens, max_running=max_running
        ) as engine:
            if arm != "storage-restart":
                await engine.generate(wl.warmup, max_new_tokens=wl.reply_tokens)
            before = engine.statistics()
            serve = engine_serve(engine, wl.reply_tokens, isolate=arm == "no-cache")
            t0 = time.perf_counter()
            turns = await paced_drive(wl, serve, pacing, on_done)
            wall = time.perf_counter() - t0
            after = engine.statistics()
        if cfg.storage is not None:
            await cache.flush()
    extra = {
        "steps": after.steps - before.steps,
        "preemptions": after.preemptions - before.preemptions,
        "shared_in_flight_tokens": after.shared_in_flight_tokens - before.shared_in_flight_tokens,
    }
    return SideRun(turns=turns, wall=wall, extra=extra)


async def serve_transformers_arm(
    model: Any,
    wl: Workload,
    pacing: Pacing,
    *,
    page_size: int,
    num_blocks: int,
    max_batch_tokens: int,
    max_requests: int,
    attn_implementation: str,
    on_done: Callable[[Turn], None] | None = None,
) -> SideRun:
    """``transformers``' continuous batching (prefix sharing on) under :func:`paced_drive`."""

    async def driver(w: Workload, serve: Serve) -> list[Turn]:
        return await paced_drive(w, serve, pacing, on_done)

    return await serve_transformers(
        model,
        wl,
        page_size=page_size,
        num_blocks=num_blocks,
        max_batch_tokens=max_batch_tokens,
        max_requests=max_requests,
        attn_implementation=attn_implementation,
        driver=driver,
    )
