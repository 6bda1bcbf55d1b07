"""``aiocache-kv demo``: multi-turn chat on a small GPT-2 whose KV lives in the cache.

The workload is what a chat server sees: several conversations that share a system prompt,
several turns each, interleaved (turn 1 of every conversation, then turn 2 of every
conversation, ...).  Each turn's prompt is the whole conversation so far - system prompt,
earlier user messages and the model's replies - plus a new user message, so most of it was
computed before, by this conversation's previous turn or (the system prompt) by another one.

Every turn is generated twice, greedily:

* **without a cache** - ``transformers``' own ``DynamicCache``, the whole prompt prefilled;
* **with the cache** - :class:`~aiocache_kv.models.CachedLM`: ``await prefetch`` (storage ->
  host), ``match_prefix``, ``await load_back`` (host -> device), prefill only the uncached
  suffix with the K/V read from and written to the device pool, decode, ``insert`` the prompt
  and the reply (written through to host and storage).

and the two must give the same tokens.  The pools are small on purpose, so every tier serves
hits: older conversations are demoted from device to host and evicted from host (their pages
stay in storage), and at the end a **restarted node** - a fresh cache on the same storage -
serves one more turn of every conversation from storage alone.

The model is a random-weight GPT-2 built from a ``GPT2Config`` under ``torch.manual_seed``
(:mod:`aiocache_kv.models.gpt2`): nothing is downloaded.  The exit code is 0 only if every
generation was token-identical with and without the cache.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch

from aiocache_kv.bench.report import Progress, heading, table
from aiocache_kv.cache import HiCache
from aiocache_kv.config import CacheConfig
from aiocache_kv.errors import KVCacheError
from aiocache_kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from aiocache_kv.logs import get_logger
from aiocache_kv.models import CachedLM, GPT2Spec, build_gpt2, cache_config_for
from aiocache_kv.models.generate import Generation, reference_generate
from aiocache_kv.stats import CacheStatistics
from aiocache_kv.storage import FileStorage, MooncakeStorage, StorageBackend

log = get_logger(__name__)

#: the demo's model: 6 layers x 4 heads x 64 dims, GPT-2's vocabulary, random weights
DEMO_SPEC = GPT2Spec(n_layer=6, n_head=4, n_embd=256, vocab_size=50257, n_positions=1024)

#: defaults of the workload options (``aiocache-kv demo --help`` shows the same)
DEFAULTS: dict[str, Any] = {
    "page_size": 16,
    "device_pages": 48,
    "host_pages": 96,
    "seed": 0,
    "conversations": 4,
    "turns": 4,
    "new_tokens": 12,
    "system_tokens": 160,
    "storage": "file",
}


def _opt(args: argparse.Namespace, name: str) -> Any:
    value = getattr(args, name, None)
    return DEFAULTS[name] if value is None else value


# ---------------------------------------------------------------------------- workload


@dataclass
class Conversation:
    """One chat: the token history so far and the user messages still to send."""

    name: str
    history: list[int]
    messages: list[list[int]]
    replies: int = 0


def make_conversations(
    seed: int, conversations: int, turns: int, system_tokens: int, vocab: int
) -> list[Conversation]:
    """``conversations`` chats sharing one system prompt, ``turns + 1`` user messages each
    (the last one is for the restarted node), of 20-60 tokens (not page-aligned)."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    system = toks(system_tokens)
    names = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    return [
        Conversation(
            name=f"chat {names[i % 26]}{i // 26 or ''}",
            history=list(system),
            messages=[toks(rng.randrange(20, 61)) for _ in range(turns + 1)],
        )
        for i in range(conversations)
    ]


@dataclass
class TurnResult:
    """One turn, generated without and with the cache."""

    node: str
    turn: int
    chat: str
    ref: Generation
    got: Generation
    max_logit_diff: float

    @property
    def identical(self) -> bool:
        """The reply is token-identical with and without the cache."""
        return self.ref.tokens == self.got.tokens

    @property
    def source(self) -> str:
        """Where the deepest part of the reused prefix came from."""
        g = self.got
        if g.hit_storage:
            return "storage"
        if g.hit_host:
            return "host"
        if g.hit_device:
            return "device"
        return "miss"


@dataclass
class DemoLog:
    """Everything the summary needs."""

    results: list[TurnResult] = field(default_factory=list)
    events: list[KVEvent] = field(default_factory=list)


# ---------------------------------------------------------------------------- storage


def demo_config(
    args: argparse.Namespace, model: Any | None = None, storage: StorageBackend | None = None
) -> CacheConfig:
    """The demo's cache, shaped like ``model`` (default: the demo's GPT-2 shape): small
    device and host pools, write-through to host and storage, prefetch that waits."""
    opts: dict[str, Any] = dict(
        page_size=_opt(args, "page_size"),
        device="cpu",
        device_pages=_opt(args, "device_pages"),
        host_pages=_opt(args, "host_pages"),
        write_policy="write_through",
        namespace=DEMO_SPEC.name,
        host_memory_reserve_bytes=0,
        storage=storage,
        prefetch_policy="wait_complete",
        prefetch_threshold_tokens=0,  # chat turns are short; prefetch whatever storage has
    )
    if model is not None:
        return cache_config_for(model, **opts)
    return CacheConfig(
        num_layers=DEMO_SPEC.n_layer,
        num_kv_heads=DEMO_SPEC.n_head,
        head_dim=DEMO_SPEC.head_dim,
        dtype=torch.float32,
        **opts,
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
                global_segment_size=128 << 20,
                local_buffer_size=32 << 20,
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
    kind = _opt(args, "storage")
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
        from aiocache_kv.testing.mooncake_master import LoopbackMaster

        master = LoopbackMaster()
        await asyncio.to_thread(master.start)
        try:
            yield StorageSetup("mooncake", master=master.rpc_addr, metadata=master.metadata_url)
        finally:
            await asyncio.to_thread(master.terminate)
    else:
        yield StorageSetup("none")


# ---------------------------------------------------------------------------- reports


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def print_turns(results: Sequence[TurnResult], out: TextIO) -> None:
    """One row per conversation: hits per tier, TTFT without/with the cache, identity."""
    rows = [
        [
            r.chat,
            r.got.prompt_len,
            r.got.hit_device,
            r.got.hit_host,
            r.got.hit_storage,
            r.got.computed,
            _ms(r.ref.ttft),
            _ms(r.got.ttft),
            f"{r.ref.ttft / r.got.ttft:.1f}x" if r.got.ttft > 0 else "-",
            "yes" if r.identical else "NO",
            f"{r.max_logit_diff:.1e}",
        ]
        for r in results
    ]
    table(
        [
            "chat",
            "prompt",
            "device hit",
            "host hit",
            "storage hit",
            "computed",
            "TTFT no cache ms",
            "TTFT cache ms",
            "speedup",
            "identical",
            "max |dlogit|",
        ],
        rows,
        out=out,
    )


def print_ttft_by_source(results: Sequence[TurnResult], out: TextIO) -> None:
    """Median TTFT without/with the cache, grouped by where the reused prefix came from."""
    rows: list[list[object]] = []
    for source in ("miss", "device", "host", "storage"):
        group = [r for r in results if r.source == source]
        if not group:
            continue
        ref = statistics.median(r.ref.ttft for r in group)
        got = statistics.median(r.got.ttft for r in group)
        rows.append(
            [
                source,
                len(group),
                round(statistics.mean(r.got.prompt_len for r in group)),
                round(statistics.mean(r.got.hit_tokens for r in group)),
                _ms(ref),
                _ms(got),
                f"{ref / got:.1f}x" if got > 0 else "-",
            ]
        )
    table(
        [
            "deepest tier hit",
            "turns",
            "mean prompt",
            "mean hit",
            "median TTFT no cache ms",
            "median TTFT cache ms",
            "speedup",
        ],
        rows,
        out=out,
    )


def print_event_summary(events: Sequence[KVEvent], out: TextIO) -> None:
    """KV events counted by type and medium (pages in brackets)."""
    counts: Counter[tuple[str, str]] = Counter()
    pages: Counter[tuple[str, str]] = Counter()
    for ev in events:
        if isinstance(ev, BlockStored):
            key = ("BlockStored", ev.medium)
            pages[key] += len(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            key = ("BlockRemoved", ev.medium)
            pages[key] += len(ev.block_hashes)
        else:
            assert isinstance(ev, AllBlocksCleared), ev
            key = ("AllBlocksCleared", "")
        counts[key] += 1
    table(
        ["event", "medium", "events", "pages"],
        [[k[0], k[1], counts[k], pages[k]] for k in sorted(counts)],
        out=out,
        align="llrr",
    )


def print_statistics(st: CacheStatistics, out: TextIO) -> None:
    """``statistics()``: the tiers, then the hit and traffic counters."""
    table(
        ["tier", "total", "free", "held", "evictable", "protected"],
        [
            [name, t.total_pages, t.free_pages, t.held_pages, t.evictable_pages, t.protected_pages]
            for name, t in (("device (L1)", st.device), ("host (L2)", st.host))
        ],
        out=out,
    )
    print(file=out)
    keys = (
        "match_queries",
        "hit_tokens_device",
        "hit_tokens_host",
        "inserted_tokens",
        "write_through_done",
        "load_back_done",
        "bytes_device_to_host",
        "bytes_host_to_device",
        "backup_pages_ok",
        "prefetch_queries",
        "prefetch_hit_tokens",
        "storage_errors",
        "events_published",
    )
    table(["counter", "value"], [[k, getattr(st, k)] for k in keys], out=out)


def hits_line(results: Sequence[TurnResult], storage: bool) -> str:
    """Tokens hit per tier (the tiers this run has), and whether each of them served hits."""
    hits = {
        "device": sum(r.got.hit_device for r in results),
        "host": sum(r.got.hit_host for r in results),
    }
    if storage:
        hits["storage"] = sum(r.got.hit_storage for r in results)
    idle = [k for k, v in hits.items() if not v]
    if not idle:
        verdict = "every tier served hits" if storage else "both tiers served hits (no storage)"
    else:
        verdict = f"no hits from {' or '.join(idle)} (pools too large for the workload?)"
    return (
        "tokens hit per tier: " + ", ".join(f"{k} {v}" for k, v in hits.items()) + f" - {verdict}"
    )


# ---------------------------------------------------------------------------- the run


class ChatDemo:
    """Plays the conversations against one cache after another (node 1, then node 2)."""

    def __init__(
        self, args: argparse.Namespace, model: Any, setup: StorageSetup, out: TextIO
    ) -> None:
        self.args = args
        self.model = model
        self.setup = setup
        self.out = out
        self.new_tokens: int = _opt(args, "new_tokens")
        self.turns: int = _opt(args, "turns")
        self.chats = make_conversations(
            _opt(args, "seed"),
            _opt(args, "conversations"),
            self.turns,
            _opt(args, "system_tokens"),
            int(model.config.vocab_size),
        )
        restart = 1 if setup.kind != "none" else 0
        self.progress = Progress(2 * len(self.chats) * (self.turns + restart))
        self.log = DemoLog()

    def config(self) -> CacheConfig:
        """A cache config for a new node (each gets its own storage backend object)."""
        return demo_config(self.args, self.model, self.setup.make())

    async def warm_up(self) -> None:
        """Run both paths, untimed, on a throwaway cache and a prompt as long as the first
        turn's, so that neither path's first timed run pays the other's warm-up (first calls
        of a shape, allocations): a miss then shows ~1x."""
        rng = random.Random(-1)
        n = len(self.chats[0].history) + len(self.chats[0].messages[0])
        cfg = demo_config(self.args, self.model)  # no storage: nothing outlives the warm-up
        async with HiCache(cfg) as scratch:
            lm = CachedLM(self.model, scratch)
            for _ in range(2):
                prompt = [rng.randrange(int(self.model.config.vocab_size)) for _ in range(n)]
                await lm.generate(prompt, self.new_tokens, keep_logits=True)
                reference_generate(self.model, prompt, self.new_tokens, keep_logits=True)

    async def turn(self, lm: CachedLM, chat: Conversation, turn: int, node: str) -> TurnResult:
        """Send the chat's next message; generate without and with the cache; compare.

        The two run in alternating order (by turn and chat), so neither is always the one
        that finds the processor caches warm."""
        prompt = chat.history + chat.messages[chat.replies]
        cached_first = (turn + self.chats.index(chat)) % 2 == 1
        if cached_first:
            got = await lm.generate(prompt, self.new_tokens, keep_logits=True)
            self.progress.advance(f"{node} turn {turn} {chat.name}: cache")
        ref = reference_generate(self.model, prompt, self.new_tokens, keep_logits=True)
        self.progress.advance(f"{node} turn {turn} {chat.name}: no cache")
        if not cached_first:
            got = await lm.generate(prompt, self.new_tokens, keep_logits=True)
            self.progress.advance(f"{node} turn {turn} {chat.name}: cache")
        assert ref.logits is not None and got.logits is not None
        diff = float((ref.logits - got.logits).abs().max())
        chat.history = prompt + got.tokens
        chat.replies += 1
        result = TurnResult(node, turn, chat.name, ref, got, diff)
        self.log.results.append(result)
        return result

    async def round(self, lm: CachedLM, turn: int, node: str) -> None:
        """Turn ``turn`` of every conversation, then its table."""
        rows = [await self.turn(lm, chat, turn, node) for chat in self.chats]
        self.progress.clear()
        heading(f"{node}, turn {turn}", out=self.out)
        print_turns(rows, self.out)
        self.progress.draw()

    async def run(self) -> bool:
        """Node 1 plays every turn; node 2 (restarted, same storage) one more turn each."""
        try:
            await self.warm_up()
            await self.play()
        finally:
            self.progress.clear()
        return self.summary()

    async def play(self) -> None:
        """The turns of node 1, then (with a storage tier) node 2's."""
        async with contextlib.AsyncExitStack() as stack:
            cache = await stack.enter_async_context(HiCache(self.config()))
            lm = CachedLM(self.model, cache)
            for turn in range(1, self.turns + 1):
                await self.round(lm, turn, "node 1")
            await cache.flush()  # every backup to storage landed
            cache.check_invariants()
            self.progress.clear()
            heading("node 1: statistics()", out=self.out)
            print_statistics(cache.statistics(), self.out)
            self.log.events += cache.take_events()
            if self.setup.kind == "file":
                await stack.aclose()  # a true restart: node 1 is gone, its files stay
                how = "node 1 closed; node 2 opens the same directory with empty L1/L2"
            else:  # Mooncake: node 1's segment holds the pages, so it stays up
                how = "node 1 stays up (its segment holds the pages); node 2 is a second client"
            if self.setup.kind != "none":
                heading("restarted node: a fresh cache on the same storage", out=self.out)
                print(f"  {how}", file=self.out)
                async with HiCache(self.config()) as cache2:
                    lm2 = CachedLM(self.model, cache2)
                    await self.round(lm2, self.turns + 1, "node 2")
                    await cache2.flush()
                    cache2.check_invariants()
                    self.progress.clear()
                    heading("node 2: statistics()", out=self.out)
                    print_statistics(cache2.statistics(), self.out)
                    self.log.events += cache2.take_events()

    def summary(self) -> bool:
        """The tables across all turns; True when every generation was identical."""
        results = self.log.results
        out = self.out
        restarted = self.setup.kind != "none"
        heading("KV events (both nodes)" if restarted else "KV events", out=out)
        print_event_summary(self.log.events, out)
        heading("TTFT by the deepest tier that served the prefix", out=out)
        print_ttft_by_source(results, out)
        print("\n" + hits_line(results, restarted), file=out)
        bad = [r for r in results if not r.identical]
        worst = max((r.max_logit_diff for r in results), default=0.0)
        if bad:
            print(
                f"identity check FAILED: {len(bad)}/{len(results)} generations differ with the "
                f"cache: " + ", ".join(f"{r.node} turn {r.turn} {r.chat}" for r in bad),
                file=out,
            )
            return False
        print(
            f"identity check PASSED: {len(results)}/{len(results)} generations token-identical "
            f"with and without the cache (max |dlogit| {worst:.1e})",
            file=out,
        )
        return True


async def run_demo(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run the chat demo; return 0 when every generation was identical with and without the
    cache, 1 on a mismatch or a cache error, 2 on a bad configuration."""
    stream = out if out is not None else sys.stdout
    try:
        demo_config(args)
    except KVCacheError as exc:
        log.error("demo_bad_config", error=str(exc))
        return 2
    try:
        async with storage_setup(args) as setup:
            t0 = time.perf_counter()
            model = await asyncio.to_thread(build_gpt2, DEMO_SPEC)
            await asyncio.to_thread(reference_generate, model, list(range(32)), 2)  # warm up
            cfg = demo_config(args, model)
            params = sum(p.numel() for p in model.parameters())
            print(
                f"aiocache-kv demo: multi-turn chat on a random-weight GPT-2 ({DEMO_SPEC.n_layer} "
                f"layers x {DEMO_SPEC.n_head} heads x {DEMO_SPEC.head_dim} dims, "
                f"{params / 1e6:.1f}M parameters, built in {time.perf_counter() - t0:.1f}s, "
                f"nothing downloaded); page_size={cfg.page_size}, device_pages="
                f"{cfg.device_pages}, host_pages={cfg.host_pages}, write_through; "
                f"{_opt(args, 'conversations')} chats x {_opt(args, 'turns')} turns, "
                f"{_opt(args, 'new_tokens')} new tokens per reply, seed {_opt(args, 'seed')}; "
                f"L3: {setup.describe()}",
                file=stream,
            )
            ok = await ChatDemo(args, model, setup, stream).run()
            return 0 if ok else 1
    except KVCacheError as exc:
        log.error("demo_failed", error=str(exc), error_type=type(exc).__name__)
        print(f"demo failed: {type(exc).__name__}: {exc}", file=stream)
        return 1
