"""One rank of ``test_tp_lifecycle``: start and close under tensor parallelism when one rank's
start fails once (``--scenario retry_start``) or a peer leaves (``--scenario peer_gone``).

Prints one ``RESULT {json}`` line (see ``tp_worker.run_rank``).
"""

from __future__ import annotations

import argparse
import asyncio
import threading
from typing import Any

import torch.distributed as dist

import aiocache_kv as akv
from aiocache_kv.errors import AgreementError, StorageUnavailableError
from aiocache_kv.testing import MemoryStorage
from tests.distributed.tp_worker import PROMPT, config, fill, init_group, run_rank, shape


class FlakyOpen(MemoryStorage):
    """Its first ``open`` fails when ``fail`` is set."""

    def __init__(self, fail: bool) -> None:
        super().__init__()
        self.fail = fail

    def open(self) -> None:
        if self.fail:
            self.fail = False
            raise StorageUnavailableError("injected: the first open fails")
        super().open()


def insert_prompt(cache: akv.HiCache) -> None:
    slots = cache.alloc(len(PROMPT))
    fill(cache, slots, seed=1)
    cache.release(cache.insert(PROMPT, slots))


async def retry_start(args: argparse.Namespace, group: akv.TorchTPGroup) -> dict[str, Any]:
    """Rank 1's first start fails and it starts again: every rank agrees as one."""
    store = FlakyOpen(fail=args.rank == 1)
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


async def serve(args: argparse.Namespace) -> dict[str, Any]:
    group = init_group(args)
    scenario = {"retry_start": retry_start, "peer_gone": peer_gone}[args.scenario]
    out = await scenario(args, group)
    out["rank"] = args.rank
    if args.scenario == "retry_start":
        dist.destroy_process_group()
    return out


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--scenario", required=True, choices=("retry_start", "peer_gone"))


def main() -> None:
    run_rank(serve, add_args)


if __name__ == "__main__":
    main()
