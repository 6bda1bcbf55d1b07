"""``aiocache-kv demo``: multi-turn chat on a small GPT-2 whose KV lives in the cache.

The workload is what a chat server sees: several conversations that share a system prompt,
several turns each, interleaved (turn 1 of every conversation, then turn 2 of every
conversation, ...).  Each turn's prompt is the whole conversation so far - system prompt,
earlier user messages and the model's replies - plus a new user message, so most of it was
computed before, by this conversation's previous turn or (the system prompt) by another one.

Each round (one turn of every conversation) is served **concurrently** by one
:class:`~aiocache_kv.serving.Engine` per node: every conversation's request is submitted at
once and the engine batches them - prefill chunks and decodes of different requests in one
forward pass, prefetch on arrival, ``match_prefix`` and ``load_back`` at admission, the
prompt's suffix computed with the K/V read from and written to the device pool, every page a
request completes inserted (written through to host and storage) while it runs.  A request
whose system prompt another request is computing waits for those pages instead of computing
them again.  Rounds keep their barrier, so each has its table.

Every turn is also generated **without a cache**, alone (``transformers``' own
``DynamicCache``, the whole prompt prefilled: :func:`reference_generate`, off the timed path),
and the two must give the same tokens.  The cached TTFT is measured from the request's arrival
in its batch (queueing behind the other requests included).  The pools are small on purpose,
so every tier serves hits: older conversations are demoted from device to host and evicted
from host (their pages stay in storage), and at the end a **restarted node** - a fresh cache
on the same storage - serves one more turn of every conversation from storage alone.

The model is a random-weight GPT-2 built from a ``GPT2Config`` under ``torch.manual_seed``
(:mod:`aiocache_kv.models.gpt2`): nothing is downloaded.  The exit code is 0 only if every
generation was token-identical with and without the cache.  The tables are printed by
:mod:`aiocache_kv.demo_report`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import shutil
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import torch

from aiocache_kv.bench.report import Progress, heading
from aiocache_kv.cache import HiCache
from aiocache_kv.config import CacheConfig
from aiocache_kv.demo_defaults import DEFAULTS
from aiocache_kv.demo_report import (
    DemoLog,
    RoundStats,
    TurnResult,
    hits_line,
    print_engine_statistics,
    print_event_summary,
    print_statistics,
    print_ttft_by_source,
    print_turns,
    round_line,
)
from aiocache_kv.errors import InvalidInputError, KVCacheError
from aiocache_kv.logs import get_logger
from aiocache_kv.models import GPT2Spec, build_gpt2, cache_config_for
from aiocache_kv.models.generate import Generation, reference_generate
from aiocache_kv.serving import Engine, GenerationResult
from aiocache_kv.storage import FileStorage, MooncakeStorage, StorageBackend

log = get_logger(__name__)

#: the demo's model: 6 layers x 4 heads x 64 dims, GPT-2's vocabulary, random weights
DEMO_SPEC = GPT2Spec(n_layer=6, n_head=4, n_embd=256, vocab_size=50257, n_positions=1024)


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


def check_positions(args: argparse.Namespace) -> None:
    """The longest conversation fits the demo model's positions: its system prompt, every
    user message it gets (one more on the restarted node, with a storage tier) and a reply
    to each (found before the model is built).

    Raises:
        InvalidInputError: it does not (the lengths named).
    """
    turns = _opt(args, "turns") + (0 if _opt(args, "storage") == "none" else 1)
    new = _opt(args, "new_tokens")
    chats = make_conversations(
        _opt(args, "seed"),
        _opt(args, "conversations"),
        _opt(args, "turns"),
        _opt(args, "system_tokens"),
        DEMO_SPEC.vocab_size,
    )
    need = max(len(c.history) + sum(map(len, c.messages[:turns])) + turns * new for c in chats)
    if need > DEMO_SPEC.n_positions:
        raise InvalidInputError(
            f"the longest chat needs {need} positions ({_opt(args, 'system_tokens')} system "
            f"tokens, {turns} turns of up to 60 user tokens and {new} reply tokens each); the "
            f"demo model has {DEMO_SPEC.n_positions}"
        )


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


# ---------------------------------------------------------------------------- the run


class ChatDemo:
    """Plays the conversations against one node after another (node 1, then node 2), each a
    cache with one :class:`Engine` that serves every round's turns concurrently."""

    def __init__(
        self, args: argparse.Namespace, model: Any, setup: StorageSetup, out: TextIO
    ) -> None:
        self.args = args
        self.model = model
        self.setup = setup
        self.out = out
        self.new_tokens: int = _opt(args, "new_tokens")
        self.turns: int = _opt(args, "turns")
        self.max_batch_tokens: int = _opt(args, "max_batch_tokens")
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

    def engine(self, cache: HiCache) -> Engine:
        """A node's engine: room in the batch for every conversation's request at once."""
        return Engine(
            self.model,
            cache,
            max_batch_tokens=self.max_batch_tokens,
            max_running=max(len(self.chats), 1),
        )

    async def warm_up(self) -> None:
        """Run both paths, untimed, on a throwaway cache and prompts as long as the first
        round's (sharing a system prompt, submitted at once, twice; the uncached path once per
        length), so that neither path's first timed run pays a warm-up (first calls of a
        shape, the model thread, allocations): a miss then shows ~1x."""
        rng = random.Random(-1)
        vocab = int(self.model.config.vocab_size)

        def toks(n: int) -> list[int]:
            return [rng.randrange(vocab) for _ in range(n)]

        system = _opt(self.args, "system_tokens")
        lengths = [len(c.history) + len(c.messages[c.replies]) for c in self.chats]
        cfg = demo_config(self.args, self.model)  # no storage: nothing outlives the warm-up
        async with HiCache(cfg) as scratch, self.engine(scratch) as engine:
            for _ in range(2):
                shared = toks(system)
                await self.batch(engine, [shared + toks(n - system) for n in lengths], [])
        for n in sorted(set(lengths)):
            reference_generate(self.model, toks(n), self.new_tokens, keep_logits=True)

    async def batch(
        self, engine: Engine, prompts: Sequence[list[int]], labels: Sequence[str]
    ) -> list[GenerationResult]:
        """Submit every prompt at once; their results, in order, once all ended (the first
        failure is raised then: one request failing does not end the others)."""

        async def one(i: int) -> GenerationResult:
            res = await engine.generate(
                prompts[i], max_new_tokens=self.new_tokens, keep_logits=True
            )
            if labels:
                self.progress.advance(labels[i])
            return res

        ended = await asyncio.gather(*(one(i) for i in range(len(prompts))), return_exceptions=True)
        results: list[GenerationResult] = []
        for res in ended:
            if isinstance(res, BaseException):
                raise res
            results.append(res)
        return results

    def references(self, prompts: Sequence[list[int]], turn: int, node: str) -> list[Generation]:
        """Each prompt generated alone without a cache (the identity check's baseline)."""
        refs = []
        for chat, prompt in zip(self.chats, prompts, strict=True):
            refs.append(reference_generate(self.model, prompt, self.new_tokens, keep_logits=True))
            self.progress.advance(f"{node} turn {turn} {chat.name}: no cache")
        return refs

    async def round(self, engine: Engine, turn: int, node: str) -> None:
        """Turn ``turn`` of every conversation: every chat's next message submitted to the
        engine at once, the same prompts generated alone without a cache (before the batch on
        odd turns, after it on even ones, so neither always finds the processor caches warm),
        compared; then the round's table."""
        chats = self.chats
        prompts = [c.history + c.messages[c.replies] for c in chats]
        refs = self.references(prompts, turn, node) if turn % 2 else []
        before = engine.statistics()
        labels = [f"{node} turn {turn} {c.name}: cache (batched)" for c in chats]
        got = await self.batch(engine, prompts, labels)
        stats = RoundStats.between(before, engine.statistics())
        if not refs:
            refs = self.references(prompts, turn, node)
        rows = []
        for chat, prompt, ref, res in zip(chats, prompts, refs, got, strict=True):
            assert ref.logits is not None and res.logits is not None
            diff = float((ref.logits - res.logits).abs().max())
            chat.history = prompt + res.tokens
            chat.replies += 1
            rows.append(TurnResult(node, turn, chat.name, ref, res, diff, batch=len(chats)))
        self.log.results += rows
        self.progress.clear()
        heading(
            f"{node}, turn {turn}: {len(chats)} requests at once through one Engine "
            "(cached TTFT measured in the batch, from arrival)",
            out=self.out,
        )
        print_turns(rows, self.out)
        print(round_line(stats), file=self.out)
        self.progress.draw()

    async def run(self) -> bool:
        """Node 1 plays every turn; node 2 (restarted, same storage) one more turn each."""
        try:
            await self.warm_up()
            await self.play()
        finally:
            self.progress.clear()
        return self.summary()

    def node_done(self, node: str, cache: HiCache, engine: Engine) -> None:
        """Check the node's invariants, print its cache's statistics, keep its events."""
        engine.check_invariants()  # the engine's bookkeeping and the cache's
        self.log.engines.append((node, engine.statistics()))
        self.progress.clear()
        heading(f"{node}: statistics()", out=self.out)
        print_statistics(cache.statistics(), self.out)
        self.log.events += cache.take_events()

    async def play(self) -> None:
        """The turns of node 1, then (with a storage tier) node 2's."""
        async with contextlib.AsyncExitStack() as stack:
            cache = await stack.enter_async_context(HiCache(self.config()))
            engine = await stack.enter_async_context(self.engine(cache))
            for turn in range(1, self.turns + 1):
                await self.round(engine, turn, "node 1")
            await cache.flush()  # every backup to storage landed
            self.node_done("node 1", cache, engine)
            if self.setup.kind == "file":
                await stack.aclose()  # a true restart: node 1 is gone, its files stay
                how = "node 1 closed; node 2 opens the same directory with empty L1/L2"
            else:  # Mooncake: node 1's segment holds the pages, so it stays up
                how = "node 1 stays up (its segment holds the pages); node 2 is a second client"
            if self.setup.kind != "none":
                heading("restarted node: a fresh cache on the same storage", out=self.out)
                print(f"  {how}", file=self.out)
                async with HiCache(self.config()) as cache2, self.engine(cache2) as engine2:
                    await self.round(engine2, self.turns + 1, "node 2")
                    await cache2.flush()
                    self.node_done("node 2", cache2, engine2)

    def summary(self) -> bool:
        """The tables across all turns; True when every generation was identical."""
        results = self.log.results
        out = self.out
        restarted = self.setup.kind != "none"
        heading("KV events (both nodes)" if restarted else "KV events", out=out)
        print_event_summary(self.log.events, out)
        heading("Engine.statistics() per node", out=out)
        print_engine_statistics(self.log.engines, out)
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
        check_positions(args)
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
                f"L3: {setup.describe()}; each round's turns served at once, batched through one "
                f"aiocache_kv.serving.Engine per node (max_batch_tokens="
                f"{_opt(args, 'max_batch_tokens')})",
                file=stream,
            )
            ok = await ChatDemo(args, model, setup, stream).run()
            return 0 if ok else 1
    except KVCacheError as exc:
        log.error("demo_failed", error=str(exc), error_type=type(exc).__name__)
        print(f"demo failed: {type(exc).__name__}: {exc}", file=stream)
        return 1
