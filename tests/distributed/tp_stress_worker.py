"""One rank of the seeded tensor-parallel stress test (run as a subprocess per rank).

Every rank serves the same seeded sequence of requests (prefetch with a random policy, match,
load-back, alloc, insert in either form, releases, evictions, syncs, flushes) against its own
``HiCache``; everything beneath is different on every rank: the store (its own directory,
random delays, stalls past the storage deadline, reads that fail or find a page missing) and
the copy engine (completions out of order, some failed).  Agreement must keep the ranks'
trees, events and statistics identical, and every row a rank serves must hold that rank's KV
shard for the tokens it claims.  It prints one JSON line describing what it ended with.
"""

from __future__ import annotations

import argparse
import random
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import aiocache_kv as akv
from aiocache_kv.errors import CapacityError, TransferError
from aiocache_kv.storage import PageBuffer
from tests.distributed.tp_worker import init_group, run_rank
from tests.test_stress import (
    ChaosCopyEngine,
    expected_sidecar,
    stress_components,
    write_sidecars,
)

PAGE = 2
LAYERS, HEADS, HEAD_DIM = 2, 1, 4
POLICIES = ("timeout", "wait_complete", "best_effort")


class FlakyFileStorage(akv.FileStorage):
    """``FileStorage`` with this rank's own faults: random delays, stalls beyond the storage
    deadline, reads that report pages missing."""

    def __init__(self, root: Path, seed: int) -> None:
        super().__init__(root, capacity_bytes=48 * 1024)
        self._rng = random.Random(seed)
        self._fault_lock = threading.Lock()

    def _roll(self) -> tuple[float, float]:
        with self._fault_lock:
            stall = self._rng.random() < 0.03
            return (0.4 if stall else self._rng.uniform(0, 0.004)), self._rng.random()

    def put_chain(
        self,
        keys: Sequence[str],
        buffers: Sequence[PageBuffer],
        parents: Sequence[str | None],
        identities: Sequence[bytes] | None = None,
    ) -> list[bool]:
        delay, _ = self._roll()
        time.sleep(delay)
        return super().put_chain(keys, buffers, parents, identities)

    def get_into(
        self,
        keys: Sequence[str],
        buffers: Sequence[PageBuffer],
        identities: Sequence[bytes] | None = None,
    ) -> list[bool]:
        delay, roll = self._roll()
        time.sleep(delay)
        got = super().get_into(keys, buffers, identities)
        if roll < 0.15 and got:  # this rank lost a page of the batch
            with self._fault_lock:
                got[self._rng.randrange(len(got))] = False
        return got


def expected(rank: int, tokens: Sequence[int]) -> torch.Tensor:
    """``[layers, 2, len(tokens), heads, head_dim]``: this rank's shard of the KV of each
    position, a function of (rank, tokens up to it), exact in float32."""
    h = rank + 1
    vals = []
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % (1 << 61)
        vals.append((h % 4093) / 8)
    base = torch.tensor(vals, dtype=torch.float32).view(1, 1, -1, 1, 1)
    layer = torch.arange(LAYERS, dtype=torch.float32).view(-1, 1, 1, 1, 1) * 1024
    heads = torch.arange(HEADS * HEAD_DIM, dtype=torch.float32).view(HEADS, HEAD_DIM) / 64
    return base + layer + torch.tensor([0.0, 512.0]).view(1, 2, 1, 1, 1) + heads


def write(cache: akv.HiCache, slots: torch.Tensor, kv: torch.Tensor) -> None:
    for layer in range(LAYERS):
        k, v = cache.device_kv(layer)
        k[slots] = kv[layer, 0]
        v[slots] = kv[layer, 1]


def wrong_rows(cache: akv.HiCache, m: akv.MatchResult, rank: int, tokens: list[int]) -> int:
    """Rows (and sidecar pages a window needs at the match end) that do not hold this
    rank's state for ``tokens``."""
    idx = m.device_indices
    n = idx.numel()
    if n != m.device_len:
        return max(n, 1)
    got = torch.stack(
        [torch.stack([k[idx], v[idx]]) for k, v in (cache.device_kv(i) for i in range(LAYERS))]
    )
    want = expected(rank, tokens[:n])
    bad = sum(not torch.equal(got[:, :, i], want[:, :, i]) for i in range(n))
    pages = m.device_pages.tolist()
    k = len(pages)
    for comp in cache.config.components:
        w = comp.window_pages(PAGE)
        buf = cache.sidecar(comp.name)
        for j in range(k) if w == 0 else range(max(0, k - w), k):
            state = expected_sidecar(comp, f"rank{rank}", tokens[: (j + 1) * PAGE])
            bad += not torch.equal(buf[pages[j]], state)
    return bad


async def serve(args: argparse.Namespace) -> dict[str, Any]:
    rank, seed = args.rank, args.seed
    group = init_group(args)
    engine = ChaosCopyEngine(random.Random(seed * 31 + rank), fail_rate=0.05)
    cfg = akv.CacheConfig(
        page_size=PAGE,
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_dim=HEAD_DIM,
        dtype=torch.float32,
        device_pages=20,
        host_pages=28,
        host_memory_reserve_bytes=0,
        storage=FlakyFileStorage(Path(args.dir) / f"rank{rank}", seed * 17 + rank),
        storage_timeout=0.2,
        prefetch_threshold_tokens=0,
        prefetch_timeout_base=0.05,
        prefetch_timeout_per_1k=0.0,
        prefetch_timeout_max=0.1,
        prefetch_batch_pages=2,
        write_policy=random.Random(seed).choice(["write_through", "write_back"]),
        components=stress_components(PAGE) if args.hybrid else (),
    )
    rng = random.Random(seed)  # the same on every rank: the scheduler's decisions
    systems = [[rng.randint(100, 130) for _ in range(rng.randint(3, 9))] for _ in range(3)]
    out: dict[str, Any] = {"rank": rank, "wrong_rows": 0, "log": []}
    log = out["log"]

    def check(m: akv.MatchResult, tokens: list[int], when: str) -> None:
        bad = wrong_rows(cache, m, rank, tokens)
        if bad:
            out["wrong_rows"] += bad
            log.append(f"{when}: {bad} wrong rows of {m.device_len}")

    async with akv.HiCache(cfg, copy_engine=engine, tp_group=group) as cache:
        held: list[akv.MatchResult | akv.InsertResult] = []
        for i in range(args.requests):
            tokens = rng.choice(systems) + [rng.randint(1, 4) for _ in range(rng.randint(0, 7))]
            if rng.random() < 0.5:
                res = await cache.prefetch(tokens, policy=rng.choice(POLICIES))
                log.append(f"r{i} prefetch {res.status.value} {res.hit_tokens}")
            m = cache.match_prefix(tokens)
            check(m, tokens, f"r{i} match")
            if m.host_len and rng.random() < 0.8:
                try:
                    await cache.load_back(m)
                except (TransferError, CapacityError) as exc:
                    log.append(f"r{i} load_back {type(exc).__name__}")
                check(m, tokens, f"r{i} load_back")
            d = m.device_len
            if d < len(tokens) // PAGE * PAGE:
                n_new = len(tokens) - d
                try:
                    slots = await cache.alloc_wait(n_new)
                except CapacityError:
                    log.append(f"r{i} alloc CapacityError")
                    cache.release(m)
                    continue
                write(cache, slots[:n_new], expected(rank, tokens)[:, :, d:])
                write_sidecars(cache, slots[:n_new], f"rank{rank}", tokens, d)
                if rng.random() < 0.5:
                    r = cache.insert(tokens, slots[:n_new], prefix=m)
                else:
                    r = cache.insert(tokens, torch.cat([m.device_indices, slots[:n_new]]))
                if len(tokens) % PAGE:
                    cache.free(slots[-PAGE:])  # the unaligned tail stays ours
                held.append(r)
                log.append(f"r{i} insert {r.prefix_len} {r.inserted_len}")
            held.append(m)
            rng.shuffle(held)
            while len(held) > rng.randint(0, 4):
                cache.release(held.pop())
            x = rng.random()
            if x < 0.15:
                log.append(f"r{i} evict {cache.evict(rng.randint(1, 6))}")
            elif x < 0.25:
                log.append(f"r{i} evict host {cache.evict(rng.randint(1, 6), 'host')}")
            elif x < 0.55:
                await cache.sync()
            elif x < 0.6:
                await cache.flush()
        for h in held:
            cache.release(h)
        engine.quiet()
        await cache.flush()
        cache.check_invariants()
        out["shape"] = sorted(
            (n.key, n.device.name, n.host.name, n.storage.name, n.pins) for n in cache._tree.walk()
        )
        out["events"] = [
            [type(e).__name__, getattr(e, "medium", None), getattr(e, "token_ids", None)]
            for e in cache.take_events()
        ]
        st = cache.statistics()
        out["stats"] = [st.nodes, st.device.free_pages, st.host.free_pages, st.load_back_failed]
        out["collectives"] = group.calls
    await engine.aclose()
    dist.destroy_process_group()
    return out


def main() -> None:
    def add_args(ap: argparse.ArgumentParser) -> None:
        ap.add_argument("--seed", type=int, required=True)
        ap.add_argument("--requests", type=int, default=60)
        ap.add_argument("--hybrid", action="store_true")

    run_rank(serve, add_args)


if __name__ == "__main__":
    main()
