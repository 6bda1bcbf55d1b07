"""Two serving nodes share image embeddings through the Mooncake store.

    python examples/embedding_cache.py            # starts a loopback mooncake_master

A tiny ViT-like vision encoder (random weights, seeded: nothing is downloaded) turns 3x64x64
images into 16 x 128 embeddings.  Node A (a process) serves a stream of requests, node B
(another process, another Mooncake client) then serves requests over the same image
collection.  Each node hashes every image by content (sha256 of its bytes), asks its
``EmbeddingCache`` for the embeddings, runs the encoder only on the misses and inserts the whole
request (local hits are pushed too, so the global store always has them).  Node B skips the
encoder for every image node A already encoded; the script prints the encoder calls saved.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys

import torch

import aiocache_kv as akv
from aiocache_kv.embedding import EmbeddingCache

SCRIPT = os.path.abspath(__file__)
IMAGES = 24
REQUESTS = 20
PER_REQUEST = 3


class TinyVisionEncoder(torch.nn.Module):
    """16x16 patches -> linear patch embedding -> 2 transformer layers (seeded weights)."""

    def __init__(self, dim: int = 128) -> None:
        super().__init__()
        torch.manual_seed(0)  # every node builds the same encoder
        self.patch = torch.nn.Conv2d(3, dim, kernel_size=16, stride=16)
        layer = torch.nn.TransformerEncoderLayer(dim, 4, 2 * dim, dropout=0.0, batch_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.eval()

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.blocks(self.patch(images).flatten(2).transpose(1, 2))
        return out


def images_and_requests(node: str) -> tuple[list[torch.Tensor], list[list[int]]]:
    """The shared image collection and this node's requests (popular images repeat)."""
    g = torch.Generator().manual_seed(1)
    images = [torch.rand(3, 64, 64, generator=g) for _ in range(IMAGES)]
    weights = torch.tensor([1.0 / (i + 1) for i in range(IMAGES)])
    g = torch.Generator().manual_seed(2 if node == "A" else 3)
    reqs = [torch.multinomial(weights, PER_REQUEST, generator=g).tolist() for _ in range(REQUESTS)]
    return images, reqs


async def run_node(node: str, master: str, metadata: str) -> None:
    images, reqs = images_and_requests(node)
    hashes = [hashlib.sha256(im.numpy().tobytes()).hexdigest() for im in images]
    encoder = TinyVisionEncoder()
    store = akv.MooncakeStorage(
        master=master,
        metadata_server=metadata,
        local_hostname="127.0.0.1",
        protocol="tcp",
        global_segment_size=64 << 20,
        local_buffer_size=16 << 20,
    )
    calls = occurrences = 0
    async with EmbeddingCache(pool_bytes=32 << 20, store=store, namespace="tiny-vit") as cache:
        for req in reqs:
            hs = [hashes[i] for i in req]
            got = await cache.get_batch(hs)
            miss = [j for j, t in enumerate(got) if t is None]
            if miss:  # the encoder runs off the loop, only for images nobody encoded yet
                out = await asyncio.to_thread(encoder, torch.stack([images[req[j]] for j in miss]))
                for j, emb in zip(miss, out, strict=True):
                    got[j] = emb
                calls += len(miss)
            await cache.insert_batch(hs, [t for t in got if t is not None])
            occurrences += len(req)
        stats = cache.statistics()
        print(
            json.dumps(
                {
                    "node": node,
                    "images": occurrences,
                    "encoder_calls": calls,
                    "local_hits": stats.get_local_hits,
                    "from_other_node": stats.get_store_hits,
                }
            ),
            flush=True,
        )
        if node == "A":  # keep this client (and its store segment) alive until B is done
            print("READY", flush=True)
            await asyncio.to_thread(sys.stdin.readline)


async def main() -> None:
    from aiocache_kv.testing.mooncake_master import LoopbackMaster

    master = LoopbackMaster()
    await asyncio.to_thread(master.start)
    try:
        cmd = [sys.executable, SCRIPT, "--node"]
        addr = ["--master", master.rpc_addr, "--metadata", master.metadata_url]
        a = await asyncio.create_subprocess_exec(
            *cmd, "A", *addr, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
        )
        assert a.stdout is not None and a.stdin is not None
        results = []
        while (line := (await a.stdout.readline()).decode().strip()) != "READY":
            if not line:
                raise SystemExit("node A exited early")
            if line.startswith("{"):
                results.append(json.loads(line))
        b = await asyncio.create_subprocess_exec(*cmd, "B", *addr, stdout=asyncio.subprocess.PIPE)
        out, _ = await b.communicate()
        results += [json.loads(x) for x in out.decode().splitlines() if x.startswith("{")]
        a.stdin.close()
        await a.wait()
    finally:
        await asyncio.to_thread(master.terminate)
    for r in results:
        saved = r["images"] - r["encoder_calls"]
        print(
            f"node {r['node']}: {r['images']} images, {r['encoder_calls']} encoder calls, "
            f"{saved} saved ({r['local_hits']} local hits, {r['from_other_node']} from the "
            "other node via the store)"
        )
    total = sum(r["images"] for r in results)
    calls = sum(r["encoder_calls"] for r in results)
    print(f"encoder calls saved: {total - calls} of {total}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--node", choices=["A", "B"])
    ap.add_argument("--master")
    ap.add_argument("--metadata")
    args = ap.parse_args()
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    if args.node:
        from aiocache_kv.logs import configure_console

        configure_console("warning")  # stdout carries the node's results
        asyncio.run(run_node(args.node, args.master, args.metadata))
    else:
        asyncio.run(main())
