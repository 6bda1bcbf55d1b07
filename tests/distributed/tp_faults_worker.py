"""One rank of ``test_tp_faults``: what one rank does alone must not part the ranks.

``--scenario``: ``misconfigured`` (ranks configured differently), ``retry_start`` (one rank's
first start fails), ``peer_gone`` (a peer closes
and leaves), ``cancel`` (one rank's caller cancels ``--call``: prefetch, load_back, flush or
warm, after its ticket was taken), ``leaked_handle`` (a handle dropped unreleased while one
rank's flush yields to its loop and the other's does not).

Prints one ``RESULT {json}`` line (see ``tp_worker.run_rank``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist

import aiocache_kv as akv
from aiocache_kv.errors import AgreementError, ConfigError, StorageUnavailableError
from aiocache_kv.testing import MemoryStorage, RandomDelayEngine
from tests.distributed.tp_worker import PROMPT, config, fill, init_group, run_rank, shape
from tests.flaky_stores import FlakyMemory


def insert_prompt(cache: akv.HiCache) -> None:
    slots = cache.alloc(len(PROMPT))
    fill(cache, slots, seed=1)
    cache.release(cache.insert(PROMPT, slots))


async def retry_start(args: argparse.Namespace, group: akv.TorchTPGroup) -> dict[str, Any]:
    """Rank 1's first start fails and it starts again: every rank agrees as one."""
    store = FlakyMemory(fails=1 if args.rank == 1 else 0)
    cache = akv.HiCache(config(store, prefetch_policy="wait_complete"), tp_group=group)
    out: dict[str, Any] = {"retried": False}
    try:
        await cache.start()
    except StorageUnavailableError:
        out["retried"] = True
        await cache.start()
    insert_prompt(cache)
    await asyncio.wait_for(cache.flush(), 60)
    await asyncio.wait_for(cache.sync(), 60)
    cache.check_invariants()
    out["shape"] = shape(cache)
    out["backup_ok"] = cache.statistics().backup_pages_ok
    await asyncio.wait_for(cache.aclose(), 60)
    out["collectives"] = group.calls
    return out


async def peer_gone(args: argparse.Namespace, group: akv.TorchTPGroup) -> dict[str, Any]:
    """Rank 1 closes and leaves; rank 0's agreement fails, and its close still closes every
    part (storage tier, copy engine, agreement thread) before raising."""
    store = MemoryStorage()
    cache = akv.HiCache(config(store), tp_group=group)
    await cache.start()
    insert_prompt(cache)
    out: dict[str, Any] = {}
    if args.rank == 1:
        await cache.aclose()
        return out
    await asyncio.sleep(1.0)  # rank 1 has closed and left
    try:
        for _ in range(6):
            await asyncio.wait_for(cache.sync(), 60)
        out["sync"] = "ok"
    except AgreementError:
        out["sync"] = "AgreementError"
    try:
        await asyncio.wait_for(cache.aclose(), 60)
        out["aclose"] = "ok"
    except AgreementError:
        out["aclose"] = "AgreementError"
    await asyncio.sleep(0.3)
    out["store_closed"] = store._closed
    out["threads"] = sorted(
        t.name for t in threading.enumerate() if t.name.startswith(("aiocache-kv", "akv"))
    )
    return out


async def misconfigured(args: argparse.Namespace, group: akv.TorchTPGroup) -> dict[str, Any]:
    """Rank 1 has no storage tier and another host pool size: every rank's start is refused,
    naming what differs, and leaves nothing running; started again alike, the ranks agree."""
    store = MemoryStorage()
    wrong = config(store) if args.rank == 0 else config(None, host_pages=40)  # type: ignore[arg-type]
    cache = akv.HiCache(wrong, tp_group=group)
    out: dict[str, Any] = {"refused": ""}
    try:
        await asyncio.wait_for(cache.start(), 60)
    except ConfigError as exc:
        out["refused"] = str(exc)
    await asyncio.wait_for(cache.aclose(), 60)
    for _ in range(50):  # the abandoned tier's workers stop once their calls return
        out["threads"] = sorted(
            t.name for t in threading.enumerate() if t.name.startswith(("aiocache-kv", "akv"))
        )
        if not out["threads"]:
            break
        await asyncio.sleep(0.1)
    cache = akv.HiCache(config(store, prefetch_policy="wait_complete"), tp_group=group)
    await asyncio.wait_for(cache.start(), 60)
    insert_prompt(cache)
    await asyncio.wait_for(cache.flush(), 60)
    await asyncio.wait_for(cache.sync(), 60)
    cache.check_invariants()
    out["shape"] = shape(cache)
    await asyncio.wait_for(cache.aclose(), 60)
    out["collectives"] = group.calls
    return out


async def only_in_storage(cache: akv.HiCache) -> None:
    """PROMPT stored, then evicted from device and host (only storage has it)."""
    insert_prompt(cache)
    await cache.flush()
    cache.evict(1000)
    await cache.flush()
    cache.evict(1000, "host")
    await cache.sync()


async def cancel(args: argparse.Namespace, group: akv.TorchTPGroup) -> dict[str, Any]:
    """Rank 0's caller cancels ``args.call`` once its ticket is taken; then the same calls on
    every rank.  The cancelled rank applies what the call agreed where the others do."""
    store = akv.FileStorage(Path(args.dir) / f"r{args.rank}")
    engine = RandomDelayEngine(seed=7 + args.rank, max_delay=0.1)
    cfg = config(store, prefetch_policy="wait_complete")
    cache = akv.HiCache(cfg, copy_engine=engine, tp_group=group)
    await cache.start()
    m = None
    if args.call in ("prefetch", "warm"):
        await only_in_storage(cache)
        coro: Any = cache.prefetch(PROMPT) if args.call == "prefetch" else cache.warm(PROMPT)
    elif args.call == "load_back":
        insert_prompt(cache)
        await cache.flush()
        cache.evict(1000)  # the host copy stays
        await cache.sync()
        m = cache.match_prefix(PROMPT)
        coro = cache.load_back(m)
    else:
        insert_prompt(cache)
        coro = cache.flush()
    task = asyncio.ensure_future(coro)
    # the ticket is taken (at its first step), and flush/warm are under way
    await asyncio.sleep(0.05 if args.call in ("flush", "warm") else 0)
    if args.rank == 0:
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    if m is not None:
        cache.release(m)
    again = cache.match_prefix(PROMPT)
    await asyncio.wait_for(cache.load_back(again), 60)
    cache.release(again)
    for _ in range(2):
        await asyncio.wait_for(cache.sync(), 60)
    cache.check_invariants()
    out = {"shape": shape(cache)}
    await asyncio.wait_for(cache.aclose(), 60)
    out["collectives"] = group.calls
    return out


class SlowExists(akv.FileStorage):
    slow = False

    def exists(self, keys: Any) -> Any:
        if self.slow:
            time.sleep(1.5)
        return super().exists(keys)


async def leaked_handle(args: argparse.Namespace, group: akv.TorchTPGroup) -> dict[str, Any]:
    """A handle dropped unreleased on every rank, while rank 1's flush yields to its loop
    (an ``exists`` call still running past its deadline) and rank 0's does not."""
    warnings.simplefilter("ignore", ResourceWarning)
    store = SlowExists(Path(args.dir) / f"r{args.rank}")
    cfg = config(store, storage_timeout=0.5, prefetch_timeout_base=0.2, prefetch_timeout_max=0.2)
    cache = akv.HiCache(cfg, tp_group=group)
    await cache.start()
    insert_prompt(cache)
    await cache.flush()
    store.slow = args.rank == 1
    await cache.prefetch([500 + i for i in range(20)])  # rank 1's exists outlives it
    m = cache.match_prefix(PROMPT)
    del m  # leaked
    await cache.flush()
    out: dict[str, Any] = {"evicted": cache.evict(100)}
    await cache.sync()
    out["evicted_after_sync"] = cache.evict(100)
    out["shape"] = shape(cache)
    await asyncio.wait_for(cache.aclose(), 60)
    out["collectives"] = group.calls
    return out


SCENARIOS = {
    "retry_start": retry_start,
    "peer_gone": peer_gone,
    "cancel": cancel,
    "leaked_handle": leaked_handle,
    "misconfigured": misconfigured,
}


async def serve(args: argparse.Namespace) -> dict[str, Any]:
    group = init_group(args)
    out = await SCENARIOS[args.scenario](args, group)
    out["rank"] = args.rank
    if args.scenario != "peer_gone":
        dist.destroy_process_group()
    return out


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--scenario", required=True, choices=sorted(SCENARIOS))
    ap.add_argument("--call", default="", choices=("", "prefetch", "load_back", "flush", "warm"))


def main() -> None:
    run_rank(serve, add_args)


if __name__ == "__main__":
    main()
