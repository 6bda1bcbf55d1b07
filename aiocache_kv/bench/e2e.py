"""End-to-end benchmark: time to first token vs cached prefix length, per tier.

A random-weight GPT-2 (6 layers x 4 heads x 64 dims, 2,112 positions; nothing downloaded)
serves prompts made of a prefix of ``P`` tokens and a fresh suffix of ``--suffix`` tokens.
For each prefix length, TTFT (request -> first generated token, greedy) is measured:

* **no cache** - ``transformers``' ``DynamicCache``, the whole prompt prefilled;
* **device** - the prefix's KV is on device: ``match_prefix`` + prefill of the suffix only;
* **host** - the prefix was demoted to host (device evicted): ``load_back`` + suffix prefill;
* **storage** - the prefix is only in storage (``FileStorage``; device and host evicted):
  ``prefetch`` + ``load_back`` + suffix prefill.

Each measurement is the median of ``--e2e-repeats`` requests, each with a different suffix
(so the prefix hit is exactly the prefix's whole pages), after one untimed warm-up.  Every
cached generation is checked token-identical to the uncached one.  Target: with a 2,000-token
prefix on device, TTFT at least 5x better than without the cache.  ``--plot PATH`` writes a
PNG; without matplotlib the CLI refuses it (exit 2) before measuring anything.
"""

from __future__ import annotations

import importlib
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aiocache_kv.bench.report import JSON, heading, table
from aiocache_kv.cache import HiCache
from aiocache_kv.errors import InvalidInputError
from aiocache_kv.logs import get_logger
from aiocache_kv.loop import run as run_loop
from aiocache_kv.models import CachedLM, GPT2Spec, build_gpt2, cache_config_for
from aiocache_kv.models.generate import reference_generate
from aiocache_kv.storage import FileStorage

log = get_logger(__name__)

SPEC = GPT2Spec(n_layer=6, n_head=4, n_embd=256, vocab_size=50257, n_positions=2112, seed=0)
TIERS = ("device", "host", "storage")
TARGET_PREFIX = 2000
TARGET_SPEEDUP = 5.0
PAGE_SIZE = 16
#: what ``--plot`` says without matplotlib (the README gives the same command)
PLOT_HINT = "--plot needs matplotlib: pip install -e .[plot]"


@dataclass(frozen=True)
class E2EBenchOptions:
    """Options of ``aiocache-kv bench e2e``."""

    prefix_lens: tuple[int, ...] = (128, 512, 1024, 2000)
    suffix: int = 16
    repeats: int = 3
    seed: int = 0
    plot: str | None = None
    storage_dir: str | None = None


def _tokens(seed: int, n: int, vocab: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


async def _measure(opts: E2EBenchOptions, model: Any, root: str) -> dict[int, dict[str, Any]]:
    vocab = SPEC.vocab_size
    out: dict[int, dict[str, Any]] = {}
    longest = max(opts.prefix_lens)
    pages = 2 * (-(-(longest + opts.suffix + 1) // PAGE_SIZE)) + 8
    for i, plen in enumerate(opts.prefix_lens):
        prefix = _tokens(opts.seed * 1000 + i, plen, vocab)
        suffixes = [
            _tokens(opts.seed * 1000 + 100 + r, opts.suffix, vocab) for r in range(opts.repeats + 1)
        ]
        ref_ttft: list[float] = []
        ref_tokens: list[list[int]] = []
        for r, suffix in enumerate(suffixes):
            ref = reference_generate(model, prefix + suffix, 1)
            if r:  # the first is a warm-up
                ref_ttft.append(ref.ttft)
            ref_tokens.append(ref.tokens)
        row: dict[str, Any] = {"no_cache_ms": statistics.median(ref_ttft) * 1e3}
        cfg = cache_config_for(
            model,
            page_size=PAGE_SIZE,
            device_pages=pages,
            host_pages=2 * pages,
            host_memory_reserve_bytes=0,
            namespace=f"{SPEC.name}-bench-{i}",
            storage=FileStorage(f"{root}/p{plen}"),
            prefetch_policy="wait_complete",
            prefetch_threshold_tokens=0,
        )
        identical = True
        async with HiCache(cfg) as cache:
            lm = CachedLM(model, cache)
            await lm.generate(prefix, 1)  # the prefix's KV: computed once, cached
            await cache.flush()
            for tier in TIERS:
                times: list[float] = []
                hits: list[int] = []
                for r, suffix in enumerate(suffixes):
                    await cache.flush()
                    if tier in ("host", "storage"):
                        cache.evict(cache.statistics().device.evictable_pages)
                    if tier == "storage":
                        cache.evict(cache.statistics().host.evictable_pages, "host")
                    gen = await lm.generate(prefix + suffix, 1)
                    identical &= gen.tokens == ref_tokens[r]
                    got = {"device": gen.hit_device, "host": gen.hit_host}.get(
                        tier, gen.hit_storage
                    )
                    if r:
                        times.append(gen.ttft)
                        hits.append(got)
                ms = statistics.median(times) * 1e3
                row[f"{tier}_ms"] = ms
                row[f"{tier}_hit_tokens"] = min(hits)
                row[f"{tier}_speedup"] = row["no_cache_ms"] / ms if ms > 0 else 0.0
        row["identical"] = identical
        out[plen] = row
        log.info("bench_e2e_prefix_done", prefix=plen, **{k: v for k, v in row.items()})
    return out


def _plot(results: dict[int, dict[str, Any]], path: str) -> str | None:
    try:
        matplotlib: Any = importlib.import_module("matplotlib")
        matplotlib.use("Agg")
        plt: Any = importlib.import_module("matplotlib.pyplot")
    except ImportError:
        return f"{PLOT_HINT} (no plot written)"
    xs = sorted(results)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(xs, [results[x]["no_cache_ms"] for x in xs], "o-", label="no cache")
    for tier in TIERS:
        ax.plot(xs, [results[x][f"{tier}_ms"] for x in xs], "o-", label=f"cached prefix: {tier}")
    ax.set_xlabel("cached prefix length (tokens)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title(f"aiocache-kv: TTFT vs prefix length ({SPEC.n_layer}-layer random GPT-2, CPU)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def run(opts: E2EBenchOptions) -> JSON:
    """Run the benchmark, print its table and return the JSON-able results."""
    heading("bench e2e: TTFT vs cached prefix length, per tier (random-weight GPT-2, CPU)")
    need = max(opts.prefix_lens) + opts.suffix + 1
    if need > SPEC.n_positions:
        raise InvalidInputError(f"prefix + suffix ({need}) exceeds the model's {SPEC.n_positions}")
    t0 = time.perf_counter()
    model = build_gpt2(SPEC)
    reference_generate(model, list(range(64)), 2)  # warm up
    print(
        f"model: GPT-2 {SPEC.n_layer} layers x {SPEC.n_head} heads x {SPEC.head_dim} dims, "
        f"random weights (seed {SPEC.seed}); page_size {PAGE_SIZE}; suffix {opts.suffix} "
        f"tokens; median of {opts.repeats} after a warm-up; TTFT = request -> first token "
        "(cached: prefetch + match + load_back + alloc + suffix prefill). Storage: FileStorage."
    )
    root = opts.storage_dir or tempfile.mkdtemp(prefix="aiocache-kv-bench-e2e-")
    try:
        results = run_loop(_measure(opts, model, root))
    finally:
        if opts.storage_dir is None:
            shutil.rmtree(root, ignore_errors=True)
    rows: list[Sequence[object]] = []
    for plen in sorted(results):
        r = results[plen]
        rows.append(
            [
                plen,
                f"{r['no_cache_ms']:.1f}",
                *(f"{r[f'{t}_ms']:.1f} ({r[f'{t}_speedup']:.1f}x)" for t in TIERS),
                "yes" if r["identical"] else "NO",
            ]
        )
    table(
        [
            "prefix",
            "no cache ms",
            "device hit ms",
            "host hit ms",
            "storage hit ms",
            "identical",
        ],
        rows,
    )
    target_row = results.get(TARGET_PREFIX)
    verdict: JSON = {"prefix": TARGET_PREFIX, "speedup_target": TARGET_SPEEDUP}
    if target_row is not None:
        got = float(target_row["device_speedup"])
        verdict.update(device_speedup=got, met=got >= TARGET_SPEEDUP)
        met = "MET" if got >= TARGET_SPEEDUP else "NOT met"
        print(
            f"\ntarget: {TARGET_PREFIX}-token cached prefix (device) TTFT >= "
            f"{TARGET_SPEEDUP:.0f}x better: {got:.1f}x -> {met}"
        )
    plot_note = _plot(results, opts.plot) if opts.plot else None
    if opts.plot:
        print(plot_note or f"plot written to {opts.plot}")
    print(f"(bench e2e took {time.perf_counter() - t0:.1f} s)")
    return {
        "model": {
            "layers": SPEC.n_layer,
            "heads": SPEC.n_head,
            "head_dim": SPEC.head_dim,
            "vocab": SPEC.vocab_size,
            "seed": SPEC.seed,
        },
        "page_size": PAGE_SIZE,
        "suffix": opts.suffix,
        "repeats": opts.repeats,
        "prefix_lens": {str(k): v for k, v in sorted(results.items())},
        "target": verdict,
        "identical": all(r["identical"] for r in results.values()),
        "plot": opts.plot if opts.plot and plot_note is None else None,
    }
