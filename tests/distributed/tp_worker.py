"""One tensor-parallel rank for the TP agreement tests (run as a subprocess per rank).

Every rank runs the same serving script against its own HiCache, its own FileStorage (which
holds a different number of pages on every rank) and a copy engine whose completions arrive
in a rank-specific random order.  It prints one JSON line describing what it ended with.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import aiocache_kv as akv
from aiocache_kv.storage import storage_key
from aiocache_kv.storage.key_layout import key_components
from aiocache_kv.testing import RandomDelayEngine
from aiocache_kv.tree.hashing import chain_hashes, namespace_seed

PAGE = 2
PROMPT = [(7 * i) % 97 + 1 for i in range(32)]  # 16 pages


COMPONENTS = (
    akv.SlidingWindow(
        4, num_layers=1, num_kv_heads=1, head_dim=4, page_size=PAGE, dtype=torch.float32
    ),
    akv.MambaState((3,), page_size=PAGE),
)


def config(storage: akv.FileStorage, hybrid: bool = False, **kw: Any) -> akv.CacheConfig:
    opts: dict[str, Any] = dict(
        components=COMPONENTS if hybrid else (),
        page_size=PAGE,
        num_layers=2,
        num_kv_heads=2,
        head_dim=4,
        dtype=torch.float32,
        device_pages=32,  # unreleased results retain their copies of PROMPT
        host_pages=48,
        host_memory_reserve_bytes=0,
        storage=storage,
        prefetch_threshold_tokens=0,
        prefetch_policy="timeout",
        prefetch_timeout_base=2.0,
        prefetch_batch_pages=3,
    )
    opts.update(kw)
    return akv.CacheConfig(**opts)


def fill(cache: akv.HiCache, slots: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for layer in range(cache.config.num_layers):
        for buf in cache.device_kv(layer):
            buf[slots] = torch.randn((slots.numel(), *buf.shape[1:]), generator=g)


async def seed_storage(
    root: Path, rank: int, world: int, keep: int, hybrid: bool, swa_hole: int | None
) -> None:
    """Write PROMPT to this rank's store under its TP-shard keys, keep the first ``keep``
    KV pages, and (hybrid) drop SWA page ``swa_hole``."""
    store = akv.FileStorage(root)
    components = key_components(config(store, hybrid), rank, world)
    async with akv.HiCache(config(store, hybrid)) as cache:
        assert cache._l3 is not None
        # write as rank `rank` of `world` would
        cache._l3._suffixes = components
        if hybrid:
            for comp in COMPONENTS:
                buf = cache.sidecar(comp.name)
                buf.copy_(torch.arange(buf.numel(), dtype=buf.dtype).view(buf.shape))
        slots = cache.alloc(len(PROMPT))
        fill(cache, slots, seed=99)
        cache.release(cache.insert(PROMPT, slots))
        await cache.flush()
    ns = akv.Namespace("default")
    hashes = chain_hashes(namespace_seed(ns.tag), PROMPT, PAGE)
    drop = [storage_key(ns.tag, h, components[0]) for h in hashes[keep:]]
    if swa_hole is not None:
        drop.append(storage_key(ns.tag, hashes[swa_hole], components[1]))
    fresh = akv.FileStorage(root)  # the cache closed the first handle
    removed = await asyncio.to_thread(fresh.remove, drop)
    assert all(removed), removed
    await asyncio.to_thread(fresh.close)


def shape(cache: akv.HiCache) -> list[Any]:
    return sorted(
        (n.key, n.device.name, n.host.name, n.storage.name, n.pins) for n in cache._tree.walk()
    )


def describe(ev: akv.KVEvent) -> list[Any]:
    return [type(ev).__name__, getattr(ev, "medium", None), getattr(ev, "token_ids", None)]


async def serve(args: argparse.Namespace) -> dict[str, Any]:
    rank, world = args.rank, args.world
    root = Path(args.dir) / f"rank{rank}"
    if args.hybrid:  # same KV everywhere, a SWA hole at a different page on every rank
        keep, hole = 16, (None if rank == 0 else 15 - 2 * rank)
    else:  # every rank's store holds a different number of pages
        keep, hole = 16 - 3 * rank, None
    await seed_storage(root, rank, world, keep, args.hybrid, hole)
    group = init_group(args)
    out: dict[str, Any] = {"rank": rank}
    engine = RandomDelayEngine(seed=1000 + rank, max_delay=0.03)
    cfg = config(akv.FileStorage(root), args.hybrid)
    async with akv.HiCache(cfg, copy_engine=engine, tp_group=group) as cache:
        res = await cache.prefetch(PROMPT)
        out["prefetch"] = [res.status.value, res.hit_tokens]
        m = cache.match_prefix(PROMPT)
        out["match_after_prefetch"] = [m.device_len, m.host_len]
        short = cache.match_prefix(PROMPT[:28])  # ends where a rank may have a SWA hole
        out["short_match"] = short.matched_len
        cache.release(short)
        await cache.load_back(m)
        out["after_load"] = [m.device_len, m.host_len]
        cache.release(m)
        handles = []
        for i in range(6):
            tokens = PROMPT[: 4 + 2 * i] + [200 + i] * 6
            slots = await cache.alloc_wait(len(tokens))
            fill(cache, slots, seed=i)
            handles.append(cache.insert(tokens, slots))
            if len(handles) > 2:
                cache.release(handles.pop(0))
            if i % 2:
                await cache.sync()
        for h in handles:
            cache.release(h)
        cache.evict(10)
        other = await cache.prefetch([300 + i for i in range(20)])  # nothing stored
        out["miss"] = [other.status.value, other.hit_tokens]
        m = cache.match_prefix([*PROMPT[:10], 1, 2])
        await cache.load_back(m)
        out["second_load"] = [m.device_len, m.host_len]
        cache.release(m)
        # a cancelled load_back: its agreement still happens on every rank
        cache.evict(100)
        m = cache.match_prefix(PROMPT)
        task = asyncio.create_task(cache.load_back(m))
        await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await cache.flush()
        cache.release(m)
        cache.check_invariants()
        out["shape"] = shape(cache)
        out["events"] = [describe(e) for e in cache.take_events()]
        stats = cache.statistics()
        out["stats"] = [stats.nodes, stats.device.free_pages, stats.host.free_pages]
        out["collectives"] = group.calls
    dist.destroy_process_group()
    return out


def init_group(args: argparse.Namespace) -> akv.TorchTPGroup:
    """Join the gloo group of ``args.world`` ranks on 127.0.0.1 as ``args.rank``."""
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=args.rank,
        world_size=args.world,
        timeout=datetime.timedelta(seconds=60),
    )
    return akv.TorchTPGroup()


def run_rank(
    serve_fn: Callable[[argparse.Namespace], Awaitable[dict[str, Any]]],
    add_args: Callable[[argparse.ArgumentParser], None],
) -> None:
    """Parse the rank's arguments (the common ones plus ``add_args``'), serve, print the
    result line the test reads."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--dir", required=True)
    add_args(ap)
    args = ap.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    result = asyncio.run(serve_fn(args))
    print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    run_rank(serve, lambda ap: ap.add_argument("--hybrid", action="store_true"))


if __name__ == "__main__":
    main()
