"""Seeded randomized stress test: many concurrent requests against one CPU ``HiCache``.

Each seed builds a small scenario (page size 1 or 2, tiny pools so that eviction happens all
the time, one of the three write policies) over a slow and flaky :class:`MemoryStorage`, and a
copy engine that completes copies out of order and sometimes fails them.  Concurrent request
tasks do prefetch / match_prefix / load_back / alloc or alloc_wait / insert / write-through
waits / release, with cancellation at random await points; a chaos task evicts, flushes, checks
invariants and cancels whole requests.  Three tenants share the same prompt prefixes.

KV content is a pure function of (tenant, token prefix): the row written for position ``i`` is
derived from a rolling hash of ``(tenant, tokens[: i + 1])``.  Every row a match serves
(``m.device_indices`` into ``device_kv``) is compared with it, as is every page the storage
holds (its raw payload), and every page a fresh cache reads back from the same storage.

Variants: over the real ``FileStorage`` (room for ~40 pages), over one whose files another
process damages while the cache runs, over the real ``MooncakeStorage`` logic on a chaotic
in-memory client, with a hybrid model's sidecars (SWA window, Mamba state, DSA indexer)
written, checked and stored beside the KV, and closed at a random moment with requests in
flight.

At the end: flush, check_invariants, full eviction returns every page, KV events balance per
medium (GPU/CPU empty after eviction; STORAGE consistent with the store's contents; a few
claimed pages then evicted silently, and every claim the store no longer backs retracted once a
prefetch has asked for it), and a fresh cache on the same storage serves the stored prefixes
bit-identically.

Running it::

    pytest tests/test_stress.py                       # the fixed seeds (a few seconds each)
    pytest tests/test_stress.py --stress-seed 1234    # one seed (or AKV_STRESS_SEED=1234)
    AKV_STRESS_SEEDS=1000 AKV_STRESS_START=0 pytest tests/test_stress.py   # a sweep
    AKV_STRESS_REQUESTS=200 ...                        # more requests per seed (default 150)
    AKV_STRESS_MIDRUN_INVARIANTS=0 ...                 # diagnostic: no check_invariants mid-run

A failure message starts with the seed and ends with the last operations of the run.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
import os
import random
import time
import zlib
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

import aiocache_kv as akv
from aiocache_kv.errors import CapacityError, TransferError
from aiocache_kv.events import AllBlocksCleared, BlockRemoved, BlockStored
from aiocache_kv.handles import HandleState, InsertResult, MatchResult
from aiocache_kv.namespace import Namespace
from aiocache_kv.storage import integrity
from aiocache_kv.storage.key_layout import key_components
from aiocache_kv.storage.keys import storage_key
from aiocache_kv.testing import ChaosMooncakeClient, MemoryStorage
from aiocache_kv.transfer.engine import CopyJob, Done
from aiocache_kv.tree.hashing import chain_hashes, namespace_seed
from aiocache_kv.tree.node import lacking
from tests.conftest import small_config
from tests.stress_stores import OracleFileStorage, OracleMooncakeStorage, Store, intact

T = TypeVar("T")


# every (page size, write policy) pair; 3, 5, 12 and 22 also stall storage and fail copies
FIXED_SEEDS = [1, 2, 3, 4, 5, 7, 12, 22]
TENANTS = [None, "tenant-a", "tenant-b"]
POLICIES = ["write_through", "write_through_selective", "write_back"]
LAYERS, HEADS, HEAD_DIM = 2, 1, 4
MODEL = "stress"


def _seeds() -> list[int]:
    one = os.environ.get("AKV_STRESS_SEED")
    if one:
        return [int(one)]
    count = os.environ.get("AKV_STRESS_SEEDS")
    if count:
        start = int(os.environ.get("AKV_STRESS_START", "0"))
        return list(range(start, start + int(count)))
    return FIXED_SEEDS


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "stress_seed" in metafunc.fixturenames:
        opt = metafunc.config.getoption("--stress-seed", default=None)
        seeds = [int(opt)] if opt is not None else _seeds()
        metafunc.parametrize("stress_seed", seeds, ids=[f"seed{s}" for s in seeds])


# ---------------------------------------------------------------------------- the KV oracle


def _tenant_seed(tenant: str | None) -> int:
    return zlib.crc32((tenant or "").encode()) + 1


_OFFSETS = torch.arange(HEADS * HEAD_DIM, dtype=torch.float32).view(HEADS, HEAD_DIM) / 64


def expected_kv(tenant: str | None, tokens: list[int]) -> torch.Tensor:
    """``[layers, 2, len(tokens), heads, head_dim]``: row ``i`` depends on ``tokens[: i + 1]``."""
    h = _tenant_seed(tenant)
    vals = []
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % (1 << 61)
        vals.append((h % 4093) / 8)  # exact in float32
    base = torch.tensor(vals, dtype=torch.float32).view(1, 1, -1, 1, 1)
    layer = torch.arange(LAYERS, dtype=torch.float32).view(-1, 1, 1, 1, 1) * 1024
    kv = torch.tensor([0.0, 512.0]).view(1, 2, 1, 1, 1)
    return base + layer + kv + _OFFSETS


def write_rows(cache: akv.HiCache, slots: torch.Tensor, kv: torch.Tensor) -> None:
    for layer in range(LAYERS):
        k, v = cache.device_kv(layer)
        k[slots] = kv[layer, 0]
        v[slots] = kv[layer, 1]


def read_rows(cache: akv.HiCache, slots: torch.Tensor) -> torch.Tensor:
    rows = []
    for layer in range(LAYERS):
        k, v = cache.device_kv(layer)
        rows.append(torch.stack([k[slots], v[slots]]))
    return torch.stack(rows)


def page_payload(
    tenant: str | None, prefix: list[int], page_size: int, comp: akv.Component | None = None
) -> bytes:
    """Host-pool payload bytes of the last page of ``prefix``: ``[layers, 2, page_elems]``
    (of component ``comp``'s pool: its page state, if given)."""
    if comp is not None:
        return expected_sidecar(comp, tenant, prefix).numpy().tobytes()
    kv = expected_kv(tenant, prefix)[:, :, -page_size:]
    return kv.reshape(LAYERS, 2, -1).contiguous().numpy().tobytes()


def component_key(run: Run, comp: akv.Component | None) -> str:
    """The key component the cache stores the KV (``None``) or ``comp``'s pages under."""
    cfg = run.cache.config
    names = key_components(cfg)
    return names[0] if comp is None else names[1 + cfg.components.index(comp)]


def stress_components(page_size: int) -> tuple[akv.Component, ...]:
    """The sidecars of the hybrid variant: a 3-token sliding window (2 pages at page size 2,
    3 at 1), the Mamba state at the prefix end (1 page), the indexer (every page)."""
    return (
        akv.SlidingWindow(
            3, num_layers=1, num_kv_heads=1, head_dim=2, page_size=page_size, dtype=torch.float32
        ),
        akv.MambaState((2, 3), page_size=page_size),
        akv.Indexer(num_layers=1, head_dim=2, page_size=page_size, dtype=torch.float32),
    )


def expected_sidecar(comp: akv.Component, tenant: str | None, prefix: list[int]) -> torch.Tensor:
    """Component ``comp``'s page state for the last page of ``prefix``: like the KV, a pure
    function of (component, tenant, token prefix), exact in float32."""
    h = zlib.crc32(comp.name.encode()) + _tenant_seed(tenant)
    for t in prefix:
        h = (h * 1_000_003 + t + 1) % (1 << 61)
    n = math.prod(comp.page_shape)
    vals = (h % 4093) / 8 + torch.arange(n, dtype=torch.float32) / 64
    return vals.view(comp.page_shape).to(comp.dtype)


def write_sidecars(
    cache: akv.HiCache, slots: torch.Tensor, tenant: str | None, tokens: list[int], start: int
) -> None:
    """Write every component's state for the whole pages of ``tokens[start:]`` (``start`` a
    page boundary) at the pages of ``slots``, as the model would."""
    p = cache.config.page_size
    pages = (slots[::p] // p).tolist()
    for comp in cache.config.components:
        buf = cache.sidecar(comp.name)
        for j, page in enumerate(pages):
            end = start + (j + 1) * p
            if end > len(tokens):
                break  # the unaligned tail is not cached
            buf[page] = expected_sidecar(comp, tenant, tokens[:end])


# ---------------------------------------------------------------------------- copy engine


class ChaosCopyEngine:
    """Copies complete out of order, after random short delays, and sometimes fail.

    A task on the loop picks a random pending job, runs the copy at that moment (the latest a
    real engine could) and delivers ``done`` with ``call_soon`` like a worker would.
    """

    def __init__(self, rng: random.Random, fail_rate: float, max_gap: float = 0.004) -> None:
        self.rng = rng
        self.fail_rate = fail_rate
        self.max_gap = max_gap
        self.pending: list[tuple[CopyJob, Done]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self.failed = 0
        self.completed = 0

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._task = loop.create_task(self._drive())

    def submit(self, job: CopyJob, done: Done) -> None:
        self.pending.append((job, done))

    def _finish_one(self, index: int, fail: bool) -> None:
        assert self._loop is not None
        job, done = self.pending.pop(index)
        if fail:
            self.failed += 1
            self._loop.call_soon(done, RuntimeError("injected copy failure"))
        else:
            job.run()
            self.completed += 1
            self._loop.call_soon(done, None)

    async def _drive(self) -> None:
        while True:
            await asyncio.sleep(self.rng.uniform(0, self.max_gap))
            for _ in range(self.rng.randint(1, 3)):
                if not self.pending:
                    break
                i = self.rng.randrange(len(self.pending))
                self._finish_one(i, self.rng.random() < self.fail_rate)

    def quiet(self) -> None:
        self.fail_rate = 0.0

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        while self.pending:
            self._finish_one(0, False)
        await asyncio.sleep(0)


# ---------------------------------------------------------------------------- scenario


@dataclass
class Scenario:
    seed: int
    page_size: int
    write_policy: str
    device_pages: int
    host_pages: int
    copy_fail_rate: float
    storage: dict[str, float]
    requests: int
    concurrency: int
    components: bool = False  #: hybrid model: SWA, Mamba and indexer sidecars too
    #: every tenant's page budgets (#26; ``None``: none until chaos sets one)
    default_quota: akv.TenantQuota | None = None

    @classmethod
    def from_seed(cls, seed: int) -> Scenario:
        rng = random.Random(seed)
        page_size = rng.choice([1, 2])
        sc = cls(
            seed=seed,
            page_size=page_size,
            write_policy=rng.choice(POLICIES),
            device_pages=rng.randint(12, 28) // page_size + 2,
            host_pages=rng.randint(14, 36) // page_size + 6,
            copy_fail_rate=rng.choice([0.0, 0.03, 0.08]),
            storage=dict(
                max_delay=rng.choice([0.0, 0.005, 0.02]),
                stall_probability=rng.choice([0.0, 0.02, 0.05]),
                stall_seconds=0.3,  # beyond storage_timeout below
                put_failure=rng.choice([0.0, 0.05]),
                get_failure=rng.choice([0.0, 0.05]),
                vanish=rng.choice([0.0, 0.02]),
                corrupt=rng.choice([0.0, 0.02]),
            ),
            requests=int(os.environ.get("AKV_STRESS_REQUESTS", "150")),
            concurrency=rng.randint(3, 8),
        )
        # #26's knobs from their own stream: the draws above stay what they were
        extra = random.Random(seed * 7919 + 26)
        if extra.random() < 0.5:  # the per-tenant victim heaps on from the start
            sc.default_quota = akv.TenantQuota(
                device_pages=extra.randint(sc.device_pages // 2, sc.device_pages),
                host_pages=extra.randint(sc.host_pages // 2, sc.host_pages),
                storage_pages=extra.choice([None, extra.randint(8, 30)]),
            )
        return sc


class Cancelled:
    """Marker: the awaited operation was cancelled by the test (not the request)."""


CANCELLED = Cancelled()


@dataclass
class TenantDrop:
    """The last ``drop(tenant=...)`` of a tenant: the prompts whose pages may have been
    written after it began (requests of the tenant running then or started since); every
    other page of the tenant was written before it and must never be served again."""

    tainted: set[tuple[int, ...]] = field(default_factory=set)
    complete: bool = False  #: it returned (storage removal included)

    def allowed(self, tokens: tuple[int, ...], p: int) -> int:
        """Leading whole pages of ``tokens`` that a tainted prompt also holds."""
        pages = {t[: (j + 1) * p] for t in self.tainted for j in range(len(t) // p)}
        n = 0
        while (n + 1) * p <= len(tokens) and tokens[: (n + 1) * p] in pages:
            n += 1
        return n


@dataclass
class Run:
    sc: Scenario
    cache: akv.HiCache
    storage: Store
    engine: ChaosCopyEngine
    rng: random.Random
    midrun_invariants: bool
    systems: list[list[int]] = field(default_factory=list)
    prompts: set[tuple[str | None, tuple[int, ...]]] = field(default_factory=set)
    pins: list[akv.CachePin] = field(default_factory=list)  #: hard pins chaos took
    #: what maybe_cancel started: a caller cancelled while it waits leaves the task running
    spawned: set[asyncio.Task[Any]] = field(default_factory=set)
    #: requests running now per (tenant, prompt), and drops per tenant so far (#26)
    active: collections.Counter[tuple[str | None, tuple[int, ...]]] = field(
        default_factory=collections.Counter
    )
    drops: collections.Counter[str | None] = field(default_factory=collections.Counter)
    tenant_drops: dict[str | None, TenantDrop] = field(default_factory=dict)
    trace: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=80))
    failures: list[str] = field(default_factory=list)
    live: dict[str, set[int]] = field(
        default_factory=lambda: {"GPU": set(), "CPU": set(), "STORAGE": set()}
    )
    t0: float = field(default_factory=time.monotonic)

    # ------------------------------------------------------------------ bookkeeping

    def note(self, what: str) -> None:
        self.trace.append(f"{time.monotonic() - self.t0:7.3f} {what}")

    def fail(self, what: str) -> None:
        self.note(f"FAILURE {what}")
        self.failures.append(what)

    def drain_events(self) -> None:
        for ev in self.cache.take_events():
            if isinstance(ev, BlockStored):
                live = self.live[ev.medium]
                for h in ev.block_hashes:
                    if h in live and ev.medium != "STORAGE":
                        self.fail(
                            f"{ev.medium} BlockStored for a block already stored: {h.hex()[:16]}"
                        )
                    live.add(h)
            elif isinstance(ev, BlockRemoved):
                live = self.live[ev.medium]
                for h in ev.block_hashes:
                    if h not in live and ev.medium != "STORAGE":
                        self.fail(
                            f"{ev.medium} BlockRemoved for a block not stored: {h.hex()[:16]}"
                        )
                    live.discard(h)
            elif isinstance(ev, AllBlocksCleared):
                for live in self.live.values():
                    live.clear()

    def check_rows(self, m: MatchResult, tenant: str | None, tokens: list[int], when: str) -> None:
        idx = m.device_indices
        n = idx.numel()
        if n != m.device_len:
            self.fail(f"{when}: device_indices has {n} rows but device_len is {m.device_len}")
            return
        if n == 0:
            return
        got = read_rows(self.cache, idx)
        want = expected_kv(tenant, tokens[:n])
        if not torch.equal(got, want):
            bad = [i for i in range(n) if not torch.equal(got[:, :, i], want[:, :, i])]
            self.fail(
                f"{when}: tenant={tenant!r} tokens={tokens[:n]} wrong KV at positions {bad} "
                f"(rows {idx[bad].tolist()})"
            )
        if self.sc.components:
            self.check_sidecars(m, tenant, tokens, when)

    def check_sidecars(
        self, m: MatchResult, tenant: str | None, tokens: list[int], when: str
    ) -> None:
        """Every page a component needs at the end of ``m`` holds its state for that prefix
        (all pages for the indexer, the trailing window for SWA and Mamba)."""
        p = self.sc.page_size
        pages = m.device_pages.tolist()
        k = len(pages)
        for comp in self.cache.config.components:
            w = comp.window_pages(p)
            buf = self.cache.sidecar(comp.name)
            bad = [
                j
                for j in (range(k) if w == 0 else range(max(0, k - w), k))
                if not torch.equal(
                    buf[pages[j]], expected_sidecar(comp, tenant, tokens[: (j + 1) * p])
                )
            ]
            if bad:
                self.fail(
                    f"{when}: tenant={tenant!r} tokens={tokens[: k * p]} wrong {comp.name} "
                    f"state at pages {bad} of {k}"
                )

    def prompt(self, rng: random.Random) -> list[int]:
        sys_prompt = rng.choice(self.systems)
        tail = [rng.randint(1, 3) for _ in range(rng.randint(0, 7))]
        return sys_prompt + tail

    async def maybe_cancel(self, rng: random.Random, aw: Awaitable[T], p: float = 0.25) -> Any:
        """Await ``aw`` in a task; with probability ``p`` cancel it after a random delay."""
        task = asyncio.ensure_future(aw)
        task.add_done_callback(_retrieve)  # an abandoned task's failure is not an error here
        self.spawned.add(task)
        task.add_done_callback(self.spawned.discard)
        if rng.random() < p:
            if rng.random() < 0.5:
                for _ in range(rng.randint(0, 3)):
                    await asyncio.sleep(0)
            else:
                await asyncio.wait([task], timeout=rng.uniform(0, 0.01))
            task.cancel()
        try:
            return await task
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if me is not None and me.cancelling():
                raise
            return CANCELLED

    # ------------------------------------------------------------------ actors

    async def request(self, rid: int) -> None:
        cache = self.cache
        rng = random.Random(self.sc.seed * 100_003 + rid)
        tenant = rng.choice(TENANTS)
        tokens = self.prompt(rng)
        p = self.sc.page_size
        self.prompts.add((tenant, tuple(tokens)))
        handles: list[MatchResult | InsertResult] = []
        held: torch.Tensor | None = None
        tag = f"r{rid} {tenant or '-'} len={len(tokens)}"
        # #26: a retention priority on some inserts (own stream: the draws below stay put)
        xrng = random.Random(self.sc.seed * 7919 + rid)
        prio: dict[str, Any] = {}
        if xrng.random() < 0.3:
            prio = dict(
                priority=xrng.randint(0, 1000),
                retention=xrng.choice([None, xrng.uniform(0.0, 0.05)]),
            )
        me = (tenant, tuple(tokens))
        self.active[me] += 1
        if tenant in self.tenant_drops:  # may write pages after the tenant's last drop
            self.tenant_drops[tenant].tainted.add(me[1])
        drops = self.drops[tenant]  # a drop of the tenant from now on may cut the prefix
        try:
            if rng.random() < 0.5:
                policy = rng.choice(["timeout", "best_effort", "wait_complete"])
                res = await self.maybe_cancel(
                    rng, cache.prefetch(tokens, tenant=tenant, policy=policy)
                )
                self.note(f"{tag} prefetch {policy}: {res}")
            m = cache.match_prefix(tokens, tenant=tenant)
            handles.append(m)
            self.note(f"{tag} match dev={m.device_len} host={m.host_len}")
            self.check_rows(m, tenant, tokens, f"{tag} match")
            if m.host_len and rng.random() < 0.85:
                try:
                    res = await self.maybe_cancel(rng, cache.load_back(m))
                    self.note(f"{tag} load_back {'cancelled' if res is CANCELLED else 'ok'}")
                except (TransferError, CapacityError) as exc:
                    self.note(f"{tag} load_back {type(exc).__name__}")
                self.check_rows(m, tenant, tokens, f"{tag} after load_back")
            dev_idx = m.device_indices  # the rows the prefix uses now (load-backs may add)
            d = dev_idx.numel()
            if d >= len(tokens) // p * p and len(tokens) % p == 0:
                return  # fully cached: nothing to compute
            n_new = len(tokens) - d
            need = -(-n_new // p)
            before = None
            try:
                if rng.random() < 0.5:
                    before = cache.statistics()
                    slots = cache.alloc(n_new)
                else:
                    # awaited in this task (a task around it could finish with slots nobody
                    # takes): a tiny timeout cancels it at its await, if it waits at all
                    limit = rng.uniform(0, 0.01) if rng.random() < 0.3 else None
                    try:
                        async with asyncio.timeout(limit):
                            slots = await cache.alloc_wait(n_new)
                    except TimeoutError:
                        self.note(f"{tag} alloc_wait timed out")
                        return
            except CapacityError as exc:
                after = cache.statistics()
                self.note(f"{tag} alloc({n_new}) CapacityError")
                hopeless = (
                    before is not None
                    and need > before.device.free_pages + before.device.evictable_pages
                )
                if (
                    before is not None
                    and hopeless
                    and (after.nodes, after.device) != (before.nodes, before.device)
                ):
                    self.fail(
                        f"{tag}: alloc of {need} pages that could never fit "
                        f"(free {before.device.free_pages} + evictable "
                        f"{before.device.evictable_pages}) changed the cache before raising "
                        f"{exc}: {before.device} -> {after.device}, nodes {before.nodes} -> "
                        f"{after.nodes}"
                    )
                return
            held = slots
            if xrng.random() < 0.3:  # the forward pass takes a while: a drop may cut in
                await asyncio.sleep(xrng.uniform(0, 0.005))
            write_rows(cache, slots[:n_new], expected_kv(tenant, tokens)[:, :, d:])
            if self.sc.components:
                write_sidecars(cache, slots[:n_new], tenant, tokens, d)
            try:
                if rng.random() < 0.5:  # only the new slots: the match's pages serve the rest
                    r = cache.insert(tokens, slots[:n_new], prefix=m, tenant=tenant, **prio)
                else:
                    rows = torch.cat([dev_idx, slots[:n_new]])
                    r = cache.insert(tokens, rows, tenant=tenant, **prio)
            except akv.PrefixDroppedError as exc:
                # the matched prefix was dropped meanwhile (its rows are no longer the tree's),
                # or a page of it failed its verification at load-back: not this request's
                # fault, and nothing changed
                if exc.reason == "dropped" and self.drops[tenant] == drops:
                    raise
                self.note(f"{tag} insert onto a prefix that left the tree: {exc.reason}")
                return
            handles.append(r)
            held = slots[-p:] if len(tokens) % p else None  # the unaligned tail stays ours
            if held is not None:
                cache.free(held)
                held = None
            self.note(f"{tag} insert prefix={r.prefix_len} inserted={r.inserted_len}")
            if r.write_through is not None and rng.random() < 0.5:
                try:
                    await self.maybe_cancel(rng, _await(r.write_through))
                except TransferError:
                    self.note(f"{tag} write-through failed")
            await asyncio.sleep(rng.uniform(0, 0.005))
            m2 = cache.match_prefix(tokens, tenant=tenant)
            handles.append(m2)
            # (a node that came from storage without a window's pages keeps lacking them,
            # unless this insert gave it the request's pages (computed whole): matches may
            # not end inside such a hole, and only there may they be shorter)
            holes = self.sc.components and any(lacking(n) for n in r.core.tree.path(r.node))
            dropped = self.drops[tenant] != drops  # a drop may have cut the pinned path
            # (nor where a node the insert met loading failed verification at load-back:
            # storage/deferred.py drops it, whoever holds it)
            corrupt = any(n.corrupt for n in r.core.tree.path(r.node))
            if m2.matched_len < r.inserted_len and not (holes or dropped or corrupt):
                self.fail(f"{tag}: match {m2.matched_len} < pinned insert {r.inserted_len}")
            self.check_rows(m2, tenant, tokens, f"{tag} re-match")
            if m2.host_len and rng.random() < 0.5:
                try:
                    await self.maybe_cancel(rng, cache.load_back(m2))
                except (TransferError, CapacityError) as exc:
                    self.note(f"{tag} re-match load_back {type(exc).__name__}")
                self.check_rows(m2, tenant, tokens, f"{tag} re-match after load_back")
            await asyncio.sleep(rng.uniform(0, 0.01))
        finally:
            self.active[me] -= 1
            if held is not None:
                cache.free(held)
            rng.shuffle(handles)
            for h in handles:
                if h.state is HandleState.PINNED:
                    cache.release(h)

    async def chaos(self, requests: list[asyncio.Task[None]]) -> None:
        cache = self.cache
        rng = random.Random(self.sc.seed ^ 0x5EED)
        while True:
            await asyncio.sleep(rng.uniform(0, 0.01))
            x = rng.random()
            if x < 0.25:
                k = rng.randint(1, 6)
                self.note(f"chaos evict device {k}: {cache.evict(k)}")
            elif x < 0.4:
                k = rng.randint(1, 6)
                self.note(f"chaos evict host {k}: {cache.evict(k, 'host')}")
            elif x < 0.5:
                res = await self.maybe_cancel(rng, cache.flush(), p=0.5)
                self.note(f"chaos flush {'cancelled' if res is CANCELLED else 'done'}")
            elif x < 0.7 and self.midrun_invariants:
                try:
                    cache.check_invariants()
                except AssertionError as exc:
                    self.fail(f"check_invariants mid-run: {exc}")
            elif x < 0.78:
                live = [t for t in requests if not t.done()]
                if live:
                    rng.choice(live).cancel()
                    self.note("chaos cancelled a request")
            elif x < 0.84 and self.prompts:  # a short hard pin of a prompt seen (#26)
                tenant, toks = rng.choice(sorted(self.prompts, key=repr))
                tier = rng.choice(["device", "host"])
                try:
                    pin = cache.pin(list(toks), ttl=rng.uniform(0.001, 0.05), tier=tier,
                                    tenant=tenant)  # fmt: skip
                    self.pins.append(pin)
                    self.note(f"chaos pin {tier} {tenant or '-'}: {pin.pinned_len}")
                except (akv.NotCachedError, akv.PinLimitError) as exc:
                    self.note(f"chaos pin {tier}: {type(exc).__name__}")
            elif x < 0.88 and self.prompts:  # a bounded warm-up, maybe cancelled (#26)
                tenant, toks = rng.choice(sorted(self.prompts, key=repr))
                tier = rng.choice(["device", "host"])
                res = await self.maybe_cancel(
                    rng,
                    cache.warm(list(toks), tier=tier, tenant=tenant, timeout=rng.uniform(0, 0.05)),
                )
                self.note(f"chaos warm {tier}: {res}")
            elif x < 0.91:  # a tenant's budgets set or removed, maybe while it is over (#26)
                self.set_quota(rng)
            elif x < 0.935 and self.prompts:  # drop a prefix seen (#26)
                tenant, toks = rng.choice(sorted(self.prompts, key=repr))
                p = self.sc.page_size
                if len(toks) >= p:
                    await self.drop(rng, tenant, list(toks[: rng.randint(p, len(toks))]))
            elif x < 0.96:  # drop a whole tenant (#26)
                await self.drop(rng, rng.choice(TENANTS), None)
            self.drain_events()

    def set_quota(self, rng: random.Random) -> None:
        sc = self.sc
        tenant = rng.choice(TENANTS) or ""
        quota = None
        if rng.random() < 0.7:
            quota = akv.TenantQuota(
                device_pages=rng.choice([None, rng.randint(0, sc.device_pages)]),
                host_pages=rng.choice([None, rng.randint(0, sc.host_pages)]),
                storage_pages=rng.choice([None, rng.randint(2, 30)]),
            )
        self.cache.set_tenant_quota(tenant, quota)
        self.note(f"chaos quota {tenant or '-'}: {quota} usage {self.cache.tenant_usage(tenant)}")

    async def drop(self, rng: random.Random, tenant: str | None, toks: list[int] | None) -> None:
        """Drop a prefix or a tenant, racing the requests, backups and prefetches in flight;
        after a tenant drop, nothing of the tenant written before it matches."""
        zeroize = rng.random() < 0.5
        what = f"chaos drop {tenant or '-'} {'tenant' if toks is None else toks} z={zeroize}"
        self.drops[tenant] += 1
        record = None
        if toks is None:  # requests running now may still write the tenant's pages
            record = TenantDrop({t for (who, t), n in self.active.items() if who == tenant and n})
            self.tenant_drops[tenant] = record
        try:
            res = await self.cache.drop(toks, tenant=tenant, zeroize=zeroize)
        except akv.DropIncompleteError as exc:
            self.note(f"{what}: {exc}")
            return
        self.note(f"{what}: {res}")
        if record is None:
            return
        record.complete = True
        p = self.sc.page_size
        for who, prompt in sorted(self.prompts, key=repr):
            if who != tenant or prompt in record.tainted:
                continue
            m = self.cache.match_prefix(list(prompt), tenant=tenant)
            try:
                allowed = record.allowed(prompt, p) * p
                if m.matched_len > allowed:
                    self.fail(
                        f"{what}: right after it a match of {list(prompt)} serves "
                        f"{m.matched_len} tokens, of which only {allowed} were written after"
                    )
            finally:
                self.cache.release(m)


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


async def _await(aw: Awaitable[T]) -> T:
    return await aw


# ---------------------------------------------------------------------------- the run


def _config(sc: Scenario, storage: Store, **kw: Any) -> akv.CacheConfig:
    opts: dict[str, Any] = dict(
        page_size=sc.page_size,
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_dim=HEAD_DIM,
        device_pages=sc.device_pages,
        host_pages=sc.host_pages,
        write_policy=sc.write_policy,
        storage=storage,
        namespace=MODEL,
        storage_timeout=0.2,
        storage_retry_seconds=0.02,
        prefetch_threshold_tokens=0,
        prefetch_timeout_base=0.05,
        prefetch_timeout_per_1k=0.0,
        prefetch_timeout_max=0.1,
        prefetch_batch_pages=2,
    )
    if sc.components:
        opts["components"] = stress_components(sc.page_size)
    if sc.default_quota is not None:
        opts["default_tenant_quota"] = sc.default_quota
    opts.update(kw)
    return small_config(**opts)


def _start_requests(run: Run) -> list[asyncio.Task[None]]:
    """Draw the run's system prompts and start every request task (``concurrency`` at once)."""
    rng = run.rng
    run.systems = [[rng.randint(100, 120) for _ in range(rng.randint(2, 8))] for _ in range(3)]
    sem = asyncio.Semaphore(run.sc.concurrency)

    async def one(rid: int) -> None:
        async with sem:
            await run.request(rid)

    return [asyncio.create_task(one(i)) for i in range(run.sc.requests)]


async def _drive(run: Run) -> None:
    cache = run.cache
    tasks = _start_requests(run)
    chaos = asyncio.create_task(run.chaos(tasks))
    results = await asyncio.gather(*tasks, return_exceptions=True)
    chaos.cancel()
    await asyncio.gather(chaos, return_exceptions=True)
    # a warm or flush whose caller was cancelled mid-wait still runs (each is bounded): the
    # settled state is checked once it ended, or a load-back it starts counts as a leak
    await asyncio.gather(*run.spawned, return_exceptions=True)
    for pin in run.pins:  # expired ones: nothing to do; a drop or a page that failed at
        if pin.state is not akv.PinState.RELEASED:  # load-back ended (released) some
            cache.unpin(pin)
    for i, res in enumerate(results):
        if isinstance(res, BaseException) and not isinstance(res, asyncio.CancelledError):
            run.fail(f"request r{i} raised {type(res).__name__}: {res}")
    run.drain_events()

    # ---- settle: no more faults
    run.storage.quiet()
    run.engine.quiet()
    await cache.flush()
    # a call past its deadline still runs in its worker (a 0.3 s stall): the pages its put
    # evicts are reconciled when it returns, so the store is compared once every call ended
    for _ in range(1000):
        if not cache.statistics().storage_calls_running:
            break
        await asyncio.sleep(0.01)
    if cache.statistics().storage_calls_running:
        run.fail(f"HANG: storage calls still running 10 s after flush: {cache.statistics()}")
    await cache.flush()  # what those late calls handed back
    run.note(f"settled: {cache!r}")
    try:
        cache.check_invariants()
    except AssertionError as exc:
        run.fail(f"check_invariants after flush: {exc}")
    st = cache.statistics()
    if st.device.held_pages or st.ops_in_flight or st.storage_in_flight:
        run.fail(f"after flush: held/in flight left: {st}")
    if st.device.protected_pages or st.host.protected_pages or st.prefetch_reserved_pages:
        run.fail(f"after flush with every handle released: protected pages left: {st}")
    run.drain_events()
    _check_storage(run)

    # ---- full eviction returns every page
    for _ in range(10):
        cache.evict(1 << 30)
        await cache.flush()
        cache.evict(1 << 30, "host")
        st = cache.statistics()
        if st.device.free_pages == st.device.total_pages and (
            st.host.free_pages == st.host.total_pages
        ):
            break
    st = cache.statistics()
    if (
        st.device.free_pages != st.device.total_pages
        or st.host.free_pages != st.host.total_pages
        or st.nodes
    ):
        run.fail(f"full eviction left pages or nodes: {st}")
    try:
        cache.check_invariants()
    except AssertionError as exc:
        run.fail(f"check_invariants after full eviction: {exc}")
    run.drain_events()
    for medium in ("GPU", "CPU"):
        if run.live[medium]:
            run.fail(
                f"{len(run.live[medium])} {medium} blocks still reported stored after eviction"
            )
    await _probe_stale_claims(run)


async def _probe_stale_claims(run: Run) -> None:
    """Every STORAGE claim the store no longer backs (a page it dropped or evicted silently):
    once a prefetch of the page's prefix has asked the store, on the emptied cache, the claim
    must be retracted."""
    known = _known_pages(run)
    by_hash = {bytes.fromhex(k.split("/")[1]): k for k, (_, _, c) in known.items() if c is None}
    storage = run.storage
    # files hurt behind the index's back: the index still lists them (read, they are dropped)
    damaged = storage.damaged if isinstance(storage, OracleFileStorage) else set()
    if not isinstance(storage, OracleFileStorage):  # evict a few claimed pages silently too
        claimed = sorted(h for h in run.live["STORAGE"] if h in by_hash)
        for h in random.Random(run.sc.seed).sample(claimed, min(3, len(claimed))):
            storage.drop(by_hash[h])
    contents = storage.contents()
    stale = [
        h
        for h in run.live["STORAGE"]
        if (key := by_hash.get(h)) is not None and key not in contents and key not in damaged
    ]
    cache = run.cache
    for h in stale:
        tenant, prefix, _ = known[by_hash[h]]
        await cache.prefetch(prefix, tenant=tenant, policy="wait_complete")
        cache.evict(1 << 30)
        cache.evict(1 << 30, "host")
        run.drain_events()
    left = [h for h in stale if h in run.live["STORAGE"]]
    if left:
        run.fail(
            f"{len(left)} of {len(stale)} STORAGE claims the store no longer backs stayed "
            f"claimed after a prefetch found them missing: {[f'{h.hex()[:16]}' for h in left[:4]]}"
        )
    run.note(f"stale STORAGE claims probed: {len(stale)}")


Known = dict[str, tuple[str | None, list[int], akv.Component | None]]


async def _drive_until_close(run: Run) -> None:
    """Requests as in ``_drive``, and ``aclose`` at a random moment while they run: the close
    finishes within its bound, every request ends (normally, cancelled, or with
    ``CacheClosedError``) instead of hanging on a copy or a storage call, and what reached
    storage stays right (checked by the caller)."""
    cache = run.cache
    tasks = _start_requests(run)
    await asyncio.sleep(run.rng.uniform(0.02, 0.25))
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await cache.aclose()
    took = loop.time() - t0
    bound = 3 * cache.config.storage_timeout + 1.0
    if took > bound:
        run.fail(f"aclose with requests in flight took {took:.2f} s (bound {bound:.2f} s)")
    run.note(f"closed mid-run after {sum(t.done() for t in tasks)} requests ended")
    run.storage.quiet()  # the restarted cache reads a store without faults
    done, pending = await asyncio.wait(tasks, timeout=10)
    if pending:
        run.fail(f"HANG: {len(pending)} requests still running 10 s after aclose")
        for t in pending:
            t.cancel()
    for i, t in enumerate(tasks):
        if t in done and not t.cancelled():
            exc = t.exception()
            if exc is not None and not isinstance(exc, akv.CacheClosedError):
                run.fail(f"request r{i} raised {type(exc).__name__} after close: {exc}")


def _known_pages(run: Run) -> Known:
    """Storage key -> (tenant, token prefix ending with that page, component or ``None`` for
    the KV), for every prompt seen."""
    p = run.sc.page_size
    comps: list[akv.Component | None] = [None, *run.cache.config.components]
    out: Known = {}
    for tenant, toks in run.prompts:
        ns = Namespace(MODEL, tenant or "", "")
        n = len(toks) // p * p
        hashes = chain_hashes(namespace_seed(ns.tag), list(toks[:n]), p)
        for j, h in enumerate(hashes):
            for comp in comps:
                key = storage_key(ns.tag, h, component_key(run, comp))
                out[key] = (tenant, list(toks[: (j + 1) * p]), comp)
    return out


def _check_storage(run: Run, *, events: bool = True) -> None:
    """Every stored page holds the KV of its key (on disk: sealed, unless damaged by the
    test); STORAGE events match the store."""
    known = _known_pages(run)
    by_hash = {bytes.fromhex(k.split("/")[1]): k for k, (_, _, c) in known.items() if c is None}
    storage = run.storage
    contents = storage.contents()
    p = run.sc.page_size
    on_disk = isinstance(storage, (OracleFileStorage, OracleMooncakeStorage))
    for key, raw in contents.items():
        if key not in known:
            run.fail(f"storage holds a key no prompt produced: {key}")
            continue
        if key in storage.corrupted:
            continue
        tenant, prefix, comp = known[key]
        want = page_payload(tenant, prefix, p, comp)
        ok = intact(key, raw, want) if on_disk else raw[: len(want)] == want
        if not ok and not (on_disk and key in storage.damaged):
            run.fail(
                f"storage page {key} (tenant={tenant!r} prefix={prefix}) holds other KV than "
                "its tokens'"
            )
    damaged = storage.damaged if on_disk else set()
    for h in run.live["STORAGE"] if events else ():
        key = by_hash.get(h)
        if key is None:
            run.fail(f"STORAGE BlockStored for an unknown block {h.hex()[:16]}")
        elif key not in contents and key not in storage.dropped and key not in damaged:
            run.fail(f"STORAGE block {h.hex()[:16]} reported stored but the store lacks {key}")


async def stress(
    seed: int,
    *,
    midrun_invariants: bool | None = None,
    file_root: Path | None = None,
    damage: float = 0.0,
    outside: Path | None = None,
    components: bool = False,
    mooncake: bool = False,
    close_midway: bool = False,
) -> Run:
    """One seeded run; over ``OracleFileStorage`` in ``file_root`` if given (its files damaged
    with probability ``damage`` per I/O call, links pointing at ``outside``), else over the
    faulty ``MemoryStorage``; with ``components``, a hybrid model's sidecars (SWA window,
    Mamba state, indexer) are written, checked and stored beside the KV; with ``mooncake``,
    over the real ``MooncakeStorage`` logic and a ``ChaosMooncakeClient`` (damage: per put);
    with ``close_midway``, the cache is closed while requests are in flight."""
    sc = Scenario.from_seed(seed)
    if midrun_invariants is None:
        midrun_invariants = os.environ.get("AKV_STRESS_MIDRUN_INVARIANTS", "1") != "0"
    if components:
        sc = dataclasses.replace(sc, components=True)
    rng = random.Random(seed)
    storage: Store
    if mooncake:
        chaos = ChaosMooncakeClient(
            seed,
            max_delay=sc.storage["max_delay"],
            stall=sc.storage["stall_probability"],
            stall_seconds=sc.storage["stall_seconds"],
            put_failure=sc.storage["put_failure"],
            get_failure=sc.storage["get_failure"],
            damage=damage,
        )
        storage = OracleMooncakeStorage(chaos)
    elif file_root is None:
        storage = MemoryStorage(seed, **sc.storage)
    else:  # room for ~40 pages: eviction all the time
        page = LAYERS * 2 * sc.page_size * HEADS * HEAD_DIM * 4 + integrity.FRAME_OVERHEAD + 100
        storage = OracleFileStorage(
            file_root,
            seed,
            40 * page,
            sc.storage["max_delay"],
            damage=damage,
            outside=outside,
        )
    engine = ChaosCopyEngine(random.Random(seed + 1), sc.copy_fail_rate)
    cache = akv.HiCache(_config(sc, storage), copy_engine=engine)
    loop = asyncio.get_running_loop()
    run = Run(sc, cache, storage, engine, rng, midrun_invariants)

    def on_error(_loop: asyncio.AbstractEventLoop, ctx: dict[str, Any]) -> None:
        exc = ctx.get("exception")
        run.fail(f"loop exception handler: {ctx.get('message')}: {exc!r}")

    old_handler = loop.get_exception_handler()
    loop.set_exception_handler(on_error)
    await cache.start()
    closed = False
    try:
        hung = False
        try:
            await asyncio.wait_for(
                _drive_until_close(run) if close_midway else _drive(run), timeout=40
            )
            closed = close_midway
        except asyncio.TimeoutError:
            hung = True
            run.fail(f"HANG: the run did not finish in 40 s; {cache!r}")
        if not hung:
            if not closed:
                await asyncio.wait_for(cache.aclose(), timeout=10)
                closed = True
            _check_storage(run, events=False)  # again: puts that landed late, at close
            _check_dropped_storage(run)
            try:
                await asyncio.wait_for(_fresh_check(run), timeout=30)
            except asyncio.TimeoutError:
                run.fail("HANG: the fresh cache did not serve the stored prompts in 30 s")
            finally:
                run.cache = cache
    finally:
        if not closed:
            try:
                await asyncio.wait_for(cache.aclose(), timeout=5)
            except Exception as exc:  # a hang or a broken cache: already reported
                run.note(f"aclose failed: {exc!r}")
        loop.set_exception_handler(old_handler)
    return run


async def _fresh_check(run: Run) -> None:
    sc = run.sc
    if isinstance(run.storage, (OracleFileStorage, OracleMooncakeStorage)):
        run.storage = run.storage.reopened()  # the first cache closed it: a restarted node
    cfg = _config(
        sc,
        run.storage,
        device_pages=256,
        host_pages=256,
        write_policy="write_through",
        storage_timeout=5.0,
        prefetch_policy="wait_complete",
        default_tenant_quota=None,  # budgets would evict what the check reads back
    )
    run.cache = akv.HiCache(cfg)
    async with run.cache as fresh:
        await _serve_all(run, fresh)
        await _check_dropped_fresh(run, fresh)


def _clean_prompts(run: Run) -> list[tuple[str | None, tuple[int, ...], TenantDrop]]:
    """Each prompt of a tenant dropped (completely) that no request used after the drop."""
    out = []
    for tenant, record in run.tenant_drops.items():
        if record.complete:
            for who, toks in sorted(run.prompts, key=repr):
                if who == tenant and toks not in record.tainted:
                    out.append((tenant, toks, record))
    return out


def _check_dropped_storage(run: Run) -> None:
    """No page of a dropped tenant written before its drop is left in the store (a backup
    in flight at the drop removed what it put)."""
    p = run.sc.page_size
    contents = run.storage.contents()
    comps = [None, *run.cache.config.components]
    for tenant, toks, record in _clean_prompts(run):
        tag = Namespace(MODEL, tenant or "", "").tag
        n = len(toks) // p
        hashes = chain_hashes(namespace_seed(tag), list(toks[: n * p]), p)
        for j in range(record.allowed(toks, p), n):
            for comp in comps:
                key = storage_key(tag, hashes[j], component_key(run, comp))
                if key in contents:  # (pages a later prompt shares are before ``allowed``)
                    run.fail(
                        f"storage still holds {key} (tenant={tenant!r} prefix "
                        f"{list(toks[: (j + 1) * p])}) written before the tenant was dropped"
                    )


async def _check_dropped_fresh(run: Run, fresh: akv.HiCache) -> None:
    """A second cache over the same store serves nothing of a dropped tenant written before
    the drop: a prefetch and match of its prompts stops where pages written later end."""
    p = run.sc.page_size
    for tenant, toks, record in _clean_prompts(run):
        allowed = record.allowed(toks, p) * p
        res = await fresh.prefetch(list(toks), tenant=tenant)
        m = fresh.match_prefix(list(toks), tenant=tenant)
        try:
            if m.matched_len > allowed:
                run.fail(
                    f"fresh cache tenant={tenant!r} tokens={list(toks)}: serves "
                    f"{m.matched_len} tokens of a tenant dropped, only {allowed} written after "
                    f"the drop ({res})"
                )
        finally:
            fresh.release(m)
        fresh.evict(1 << 30)
        fresh.evict(1 << 30, "host")


def _usable_stored_run(
    run: Run,
    contents: dict[str, bytes],
    tag: str,
    hashes: list[int],
    tenant: str | None,
    tokens: list[int],
) -> int:
    """Pages a fresh cache can serve of a prompt (page hashes ``hashes``) from storage alone:
    the leading run of intact KV pages, cut to the longest prefix at whose end every
    component has the pages it needs (all of them, or its trailing window)."""
    storage = run.storage
    p = run.sc.page_size

    def intact_pages(comp: akv.Component | None) -> list[bool]:
        out = []
        for j, h in enumerate(hashes):
            k = storage_key(tag, h, component_key(run, comp))
            ok = k in contents and k not in storage.corrupted
            if ok and isinstance(storage, (OracleFileStorage, OracleMooncakeStorage)):
                # damaged by the test: a miss
                ok = intact(k, contents[k], page_payload(tenant, tokens[: (j + 1) * p], p, comp))
            out.append(ok)
        return out

    kv = intact_pages(None)
    end = kv.index(False) if False in kv else len(kv)
    needs = [(intact_pages(c), c.window_pages(p)) for c in run.cache.config.components]
    while end and not all(all(have[0 if w == 0 else max(0, end - w) : end]) for have, w in needs):
        end -= 1
    return end


async def _serve_all(run: Run, fresh: akv.HiCache) -> None:
    storage = run.storage
    p = run.sc.page_size
    contents = storage.contents()
    for tenant, toks in sorted(run.prompts, key=lambda x: (x[0] or "", x[1])):
        tokens = list(toks)
        ns = Namespace(MODEL, tenant or "", "")
        n = len(tokens) // p * p
        if not n:
            continue
        hashes = chain_hashes(namespace_seed(ns.tag), tokens[:n], p)
        run_len = _usable_stored_run(run, contents, ns.tag, hashes, tenant, tokens)
        res = await fresh.prefetch(tokens, tenant=tenant)
        m = fresh.match_prefix(tokens, tenant=tenant)
        try:
            await fresh.load_back(m)
            tag = f"fresh cache tenant={tenant!r} tokens={tokens}"
            if m.device_len != run_len * p:
                run.fail(
                    f"{tag}: serves {m.device_len} tokens, storage holds a leading run of "
                    f"{run_len * p} ({res})"
                )
            run.check_rows(m, tenant, tokens, tag)
        finally:
            fresh.release(m)
        # a page that failed at load-back is dropped in the background (storage/deferred.py),
        # and prefetches meanwhile commit nothing of that prompt: let it end first
        await fresh.flush()
        fresh.evict(1 << 30)  # each prompt from storage alone: no pool can fill up
        fresh.evict(1 << 30, "host")


def describe(run: Run) -> str:
    sc = run.sc
    head = (
        f"stress seed {sc.seed} FAILED (rerun: AKV_STRESS_SEED={sc.seed} or --stress-seed "
        f"{sc.seed}); scenario: {sc}"
    )
    fails = "\n  ".join(run.failures[:10])
    more = f"\n  ... and {len(run.failures) - 10} more" if len(run.failures) > 10 else ""
    trace = "\n    ".join(run.trace)
    return f"{head}\nfailures:\n  {fails}{more}\nlast operations:\n    {trace}"


async def test_stress(stress_seed: int) -> None:
    run = await stress(stress_seed)
    assert not run.failures, describe(run)


@pytest.mark.parametrize("seed", [3, 8, 12, 22])
async def test_stress_over_file_storage(seed: int, tmp_path: Path) -> None:
    """The same oracle over the real ``FileStorage`` at a capacity of ~40 pages (evictions
    reported back while backups and prefetches run), with random and stalled I/O."""
    run = await stress(int(os.environ.get("AKV_STRESS_SEED", seed)), file_root=tmp_path)
    assert not run.failures, describe(run)


@pytest.mark.parametrize("seed", [7, 15, 25, 34])
async def test_stress_over_damaged_file_storage(seed: int, tmp_path: Path) -> None:
    """The same oracle over a ``FileStorage`` whose files another process damages while the
    cache runs (flipped bytes, truncation, deletion, a symlink to a file outside): every row
    served is still right, a damaged page is a miss for this cache and for a restarted one,
    and the file the links point at never changes."""
    outside = tmp_path / "outside.bin"
    secret = bytes(range(256)) * 64
    await asyncio.to_thread(outside.write_bytes, secret)
    run = await stress(
        int(os.environ.get("AKV_STRESS_SEED", seed)),
        file_root=tmp_path / "store",
        damage=0.25,
        outside=outside,
    )
    assert not run.failures, describe(run)
    assert isinstance(run.storage, OracleFileStorage)
    assert run.storage.damaged, "the run damaged no page file: the test proved nothing"
    assert await asyncio.to_thread(outside.read_bytes) == secret, (
        "a write went through a planted symlink"
    )


@pytest.mark.parametrize("seed", [1, 2, 3, 5])
async def test_stress_hybrid_model(seed: int) -> None:
    """The oracle with a hybrid model's sidecars (SWA window, Mamba state, indexer), over the
    faulty in-memory store: every page a component needs at the end of a match holds that
    prefix's state, in every tier and after a restart from storage."""
    run = await stress(int(os.environ.get("AKV_STRESS_SEED", seed)), components=True)
    assert not run.failures, describe(run)


@pytest.mark.parametrize("seed", [3, 7])
async def test_stress_hybrid_model_over_file_storage(seed: int, tmp_path: Path) -> None:
    """The hybrid oracle over the real ``FileStorage`` at ~40 pages of room, damaged too."""
    run = await stress(
        int(os.environ.get("AKV_STRESS_SEED", seed)),
        file_root=tmp_path / "store",
        components=True,
        damage=0.1,
    )
    assert not run.failures, describe(run)


@pytest.mark.parametrize(("seed", "components"), [(18, False), (25, False), (34, True), (39, True)])
async def test_stress_over_mooncake_logic(seed: int, components: bool) -> None:
    """The oracle over the real ``MooncakeStorage`` logic (existence checks, seal and verify,
    pipelined calls, return codes) on an in-memory client that delays, stalls, fails batches
    and damages or removes stored objects: every row served is right, a damaged object is a
    miss, and a restarted cache serves exactly the intact leading run (with a hybrid model's
    sidecars too, for two seeds)."""
    run = await stress(
        int(os.environ.get("AKV_STRESS_SEED", seed)),
        mooncake=True,
        damage=0.4,
        components=components,
    )
    assert not run.failures, describe(run)


@pytest.mark.parametrize("seed", [1, 3, 5, 12])
async def test_stress_close_with_requests_in_flight(seed: int, tmp_path: Path) -> None:
    """``aclose`` at a random moment of a busy run over the real ``FileStorage``: the close
    is bounded, no request hangs or fails with anything but ``CacheClosedError``, and what
    reached storage is right and served again by a restarted cache."""
    run = await stress(
        int(os.environ.get("AKV_STRESS_SEED", seed)), file_root=tmp_path, close_midway=True
    )
    assert not run.failures, describe(run)
