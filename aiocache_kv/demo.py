"""``aiocache-kv demo``: a small in-process walkthrough of the cache on CPU.

The walkthrough plays a serving loop over a few prompts that share a system prompt:

1. **prefill** - for each prompt: ``match_prefix`` (the shared prefix is reused from device
   after the first prompt), ``alloc`` slots for the rest, let the "model" write K/V rows
   through ``device_kv(layer)``, ``insert``, await the write-through ack, ``release``;
2. **match** - every prompt is now a device hit;
3. **evict** - ``evict`` every device page: with ``write_through`` each page has a host copy,
   so the nodes are demoted to host, not dropped;
4. **match again + load_back** - every prompt is a host hit; ``await load_back(m)`` brings it
   back to device;
5. **data check** - the K/V read at ``m.device_indices`` must be bit-identical to what the
   model wrote;
6. **evict from host too** (with a storage tier, default ``FileStorage`` in a temporary
   directory): ``await flush()`` first, so every page's backup to storage has landed; the
   prompts are then misses in L1 and L2;
7. the KV events (``take_events``, including ``STORAGE`` ones) and ``statistics()`` as tables;
8. **restarted node** - a fresh cache on the same storage (file: node 1 closes first, a true
   restart; Mooncake: node 1 stays up, since its segment holds the pages, and node 2 is a
   second client): ``await prefetch(tokens)`` shows storage hits, ``load_back`` brings them to
   device, and the K/V must again be bit-identical; its events and statistics follow.

The "model" here is :func:`fake_kv`: K/V of a token is a deterministic function of the tokens
up to and including it, as in a real transformer, so prompts sharing a prefix produce the same
K/V for it.  A later demo swaps in a real model (GPT-2) through the same :class:`KVModel`
shape: ``kv(tokens, start) -> (k, v)`` for positions ``start..len(tokens)``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import random
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol, TextIO

import structlog
import torch

from aiocache_kv.bench.report import heading, table
from aiocache_kv.cache import HiCache
from aiocache_kv.config import CacheConfig
from aiocache_kv.errors import KVCacheError
from aiocache_kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from aiocache_kv.handles import MatchResult
from aiocache_kv.stats import CacheStatistics
from aiocache_kv.storage import FileStorage, MooncakeStorage, StorageBackend

log = structlog.get_logger(__name__)

VOCAB = 50257  # GPT-2's, so a later real-model demo can keep the same prompts' shape


class KVModel(Protocol):
    """What the demo needs from a model: K/V for ``tokens[start:]`` given the whole prefix."""

    def kv(self, tokens: Sequence[int], start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions ``start..len(tokens)``: ``[layers, n, heads, head_dim]`` each."""
        ...


@dataclass(frozen=True)
class FakeModel:
    """Deterministic stand-in for a transformer: K/V depend on the whole prefix."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def kv(self, tokens: Sequence[int], start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of ``tokens[start:]`` (see :func:`fake_kv`)."""
        return fake_kv(self, tokens, start)


def _prefix_hashes(tokens: Sequence[int]) -> list[int]:
    out: list[int] = []
    h = b"aiocache-kv-demo"
    for t in tokens:
        h = hashlib.blake2b(h + t.to_bytes(8, "little"), digest_size=8).digest()
        out.append(int.from_bytes(h, "little"))
    return out


def fake_kv(
    model: FakeModel, tokens: Sequence[int], start: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[layers, n, heads, head_dim]`` for positions ``start..len(tokens)``.

    Position ``i`` gets values derived from a hash of ``tokens[: i + 1]``, so equal prefixes
    give equal K/V (bit for bit) and different prefixes give different K/V.
    """
    hashes = _prefix_hashes(tokens)[start:]
    seed = torch.tensor([h % (1 << 31) for h in hashes], dtype=torch.float64) / (1 << 31)
    width = model.num_layers * 2 * model.num_kv_heads * model.head_dim
    grid = torch.arange(width, dtype=torch.float64)
    vals = torch.sin(seed[:, None] * 1000.0 + grid * 0.37).to(model.dtype)
    vals = vals.view(len(hashes), model.num_layers, 2, model.num_kv_heads, model.head_dim)
    vals = vals.permute(1, 2, 0, 3, 4)  # [layers, 2, n, heads, dim]
    return vals[:, 0], vals[:, 1]


def make_prompts(seed: int, page_size: int) -> list[tuple[str, list[int]]]:
    """A shared system prompt plus three user turns (lengths not page-aligned on purpose)."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(VOCAB) for _ in range(n)]

    system = toks(6 * page_size)
    return [
        ("chat A turn 1", system + toks(3 * page_size + 1)),
        ("chat B turn 1", system + toks(2 * page_size + page_size // 2)),
        ("chat C turn 1", system + toks(4 * page_size)),
    ]


def demo_config(args: argparse.Namespace, storage: StorageBackend | None = None) -> CacheConfig:
    """The demo's cache: a tiny float32 KV on CPU, write-through to host (and to storage)."""
    return CacheConfig(
        page_size=args.page_size,
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        dtype=torch.float32,
        device="cpu",
        device_pages=args.device_pages,
        host_pages=args.host_pages,
        write_policy="write_through",
        namespace="demo-model",
        host_memory_reserve_bytes=0,
        storage=storage,
        prefetch_policy="wait_complete",
        prefetch_threshold_tokens=0,  # the demo's prompts are short
    )


@dataclass
class StorageSetup:
    """Where the demo's L3 lives; ``make()`` gives each node its own backend object."""

    kind: str  #: "file" | "mooncake" | "none"
    path: str | None = None
    master: str | None = None
    metadata: str | None = None

    def make(self) -> StorageBackend | None:
        """A fresh backend on the same storage (each cache closes its own)."""
        if self.kind == "file":
            assert self.path is not None
            return FileStorage(self.path)
        if self.kind == "mooncake":
            return MooncakeStorage(
                master=self.master,
                metadata_server=self.metadata,
                local_hostname="127.0.0.1",
                protocol="tcp",
                device_name="",
                global_segment_size=32 << 20,
                local_buffer_size=16 << 20,
            )
        return None

    def describe(self) -> str:
        """One line for the header."""
        if self.kind == "file":
            return f"FileStorage at {self.path}"
        if self.kind == "mooncake":
            return f"MooncakeStorage, master {self.master}"
        return "no storage tier"


@contextlib.asynccontextmanager
async def storage_setup(args: argparse.Namespace) -> AsyncIterator[StorageSetup]:
    """The storage the demo uses: a temp dir (removed afterwards) or ``--storage-dir`` for
    ``file``; a loopback master (stopped afterwards) unless ``--master`` for ``mooncake``."""
    kind = getattr(args, "storage", "none")
    if kind == "file":
        given: str | None = getattr(args, "storage_dir", None)
        path = given
        if path is None:
            path = await asyncio.to_thread(lambda: tempfile.mkdtemp(prefix="aiocache-kv-demo-"))
        try:
            yield StorageSetup("file", path=path)
        finally:
            if not given:
                await asyncio.to_thread(shutil.rmtree, path, True)
    elif kind == "mooncake":
        if getattr(args, "master", None):
            yield StorageSetup("mooncake", master=args.master, metadata=args.metadata)
            return
        from aiocache_kv.bench.mooncake_master import LoopbackMaster

        master = LoopbackMaster()
        await asyncio.to_thread(master.start)
        try:
            yield StorageSetup("mooncake", master=master.rpc_addr, metadata=master.metadata_url)
        finally:
            await asyncio.to_thread(master.terminate)
    else:
        yield StorageSetup("none")


class Walkthrough:
    """The demo's steps over one running cache; each step prints what it did."""

    def __init__(self, cache: HiCache, model: KVModel, out: TextIO) -> None:
        self.cache = cache
        self.model = model
        self.out = out
        self.mismatches: list[str] = []

    def say(self, text: str) -> None:
        """Print one line of narration."""
        print(text, file=self.out)

    async def prefill(self, name: str, tokens: list[int]) -> None:
        """Serve one prompt: reuse the cached prefix, compute and cache the rest."""
        cache = self.cache
        p = cache.config.page_size
        m = cache.match_prefix(tokens)
        if m.host_len:
            await cache.load_back(m)
        reused = m.device_len
        new = len(tokens) - reused
        slots = cache.alloc(new)  # whole pages; the unaligned tail's page stays ours
        k_new, v_new = self.model.kv(tokens, reused)
        for layer in range(cache.config.num_layers):
            k, v = cache.device_kv(layer)
            k[slots[:new]] = k_new[layer]
            v[slots[:new]] = v_new[layer]
        r = cache.insert(tokens, torch.cat([m.device_indices, slots[:new]]))
        if r.write_through is not None:
            await r.write_through
        aligned = len(tokens) // p * p
        if aligned < len(tokens):  # the tail page is not cached: hand its slots back
            cache.free(slots[aligned - reused :])
        cache.release(r)
        cache.release(m)
        self.say(
            f"  {name}: {len(tokens)} tokens, reused {reused} from device, computed {new}, "
            f"cached {aligned} ({aligned // p} pages, written through to host)"
        )

    def match_all(self, prompts: Sequence[tuple[str, list[int]]]) -> list[MatchResult]:
        """Match every prompt and print its device/host hits (the handles stay pinned)."""
        matches = [self.cache.match_prefix(t) for _, t in prompts]
        table(
            ["prompt", "tokens", "device hit", "host hit", "miss"],
            [
                [name, len(t), m.device_len, m.host_len, len(t) - m.device_len - m.host_len]
                for (name, t), m in zip(prompts, matches, strict=True)
            ],
            out=self.out,
        )
        return matches

    def check_data(self, name: str, tokens: list[int], m: MatchResult) -> bool:
        """Compare the K/V at ``m.device_indices`` with what the model computes."""
        n = m.device_len
        idx = m.device_indices
        k_ref, v_ref = self.model.kv(tokens[:n], 0)
        ok = True
        for layer in range(self.cache.config.num_layers):
            k, v = self.cache.device_kv(layer)
            if not (torch.equal(k[idx], k_ref[layer]) and torch.equal(v[idx], v_ref[layer])):
                self.mismatches.append(f"{name} layer {layer}")
                ok = False
        return ok


def _short(h: int | None) -> str:
    return "-" if h is None else f"{h:016x}"[:10]


def print_events(events: Sequence[KVEvent], out: TextIO) -> None:
    """KV events as a table (one row per event)."""
    rows: list[list[object]] = []
    for i, ev in enumerate(events, 1):
        if isinstance(ev, BlockStored):
            rows.append(
                [
                    i,
                    "BlockStored",
                    ev.medium,
                    len(ev.block_hashes),
                    len(ev.token_ids),
                    _short(ev.block_hashes[0]),
                    _short(ev.parent_block_hash),
                ]
            )
        elif isinstance(ev, BlockRemoved):
            rows.append(
                [
                    i,
                    "BlockRemoved",
                    ev.medium,
                    len(ev.block_hashes),
                    "",
                    _short(ev.block_hashes[0]),
                    "",
                ]
            )
        elif isinstance(ev, AllBlocksCleared):
            rows.append([i, "AllBlocksCleared", "", "", "", "", ""])
    table(
        ["#", "event", "medium", "pages", "tokens", "first hash", "parent hash"],
        rows,
        out=out,
        align="rlllrll",
    )


def print_statistics(st: CacheStatistics, out: TextIO) -> None:
    """``statistics()`` as two small tables: per tier, then the counters."""
    table(
        ["tier", "total", "free", "held", "evictable", "protected"],
        [
            [name, t.total_pages, t.free_pages, t.held_pages, t.evictable_pages, t.protected_pages]
            for name, t in (("device (L1)", st.device), ("host (L2)", st.host))
        ],
        out=out,
    )
    print(file=out)
    skip = {"device", "host"}
    counters = [[k, getattr(st, k)] for k in st.__dataclass_fields__ if k not in skip]
    table(["counter", "value"], counters, out=out)


STORAGE_COUNTERS = (
    "backup_started",
    "backup_pages_ok",
    "backup_pages_failed",
    "prefetch_queries",
    "prefetch_storage_hit_tokens",
    "prefetch_hit_tokens",
    "prefetch_pages_discarded",
    "storage_errors",
)


def print_storage_statistics(st: CacheStatistics, out: TextIO) -> None:
    """The storage-tier counters of ``statistics()``."""
    table(["storage counter", "value"], [[k, getattr(st, k)] for k in STORAGE_COUNTERS], out=out)


async def run_demo(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run the walkthrough; return 0 when every data check passed, 1 otherwise."""
    stream = out if out is not None else sys.stdout
    try:
        demo_config(args)
    except KVCacheError as exc:
        log.error("demo_bad_config", error=str(exc))
        return 2
    try:
        async with storage_setup(args) as setup:
            return await _walkthrough(args, setup, stream)
    except KVCacheError as exc:
        log.error("demo_failed", error=str(exc), error_type=type(exc).__name__)
        print(f"demo failed: {type(exc).__name__}: {exc}", file=stream)
        return 1


async def _walkthrough(args: argparse.Namespace, setup: StorageSetup, stream: TextIO) -> int:
    cfg = demo_config(args, setup.make())
    model = FakeModel(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.dtype)
    prompts = make_prompts(args.seed, cfg.page_size)
    print(
        f"aiocache-kv demo: page_size={cfg.page_size}, device_pages={cfg.device_pages}, "
        f"host_pages={cfg.host_pages}, {cfg.num_layers} layers x {cfg.num_kv_heads} heads x "
        f"{cfg.head_dim} dims {str(cfg.dtype).replace('torch.', '')}, write_through, seed "
        f"{args.seed}; L3: {setup.describe()}",
        file=stream,
    )
    async with contextlib.AsyncExitStack() as stack:
        cache = await stack.enter_async_context(HiCache(cfg))
        w = Walkthrough(cache, model, stream)
        heading("1. prefill: KV written at alloc() slots, insert, write-through", out=stream)
        for name, toks in prompts:
            await w.prefill(name, toks)

        heading("2. match: every prompt is a device hit", out=stream)
        matches = w.match_all(prompts)
        device_ok = all(
            w.check_data(name, t, m) for (name, t), m in zip(prompts, matches, strict=True)
        )
        for m in matches:
            cache.release(m)

        heading("3. evict every device page (write-through copies stay on host)", out=stream)
        evictable = cache.statistics().device.evictable_pages
        freed = cache.evict(evictable)
        w.say(f"  evict({evictable}) freed {freed} device pages; the nodes are now host-only")

        heading("4. match again: host hits; await load_back(m)", out=stream)
        matches = w.match_all(prompts)
        for m in matches:
            await cache.load_back(m)
        w.say("  after load_back:")
        table(
            ["prompt", "device hit", "host hit"],
            [
                [name, m.device_len, m.host_len]
                for (name, _), m in zip(prompts, matches, strict=True)
            ],
            out=stream,
        )

        heading("5. data check: loaded KV vs what the model wrote", out=stream)
        loaded_ok = all(
            w.check_data(name, t, m) for (name, t), m in zip(prompts, matches, strict=True)
        )
        for m in matches:
            cache.release(m)
        await cache.flush()
        cache.check_invariants()
        checked = sum(m.device_len for m in matches)
        if device_ok and loaded_ok:
            w.say(
                f"  data check PASSED: {checked} tokens x {cfg.num_layers} layers of K and V "
                "are bit-identical after device -> host -> device"
            )
        else:
            w.say(f"  data check FAILED: {', '.join(w.mismatches)}")

        step = 6
        if cfg.storage is not None:
            heading(
                f"{step}. await flush() (backups to storage landed), then evict device AND host",
                out=stream,
            )
            await cache.flush()
            st = cache.statistics()
            w.say(
                f"  {st.backup_pages_ok} pages backed up to storage "
                f"({st.backup_pages_failed} failed)"
            )
            dev = cache.evict(cache.statistics().device.evictable_pages)
            host = cache.evict(cache.statistics().host.evictable_pages, "host")
            w.say(f"  evicted {dev} device pages, then {host} host pages; match now:")
            for m in w.match_all(prompts):
                cache.release(m)
            step += 1

        heading(f"{step}. KV events (take_events)", out=stream)
        print_events(cache.take_events(), stream)
        heading(f"{step + 1}. statistics()", out=stream)
        print_statistics(cache.statistics(), stream)
        step += 2
        restart_ok = True
        if cfg.storage is not None:
            if setup.kind == "file":
                await cache.aclose()  # a true restart: node 1 is gone, its files stay
                how = "node 1 closed; a fresh cache opens the same directory"
            else:
                how = "node 1 stays up (its segment holds the pages); node 2 is a second client"
            restart_ok = await _restarted_node(args, setup, model, prompts, stream, step, how)
    return 0 if device_ok and loaded_ok and restart_ok else 1


async def _restarted_node(
    args: argparse.Namespace,
    setup: StorageSetup,
    model: KVModel,
    prompts: Sequence[tuple[str, list[int]]],
    stream: TextIO,
    step: int,
    how: str,
) -> bool:
    """A fresh cache on the same storage: prefetch, storage hits, load back, data check."""
    heading(f"{step}. restarted node: fresh cache on the same storage; await prefetch", out=stream)
    print(f"  {how}", file=stream)
    async with HiCache(demo_config(args, setup.make())) as cache:
        w = Walkthrough(cache, model, stream)
        rows: list[list[object]] = []
        total = 0
        for name, toks in prompts:
            before = cache.match_prefix(toks)
            cached = before.device_len + before.host_len
            cache.release(before)
            res = await cache.prefetch(toks)
            total += res.hit_tokens
            rows.append(
                [name, len(toks), cached, res.storage_hit_tokens, res.hit_tokens, res.status.value]
            )
        table(
            ["prompt", "tokens", "cached before", "storage hit", "prefetched", "status"],
            rows,
            out=stream,
        )
        w.say(f"  storage hits: {total} tokens prefetched from storage into the host tier")

        heading(f"{step + 1}. match (host hits) + load_back + data check", out=stream)
        matches = w.match_all(prompts)
        for m in matches:
            await cache.load_back(m)
        ok = all(
            m.device_len == len(t) // cache.config.page_size * cache.config.page_size
            for (_, t), m in zip(prompts, matches, strict=True)
        )
        ok = ok and all(
            w.check_data(name, t, m) for (name, t), m in zip(prompts, matches, strict=True)
        )
        for m in matches:
            cache.release(m)
        await cache.flush()
        cache.check_invariants()
        checked = sum(m.device_len for m in matches)
        if ok:
            w.say(
                f"  data check PASSED: {checked} tokens x {cache.config.num_layers} layers of K "
                "and V are bit-identical after device -> host -> storage -> (restart) -> host "
                "-> device"
            )
        else:
            w.say(f"  restarted-node data check FAILED: {', '.join(w.mismatches) or 'short'}")

        heading(f"{step + 2}. KV events of the restarted node", out=stream)
        print_events(cache.take_events(), stream)
        heading(f"{step + 3}. storage statistics of the restarted node", out=stream)
        print_storage_statistics(cache.statistics(), stream)
    return ok
