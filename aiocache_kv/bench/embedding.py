"""Benchmark of the multimodal embedding cache: ``aiocache-kv bench embedding``.

Two parts, both against a ``mooncake_master`` on 127.0.0.1 (started unless ``--master`` and
``--metadata`` are given):

* **throughput** - per embedding shape (``tokens x dim`` float16), ``batch`` embeddings per
  request, about ``mib`` MiB per measurement, median of ``repeats`` rounds after one warm-up:

  - *cache insert*: ``await cache.insert_batch(hashes, tensors)`` per request, fresh hashes:
    copy into the pool, header, one put (existence check, seal, zero-copy ``batch_put_from``).
  - *cache get*: the pool is emptied (``cache.evict()``), then ``await cache.get_batch(hashes)``
    per request: size lookup, one zero-copy ``batch_get_into``, integrity check, header check,
    copy out into new tensors.
  - *raw*: ``batch_put_from`` / ``batch_get_into`` of the same objects (same sizes: header,
    data, trailer) of ``batch`` keys per call on a registered buffer, through the *same*
    client (so placement is identical), one thread, fresh keys.

  GB/s count embedding data bytes (10^9); the ratio is cache / raw of the same round.

* **encoder calls saved** - a two-node workload: ``images`` distinct images, ``requests``
  requests of ``per_request`` images drawn with a Zipf-like popularity.  Node A (this process)
  serves the first half of the requests, then node B (another process, another Mooncake client)
  the second half.  Each node runs ``get_batch`` on the request's image hashes, encodes only the
  misses with a small random-weight vision encoder, and ``insert_batch``-es the whole request.
  Reported: encoder calls without a cache, with node-local caches only, and with the global
  store (B skips every image A already encoded).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from aiocache_kv.bench.report import JSON, fmt_bytes, heading, median, table
from aiocache_kv.embedding import EmbeddingCache, embedding_key
from aiocache_kv.embedding.layout import EntryShape, pack_header
from aiocache_kv.errors import StorageError
from aiocache_kv.logs import get_logger
from aiocache_kv.loop import run as run_loop
from aiocache_kv.storage import MooncakeStorage
from aiocache_kv.testing.mooncake_master import LoopbackMaster, mooncake_available

log = get_logger(__name__)

MiB = 1 << 20
TARGET_RATIO = 0.9
DTYPE = torch.float16


@dataclass(frozen=True)
class EmbeddingBenchOptions:
    """Knobs of the embedding benchmark."""

    shapes: tuple[tuple[int, int], ...] = ((64, 768), (576, 1024))
    batch: int = 16
    mib: int = 64
    repeats: int = 3
    images: int = 40
    requests: int = 60
    per_request: int = 4
    seed: int = 0
    master: str | None = None
    metadata: str | None = None
    explicit: bool = False  #: named on the command line: a missing mooncake is an error


def _storage(master: str, metadata: str, segment: int) -> MooncakeStorage:
    return MooncakeStorage(
        master=master,
        metadata_server=metadata,
        local_hostname="127.0.0.1",
        protocol="tcp",
        device_name="",
        global_segment_size=segment,
        local_buffer_size=16 * MiB,
    )


# ---------------------------------------------------------------------- throughput


class _Raw:
    """The raw client's side: the same objects in one registered buffer (blocking)."""

    def __init__(self, client: Any, tensors: Sequence[torch.Tensor], batch: int) -> None:
        shape = EntryShape(int(tensors[0].shape[0]), int(tensors[0].shape[1]), DTYPE)
        self.slot = shape.slot_nbytes
        stride = (self.slot + 63) // 64 * 64
        self.buf = torch.zeros(len(tensors) * stride, dtype=torch.uint8)
        head = torch.frombuffer(bytearray(pack_header(shape)), dtype=torch.uint8)
        for i, t in enumerate(tensors):
            base = i * stride
            self.buf[base : base + head.numel()] = head
            data = self.buf[base + head.numel() : base + shape.payload_nbytes]
            data.view(DTYPE).view(t.shape).copy_(t)
        self.ptrs = [self.buf.data_ptr() + i * stride for i in range(len(tensors))]
        self.views = [
            self.buf[i * stride + head.numel() : i * stride + shape.payload_nbytes]
            .view(DTYPE)
            .view(t.shape)
            for i, t in enumerate(tensors)
        ]
        self.client = client
        self.batch = batch
        rc = client.register_buffer(self.buf.data_ptr(), self.buf.numel())
        if rc != 0:
            raise StorageError(f"raw baseline: register_buffer failed with {rc}")

    def put(self, keys: list[str], tensors: Sequence[torch.Tensor] | None = None) -> float:
        """Put every object, ``batch`` per call; with ``tensors``, copy each request's tensors
        into the registered buffer first (what a raw-client user of tensors must do)."""
        b, sizes = self.batch, [self.slot] * self.batch
        bad = 0
        t0 = time.perf_counter()
        for a in range(0, len(keys), b):
            if tensors is not None:
                for v, t in zip(self.views[a : a + b], tensors[a : a + b], strict=True):
                    v.copy_(t)
            codes = self.client.batch_put_from(keys[a : a + b], self.ptrs[a : a + b], sizes)
            bad += sum(1 for c in codes if c != 0)
        elapsed = time.perf_counter() - t0
        if bad:
            raise StorageError(f"raw batch_put_from failed for {bad} keys")
        return elapsed

    def get(self, keys: list[str], copy_out: bool = False) -> float:
        """Get every object, ``batch`` per call; with ``copy_out``, clone each request's
        tensors out of the registered buffer (the caller must own them)."""
        b, sizes = self.batch, [self.slot] * self.batch
        bad = 0
        t0 = time.perf_counter()
        for a in range(0, len(keys), b):
            codes = self.client.batch_get_into(keys[a : a + b], self.ptrs[a : a + b], sizes)
            bad += sum(1 for c in codes if c != self.slot)
            if copy_out:
                _ = [v.clone() for v in self.views[a : a + b]]
        elapsed = time.perf_counter() - t0
        if bad:
            raise StorageError(f"raw batch_get_into failed for {bad} keys")
        return elapsed


async def _throughput(opts: EmbeddingBenchOptions, master: str, metadata: str) -> list[JSON]:
    run_id = uuid.uuid4().hex[:8]
    plans = []
    max_round = 0
    for tokens, dim in opts.shapes:
        shape = EntryShape(tokens, dim, DTYPE)
        n = max(1, opts.mib * MiB // shape.data_nbytes // opts.batch) * opts.batch
        plans.append((shape, n))
        max_round = max(max_round, n * ((shape.slot_nbytes + 63) // 64 * 64))
    store = _storage(master, metadata, 3 * max_round + 64 * MiB)
    cache = EmbeddingCache(
        pool_bytes=max_round, dtype=DTYPE, store=store, namespace=f"bench-{run_id}", timeout=60
    )
    rows: list[JSON] = []
    async with cache:
        client = store.raw_client
        for shape, n in plans:
            g = torch.Generator().manual_seed(opts.seed)
            tensors = [
                torch.randn(shape.num_tokens, shape.dim, generator=g).to(DTYPE) for _ in range(n)
            ]
            raw = await asyncio.to_thread(_Raw, client, tensors, opts.batch)
            data_bytes = n * shape.data_nbytes
            kinds = ("ins", "get", "rput", "rget", "cput", "cget")
            samples: dict[str, list[float]] = {k: [] for k in kinds}
            for rnd in range(opts.repeats + 1):
                hashes = [f"{run_id}-{shape.num_tokens}-{rnd}-{i}".encode() for i in range(n)]
                t_ins = t_get = 0.0
                for a in range(0, n, opts.batch):
                    hs, ts = hashes[a : a + opts.batch], tensors[a : a + opts.batch]
                    t0 = time.perf_counter()
                    st = await cache.insert_batch(hs, ts)
                    t_ins += time.perf_counter() - t0
                    if st.new != len(hs) or st.push_failed:
                        raise StorageError(f"bench insert: {st}")
                cache.evict()
                for a in range(0, n, opts.batch):
                    hs = hashes[a : a + opts.batch]
                    t0 = time.perf_counter()
                    got = await cache.get_batch(hs)
                    t_get += time.perf_counter() - t0
                    if any(x is None for x in got):
                        raise StorageError("bench get: a store miss")
                cache.evict()
                keys = [embedding_key(cache.namespace, h, cache.dtype) for h in hashes]
                await asyncio.to_thread(store.remove, keys)
                raw_keys = [f"raw-{run_id}/{shape.num_tokens}/{rnd}/{i}" for i in range(n)]
                t_put = await asyncio.to_thread(raw.put, raw_keys)
                t_rget = await asyncio.to_thread(raw.get, raw_keys)
                await asyncio.to_thread(client.batch_remove, raw_keys, True)
                t_cput = await asyncio.to_thread(raw.put, raw_keys, tensors)
                t_cget = await asyncio.to_thread(raw.get, raw_keys, True)
                await asyncio.to_thread(client.batch_remove, raw_keys, True)
                if rnd == 0:
                    continue  # warm-up
                times = {
                    "ins": t_ins,
                    "get": t_get,
                    "rput": t_put,
                    "rget": t_rget,
                    "cput": t_cput,
                    "cget": t_cget,
                }
                for k, t in times.items():
                    samples[k].append(data_bytes / t)
            await asyncio.to_thread(client.unregister_buffer, raw.buf.data_ptr())
            ins, get = median(samples["ins"]), median(samples["get"])
            rput, rget = median(samples["rput"]), median(samples["rget"])

            def rel(x: str, y: str, samples: dict[str, list[float]] = samples) -> float:
                return median([a / b for a, b in zip(samples[x], samples[y], strict=True)])

            ins_r, get_r = rel("ins", "rput"), rel("get", "rget")
            rows.append(
                {
                    "shape": f"{shape.num_tokens}x{shape.dim}",
                    "entry_bytes": shape.data_nbytes,
                    "entries": n,
                    "batch": opts.batch,
                    "insert_gbs": ins / 1e9,
                    "raw_put_gbs": rput / 1e9,
                    "insert_ratio": ins_r,
                    "get_gbs": get / 1e9,
                    "raw_get_gbs": rget / 1e9,
                    "get_ratio": get_r,
                    "raw_put_copy_gbs": median(samples["cput"]) / 1e9,
                    "insert_ratio_vs_copy": rel("ins", "cput"),
                    "raw_get_copy_gbs": median(samples["cget"]) / 1e9,
                    "get_ratio_vs_copy": rel("get", "cget"),
                }
            )
    return rows


# ---------------------------------------------------------------------- encoder calls saved


class TinyVisionEncoder(torch.nn.Module):
    """A small random-weight ViT-like encoder: 16x16 patches -> 2 transformer layers.

    A 3x64x64 image gives 16 tokens of ``dim``.  Seeded: every process builds the same model.
    """

    def __init__(self, dim: int = 128, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.patch = torch.nn.Conv2d(3, dim, kernel_size=16, stride=16)
        layer = torch.nn.TransformerEncoderLayer(dim, 4, 2 * dim, dropout=0.0, batch_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.eval()

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch(images).flatten(2).transpose(1, 2)  # (n, 16, dim)
        out: torch.Tensor = self.blocks(x)
        return out


def make_images(count: int, seed: int) -> list[torch.Tensor]:
    """``count`` deterministic 3x64x64 images."""
    g = torch.Generator().manual_seed(seed + 1)
    return [torch.rand(3, 64, 64, generator=g) for _ in range(count)]


def content_hash(image: torch.Tensor) -> bytes:
    """The caller's content hash of an image: sha256 of its bytes."""
    return hashlib.sha256(image.contiguous().numpy().tobytes()).digest()


def workload(opts: EmbeddingBenchOptions) -> list[list[int]]:
    """Requests as lists of distinct image indices, Zipf-like popularity (seeded)."""
    g = torch.Generator().manual_seed(opts.seed + 2)
    weights = torch.tensor([1.0 / (i + 1) ** 1.1 for i in range(opts.images)])
    k = min(opts.per_request, opts.images)
    return [
        torch.multinomial(weights, k, replacement=False, generator=g).tolist()
        for _ in range(opts.requests)
    ]


async def serve(
    cache: EmbeddingCache,
    encoder: TinyVisionEncoder,
    images: list[torch.Tensor],
    requests: list[list[int]],
) -> JSON:
    """Serve ``requests``: get, encode the misses, insert the whole request.  Counters."""
    hashes = [content_hash(im) for im in images]
    calls = occurrences = local = 0
    seen: set[int] = set()
    before = cache.statistics()
    for req in requests:
        hs = [hashes[i] for i in req]
        got = await cache.get_batch(hs)
        miss = [j for j, t in enumerate(got) if t is None]
        if miss:
            out = await asyncio.to_thread(encoder, torch.stack([images[req[j]] for j in miss]))
            calls += len(miss)
            for j, emb in zip(miss, out, strict=True):
                got[j] = emb
        await cache.insert_batch(hs, [t for t in got if t is not None])
        occurrences += len(req)
        local += sum(1 for i in req if i in seen)
        seen.update(req)
    after = cache.statistics()
    return {
        "requests": len(requests),
        "occurrences": occurrences,
        "distinct": len(seen),
        "encoder_calls": calls,
        "local_hits": after.get_local_hits - before.get_local_hits,
        "store_hits": after.get_store_hits - before.get_store_hits,
    }


def _node_cache(master: str, metadata: str, namespace: str) -> EmbeddingCache:
    return EmbeddingCache(
        pool_bytes=64 * MiB,
        store=_storage(master, metadata, 64 * MiB),
        namespace=namespace,
        timeout=30,
    )


async def _node_b(args: argparse.Namespace) -> None:
    opts = EmbeddingBenchOptions(
        images=args.images, requests=args.requests, per_request=args.per_request, seed=args.seed
    )
    reqs = workload(opts)
    encoder = TinyVisionEncoder()
    async with _node_cache(args.master, args.metadata, args.namespace) as cache:
        images = make_images(opts.images, opts.seed)
        result = await serve(cache, encoder, images, reqs[len(reqs) // 2 :])
    print(json.dumps(result), flush=True)


async def _two_nodes(opts: EmbeddingBenchOptions, master: str, metadata: str) -> JSON:
    ns = f"enc-{uuid.uuid4().hex[:8]}"
    reqs = workload(opts)
    half = len(reqs) // 2
    encoder = TinyVisionEncoder()
    images = make_images(opts.images, opts.seed)
    async with _node_cache(master, metadata, ns) as cache:
        a = await serve(cache, encoder, images, reqs[:half])
        cmd = [
            sys.executable,
            "-m",
            "aiocache_kv.bench.embedding",
            "--master",
            master,
            "--metadata",
            metadata,
            "--namespace",
            ns,
            "--images",
            str(opts.images),
            "--requests",
            str(opts.requests),
            "--per-request",
            str(opts.per_request),
            "--seed",
            str(opts.seed),
        ]
        proc = await asyncio.to_thread(
            subprocess.run, cmd, capture_output=True, text=True, timeout=180, check=False
        )
    if proc.returncode != 0:
        raise StorageError(f"node B failed ({proc.returncode}): {proc.stderr[-2000:]}")
    b = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
    local_only_b = len({i for r in reqs[half:] for i in r})  # B's calls without the store
    total = a["occurrences"] + b["occurrences"]
    calls = a["encoder_calls"] + b["encoder_calls"]
    return {
        "node_a": a,
        "node_b": b,
        "encoder_calls_no_cache": total,
        "encoder_calls_local_only": a["distinct"] + local_only_b,
        "encoder_calls_global": calls,
        "encoder_calls_saved": total - calls,
        "node_b_saved_by_node_a": local_only_b - b["encoder_calls"],
    }


# ---------------------------------------------------------------------- entry points


async def _run(opts: EmbeddingBenchOptions, master: str, metadata: str) -> JSON:
    rows = await _throughput(opts, master, metadata)
    enc = await _two_nodes(opts, master, metadata)
    return {"throughput": rows, "encoder": enc}


def run(opts: EmbeddingBenchOptions) -> JSON:
    """Run the embedding benchmark, print its tables and return the JSON-able results."""
    heading("bench embedding: EmbeddingCache vs the raw Mooncake client (same run)")
    why = mooncake_available()
    if why is not None:
        print(f"skipped: {why}")
        return {"skipped": why, "errors": [why] if opts.explicit else []}
    print(
        f"float16 embeddings, {opts.batch} per request, about {opts.mib} MiB per measurement, "
        f"one warm-up round then median of {opts.repeats}. cache insert = insert_batch (copy "
        "into the pool, one put with existence check + checksum); cache get = get_batch on an "
        "emptied pool (size lookup, one zero-copy get, verify, copy out). raw = batch_put_from "
        "/ batch_get_into of the same objects on a registered buffer, same client, one thread; "
        "raw+copy also copies the tensors into / out of that buffer (what a raw-client user of "
        "tensors must do)."
    )
    t0 = time.perf_counter()
    master: LoopbackMaster | None = None
    try:
        if opts.master is None or opts.metadata is None:
            master = LoopbackMaster()
            master.start()
            addr, meta = master.rpc_addr, master.metadata_url
        else:
            addr, meta = opts.master, opts.metadata
        results = run_loop(_run(opts, addr, meta))
    finally:
        if master is not None:
            master.terminate()
    rows = results["throughput"]
    table(
        ["shape", "entry", "op", "cache", "raw", "ratio", "raw+copy", "ratio"],
        [
            [
                r["shape"],
                fmt_bytes(r["entry_bytes"]),
                op,
                f"{r[f'{c}_gbs']:.2f} GB/s",
                f"{r[f'raw_{rw}_gbs']:.2f} GB/s",
                f"{r[f'{c}_ratio']:.2f}",
                f"{r[f'raw_{rw}_copy_gbs']:.2f} GB/s",
                f"{r[f'{c}_ratio_vs_copy']:.2f}",
            ]
            for r in rows
            for op, c, rw in (("insert", "insert", "put"), ("get", "get", "get"))
        ],
    )
    enc = results["encoder"]
    print(
        f"\ntwo nodes, {opts.images} images, {opts.requests} requests x {opts.per_request} "
        "images (Zipf-like), node A serves the first half, then node B (another process):"
    )
    table(
        ["encoder calls", "count"],
        [
            ["no cache", enc["encoder_calls_no_cache"]],
            ["node-local caches only", enc["encoder_calls_local_only"]],
            ["with the global store", enc["encoder_calls_global"]],
            ["saved (vs no cache)", enc["encoder_calls_saved"]],
            ["node B calls saved by node A", enc["node_b_saved_by_node_a"]],
        ],
    )
    worst = min([r["insert_ratio"] for r in rows] + [r["get_ratio"] for r in rows])
    worst_copy = min(
        [r["insert_ratio_vs_copy"] for r in rows] + [r["get_ratio_vs_copy"] for r in rows]
    )
    print(
        f"\ntarget ratio >= {TARGET_RATIO}: worst vs raw {worst:.2f} "
        f"({'met' if worst >= TARGET_RATIO else 'NOT met'}), worst vs raw+copy "
        f"{worst_copy:.2f} ({'met' if worst_copy >= TARGET_RATIO else 'NOT met'}); "
        f"{time.perf_counter() - t0:.0f} s"
    )
    results["worst_ratio_vs_copy"] = worst_copy
    results["target_ratio"] = TARGET_RATIO
    results["worst_ratio"] = worst
    results["errors"] = []
    return results


def main(argv: Sequence[str] | None = None) -> None:
    """Node B of the two-node workload (``python -m aiocache_kv.bench.embedding``)."""
    ap = argparse.ArgumentParser(description="node B of `aiocache-kv bench embedding`")
    ap.add_argument("--master", required=True)
    ap.add_argument("--metadata", required=True)
    ap.add_argument("--namespace", required=True)
    ap.add_argument("--images", type=int, required=True)
    ap.add_argument("--requests", type=int, required=True)
    ap.add_argument("--per-request", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    run_loop(_node_b(ap.parse_args(argv)))


if __name__ == "__main__":
    main()
