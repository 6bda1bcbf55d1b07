"""A second serving node for the two-process Mooncake tests (run as a subprocess).

``writer``: insert a seeded prompt through a HiCache backed by MooncakeStorage, flush, print
``READY <sha256 of the KV>``, then keep the client (and its segment) alive until stdin closes.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import sys

import torch

import aiocache_kv as akv
from aiocache_kv.storage import MooncakeStorage


def node_config(master: str, metadata: str, namespace: str) -> akv.CacheConfig:
    return akv.CacheConfig(
        page_size=4,
        num_layers=2,
        num_kv_heads=2,
        head_dim=32,
        dtype=torch.float16,
        device_pages=64,
        host_pages=64,
        host_memory_reserve_bytes=0,
        namespace=namespace,
        prefetch_threshold_tokens=0,
        prefetch_policy="wait_complete",
        storage_timeout=3.0,
        storage=MooncakeStorage(
            master=master,
            metadata_server=metadata,
            local_hostname="127.0.0.1",
            protocol="tcp",
            device_name="",
            global_segment_size=32 << 20,
            local_buffer_size=16 << 20,
            rpc_timeout_ms=1500,
        ),
    )


def prompt(n: int = 64) -> list[int]:
    return [(i * 7919) % 5000 for i in range(n)]


def fill(cache: akv.HiCache, slots: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for layer in range(cache.config.num_layers):
        for buf in cache.device_kv(layer):
            buf[slots] = torch.randn((slots.numel(), *buf.shape[1:]), generator=g).half()


def digest(cache: akv.HiCache, slots: torch.Tensor) -> str:
    h = hashlib.sha256()
    for layer in range(cache.config.num_layers):
        for buf in cache.device_kv(layer):
            h.update(buf[slots].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


async def writer(args: argparse.Namespace) -> None:
    async with akv.HiCache(node_config(args.master, args.metadata, args.namespace)) as cache:
        tokens = prompt()
        slots = cache.alloc(len(tokens))
        fill(cache, slots, seed=5)
        cache.release(cache.insert(tokens, slots))
        await cache.flush()
        stats = cache.statistics()
        print(f"READY {digest(cache, slots)} {stats.backup_pages_ok}", flush=True)
        await asyncio.to_thread(sys.stdin.read)  # until the test closes our stdin


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["writer"])
    ap.add_argument("--master", required=True)
    ap.add_argument("--metadata", required=True)
    ap.add_argument("--namespace", required=True)
    asyncio.run(writer(ap.parse_args()))


if __name__ == "__main__":
    main()
