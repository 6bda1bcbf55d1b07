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
6. the KV events (``take_events``) and ``statistics()`` as tables.

The "model" here is :func:`fake_kv`: K/V of a token is a deterministic function of the tokens
up to and including it, as in a real transformer, so prompts sharing a prefix produce the same
K/V for it.  A later demo swaps in a real model (GPT-2) through the same :class:`KVModel`
shape: ``kv(tokens, start) -> (k, v)`` for positions ``start..len(tokens)``.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
from collections.abc import Sequence
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


def demo_config(args: argparse.Namespace) -> CacheConfig:
    """The demo's cache: a tiny float32 KV on CPU, write-through to the host pool."""
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
    )


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


async def run_demo(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run the walkthrough; return 0 when every data check passed, 1 otherwise."""
    stream = out if out is not None else sys.stdout
    try:
        cfg = demo_config(args)
    except KVCacheError as exc:
        log.error("demo_bad_config", error=str(exc))
        return 2
    model = FakeModel(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.dtype)
    prompts = make_prompts(args.seed, cfg.page_size)
    print(
        f"aiocache-kv demo: page_size={cfg.page_size}, device_pages={cfg.device_pages}, "
        f"host_pages={cfg.host_pages}, {cfg.num_layers} layers x {cfg.num_kv_heads} heads x "
        f"{cfg.head_dim} dims {str(cfg.dtype).replace('torch.', '')}, write_through, seed "
        f"{args.seed}",
        file=stream,
    )
    try:
        async with HiCache(cfg) as cache:
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

            heading("6. KV events (take_events)", out=stream)
            print_events(cache.take_events(), stream)
            heading("7. statistics()", out=stream)
            print_statistics(cache.statistics(), stream)
    except KVCacheError as exc:
        log.error("demo_failed", error=str(exc), error_type=type(exc).__name__)
        print(f"demo failed: {type(exc).__name__}: {exc}", file=stream)
        return 1
    return 0 if device_ok and loaded_ok else 1
