"""Node B of the two-process embedding tests (run as ``python -m tests.embedding.emb_node``).

``read``: open its own EmbeddingCache (own Mooncake client), ``get_batch`` the given hashes
(hex of the raw hash bytes) and print one JSON line ``{"digests": [...], "stats": {...}}``
where a digest is ``"<tokens>x<dim>:<sha256 of the bytes>"`` or ``null``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json

import torch

from aiocache_kv.embedding import EmbeddingCache
from aiocache_kv.storage import MooncakeStorage


def digest(t: torch.Tensor | None) -> str | None:
    if t is None:
        return None
    data = t.contiguous().view(torch.uint8).numpy().tobytes()
    return f"{t.shape[0]}x{t.shape[1]}:{hashlib.sha256(data).hexdigest()}"


def store(master: str, metadata: str, segment: int) -> MooncakeStorage:
    return MooncakeStorage(
        master=master,
        metadata_server=metadata,
        local_hostname="127.0.0.1",
        protocol="tcp",
        device_name="",
        global_segment_size=segment,
        local_buffer_size=16 << 20,
        rpc_timeout_ms=1500,
        check_existing=True,  # the tests count what a push re-sends
    )


async def read(args: argparse.Namespace) -> None:
    hashes = [bytes.fromhex(h) for h in args.hashes.split(",") if h]
    cache = EmbeddingCache(
        pool_bytes=8 << 20, store=store(args.master, args.metadata, 0), namespace=args.namespace
    )
    async with cache:
        got = await cache.get_batch(hashes)
        cache.check_invariants()
        stats = dataclasses.asdict(cache.statistics())
    print(json.dumps({"digests": [digest(t) for t in got], "stats": stats}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["read"])
    ap.add_argument("--master", required=True)
    ap.add_argument("--metadata", required=True)
    ap.add_argument("--namespace", required=True)
    ap.add_argument("--hashes", default="", help="comma-separated hex of the raw hashes")
    asyncio.run(read(ap.parse_args()))


if __name__ == "__main__":
    main()
