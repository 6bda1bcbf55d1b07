"""Serving benchmark: the batched engine against one request at a time and ``transformers``.

A seeded multi-turn chat: ``--conversations`` conversations (default 12) share one system
prompt (``--system-tokens``, default 160); each sends ``--turns`` turns (default 4), every turn
the conversation so far (system prompt, earlier messages and replies) plus a new user message
of 20-60 random tokens, and waits for its greedy reply (``--reply-tokens``, default 16) before
sending the next.  The conversations run concurrently (asyncio tasks).  The same model serves
the same requests on every side (:mod:`aiocache_kv.bench.engine_sides`):

* **engine** - :class:`aiocache_kv.serving.Engine` over a fresh ``HiCache`` (device and host
  pools; the device pool holds every conversation whole with room to spare), all
  conversations at once;
* **sequential** - ``CachedLM.generate`` over a fresh ``HiCache`` of the same layout, one
  request at a time (requests queue behind each other, as in a single serving loop);
* **transformers** - ``transformers``' own continuous batching on CPU
  (``init_continuous_batching``, its prefix sharing on), same page size, a pool of as many
  pages, the same token budget per step.

Per side and model: wall time, generated tokens/s, TTFT p50/p90/p99 (submission to first
token: for the sequential side that includes waiting behind other requests), inter-token
latency mean/p90, prompt tokens computed and reused.  Targets: engine >= 3x the sequential
throughput with a lower TTFT p50; engine above ``transformers``' throughput with a lower TTFT
p90; the engine's loop-side CPU time (its step loop and admission tasks, the scheduling and
cache calls) <= 5 % of the time in forward passes; event-loop lag p99 <= 2 ms while the batch
is full.  Engine and sequential replies must be token-identical (greedy); differences from
``transformers`` are counted, not failed (its kernels may round differently).  Each side
serves one unrelated warm-up request first, untimed.
"""

from __future__ import annotations

import math
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aiocache_kv.bench import ENGINE_MODELS, ENGINE_SIDES
from aiocache_kv.bench.engine_sides import (
    SideRun,
    Turn,
    Workload,
    serve_engine,
    serve_sequential,
    serve_transformers,
)
from aiocache_kv.bench.report import JSON, heading, percentile, ratio, table
from aiocache_kv.config import CacheConfig
from aiocache_kv.errors import InvalidInputError
from aiocache_kv.loop import run as run_loop
from aiocache_kv.models import GPT2Spec, build_gpt2, cache_config_for, reference_generate
from aiocache_kv.models.llama import LlamaSpec, build_llama

__all__ = ["MODELS", "SIDES", "EngineBenchOptions", "make_workload", "run"]

MODELS = ENGINE_MODELS
SIDES = ENGINE_SIDES
SIZES = ("small", "tiny")
#: the models: ``small`` is the demo's GPT-2 and a Llama of about its size; ``tiny`` is for tests
SPECS: dict[str, dict[str, GPT2Spec | LlamaSpec]] = {
    "small": {
        "gpt2": GPT2Spec(n_layer=6, n_head=4, n_embd=256, vocab_size=50257, n_positions=1024),
        "llama": LlamaSpec(
            arch="llama",
            layers=6,
            heads=4,
            kv_heads=2,
            head_dim=64,
            hidden=256,
            intermediate=688,
            vocab=32000,
            max_positions=1024,
        ),
    },
    "tiny": {
        "gpt2": GPT2Spec(n_layer=2, n_head=2, n_embd=64, vocab_size=512, n_positions=256),
        "llama": LlamaSpec(
            arch="llama",
            layers=2,
            heads=2,
            kv_heads=1,
            head_dim=32,
            hidden=64,
            intermediate=128,
            vocab=512,
            max_positions=256,
        ),
    },
}
TARGET_SEQ_THROUGHPUT = 3.0  #: engine / sequential generated tokens per second, at least
TARGET_CPU_SHARE = 0.05  #: engine loop-side CPU / time in forward passes, at most
TARGET_LAG_P99 = 0.002  #: seconds of event-loop lag (p99) while the batch is full, at most
#: device pool: the workload's conversations, each whole, times this
POOL_HEADROOM = 1.25


@dataclass(frozen=True)
class EngineBenchOptions:
    """Options of ``aiocache-kv bench engine``."""

    models: tuple[str, ...] = MODELS
    sides: tuple[str, ...] = SIDES
    conversations: int = 12
    turns: int = 4
    system_tokens: int = 160
    user_tokens: tuple[int, int] = (20, 60)  #: each user message: uniform in [lo, hi]
    reply_tokens: int = 16
    page_size: int = 16
    max_batch_tokens: int = 256
    max_running: int = 16
    device_pages: int | None = None  #: None: sized from the workload
    lag_pass: bool = True  #: serve the workload a second time on the engine, measuring loop lag
    repeats: int = 1  #: rounds of every side, interleaved; each side reports its median-wall run
    size: str = "small"  #: the models' size: "small" or "tiny" (tests)
    seed: int = 0


def make_workload(opts: EngineBenchOptions, vocab: int) -> Workload:
    """The seeded chat: token ids in ``[0, vocab - 1)`` (the last id is GPT-2's EOS)."""
    rng = random.Random(opts.seed)
    lo, hi = opts.user_tokens

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab - 1) for _ in range(n)]

    system = tokens(opts.system_tokens)
    users = [
        [tokens(rng.randint(lo, hi)) for _ in range(opts.turns)] for _ in range(opts.conversations)
    ]
    return Workload(system, users, opts.reply_tokens, warmup=tokens(opts.system_tokens // 2 + 8))


def _check(opts: EngineBenchOptions) -> None:
    bad = [m for m in opts.models if m not in MODELS] + [s for s in opts.sides if s not in SIDES]
    if bad or not opts.models or not opts.sides or opts.size not in SIZES:
        raise InvalidInputError(
            f"models must be among {MODELS}, sides among {SIDES}, size one of {SIZES}; got "
            f"{opts.models}, {opts.sides}, {opts.size!r}"
        )
    lo, hi = opts.user_tokens
    counts = (opts.conversations, opts.turns, opts.system_tokens, lo, opts.reply_tokens)
    if min(counts) < 1 or hi < lo or opts.page_size < 1 or opts.repeats < 1:
        raise InvalidInputError(f"workload sizes must be positive (user {lo}-{hi}): {opts}")


def _pool_pages(wl: Workload, page: int) -> int:
    r = wl.reply_tokens
    whole = sum(
        -(-(len(wl.system) + sum(len(u) for u in turns) + len(turns) * r) // page) + 1
        for turns in wl.users
    )
    return math.ceil(whole * POOL_HEADROOM) + 8


def _model_info(spec: GPT2Spec | LlamaSpec) -> JSON:
    if isinstance(spec, GPT2Spec):
        return {
            "arch": "gpt2", "layers": spec.n_layer, "heads": spec.n_head,
            "kv_heads": spec.n_head, "head_dim": spec.head_dim, "hidden": spec.n_embd,
            "vocab": spec.vocab_size, "positions": spec.n_positions, "seed": spec.seed,
        }  # fmt: skip
    return {
        "arch": spec.arch, "layers": spec.layers, "heads": spec.heads,
        "kv_heads": spec.kv_heads, "head_dim": spec.head_dim, "hidden": spec.hidden,
        "vocab": spec.vocab, "positions": spec.max_positions, "seed": spec.seed,
    }  # fmt: skip


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def summarize(run: SideRun) -> JSON:
    """The side's numbers (JSON): times in ms, throughput in generated tokens per second."""
    if run.error is not None and not run.turns:
        return {"error": run.error}
    served = [t.served for t in run.turns]
    ttft = [s.ttft for s in served]
    itl = [x for s in served for x in s.itl]
    generated = sum(len(s.tokens) for s in served)
    return {
        "error": run.error,
        "requests": len(served),
        "wall_s": round(run.wall, 4),
        "generated_tokens": generated,
        "throughput_tok_s": round(ratio(generated, run.wall), 2),
        "ttft_ms": {f"p{q}": _ms(percentile(ttft, q)) for q in (50, 90, 99)},
        "itl_ms": {
            "mean": _ms(sum(itl) / len(itl) if itl else 0.0),
            "p90": _ms(percentile(itl, 90)),
        },
        "latency_ms_p50": _ms(percentile([s.latency for s in served], 50)),
        "prompt_tokens": sum(t.prompt_len for t in run.turns),
        "prompt_tokens_computed": sum(s.computed for s in served),
        "prompt_tokens_reused": sum(s.reused for s in served),
    }


def _engine_extra(run: SideRun) -> JSON:
    """The engine's step counters, its loop-side CPU share and the loop's lag."""
    x = run.extra
    step_s = float(x["step_seconds"])
    engine_cpu = float(x["step_loop_cpu_s"]) + float(x["admission_cpu_s"])
    out: JSON = {
        "steps": x["steps"],
        "step_seconds": round(step_s, 4),
        "step_tokens": x["step_tokens"],
        "mean_batch": round(float(x["mean_batch"]), 2),
        "preemptions": x["preemptions"],
        "shared_in_flight_tokens": x["shared_in_flight_tokens"],
        "failed": x["failed"],
        "forward_share_of_wall": round(ratio(step_s, run.wall), 4),
        "cpu": {
            "step_loop_s": round(float(x["step_loop_cpu_s"]), 4),
            "admission_s": round(float(x["admission_cpu_s"]), 4),
            "engine_s": round(engine_cpu, 4),
            "engine_share_of_step_time": round(ratio(engine_cpu, step_s), 4),
            "step_loop_share_of_step_time": round(ratio(float(x["step_loop_cpu_s"]), step_s), 4),
            "step_loop_wall_s": round(float(x["step_loop_wall_s"]), 4),
            "loop_thread_s": round(float(x["loop_thread_cpu_s"]), 4),
            "wall_outside_forward_share": round(ratio(run.wall - step_s, run.wall), 4),
            "tasks_timed": x["tasks_timed"],
        },
    }
    if "lag" in x:
        lag, busy, idle = x["lag"], x["lag_busy"], x["lag_idle"]
        out["loop_lag_ms"] = {
            "busy_p50": _ms(percentile(busy, 50)),
            "busy_p99": _ms(percentile(busy, 99)),
            "busy_samples": len(busy),
            "p99": _ms(percentile(lag, 99)),
            "max": _ms(max(lag, default=0.0)),
            "samples": len(lag),
            "idle_p99": _ms(percentile(idle, 99)),
            "pass_wall_s": round(float(x["lag_pass_wall_s"]), 4),
            "switch_interval_ms": _ms(sys.getswitchinterval()),
        }
    return out


def _differing(a: list[Turn], b: list[Turn]) -> int:
    """Requests of ``a`` whose reply differs from ``b``'s (matched by conversation and turn)."""
    theirs = {(t.conversation, t.turn): t.served.tokens for t in b}
    return sum(theirs.get((t.conversation, t.turn)) != t.served.tokens for t in a) + max(
        0, len(b) - len(a)
    )


async def _sides(
    model: Any, spec: GPT2Spec | LlamaSpec, wl: Workload, opts: EngineBenchOptions, pages: int
) -> dict[str, list[SideRun]]:
    def config(side: str) -> CacheConfig:
        return cache_config_for(
            model,
            page_size=opts.page_size,
            device_pages=pages,
            host_pages=2 * pages,
            host_memory_reserve_bytes=0,
            namespace=f"{spec.name}-bench-engine-{side}",
            enable_kv_events=False,
        )

    runs: dict[str, list[SideRun]] = {side: [] for side in opts.sides}
    for rnd in range(opts.repeats):  # rounds interleave the sides: load drifts hit them alike
        for side in opts.sides:
            t0 = time.perf_counter()
            try:
                if side == "engine":
                    busy_at = max(1, min(opts.conversations, opts.max_running) * 3 // 4)
                    run = await serve_engine(
                        model, wl, config(side), max_batch_tokens=opts.max_batch_tokens,
                        max_running=opts.max_running, busy_at=busy_at, lag_pass=opts.lag_pass,
                    )  # fmt: skip
                elif side == "sequential":
                    run = await serve_sequential(model, wl, config(side))
                else:
                    run = await serve_transformers(
                        model, wl, page_size=opts.page_size, num_blocks=pages,
                        max_batch_tokens=opts.max_batch_tokens, max_requests=opts.max_running,
                        attn_implementation=spec.attn_implementation,
                    )  # fmt: skip
            except Exception as exc:  # a side that breaks is reported, the others still run
                run = SideRun(error=f"{type(exc).__name__}: {exc}")
            runs[side].append(run)
            took = time.perf_counter() - t0
            print(f"  round {rnd + 1}/{opts.repeats} {side}: {took:.1f} s", file=sys.stderr)
    return runs


def _median_run(runs: list[SideRun]) -> SideRun:
    """The run of median wall time among those without an error (else the first)."""
    good = sorted((r for r in runs if r.error is None), key=lambda r: r.wall)
    return good[(len(good) - 1) // 2] if good else runs[0]


def _verdicts(sides: dict[str, JSON]) -> tuple[JSON, JSON]:
    """Ratios between the sides and the targets met."""
    eng, seq, tf = (sides.get(s, {}) for s in SIDES)
    ratios: JSON = {}
    targets: JSON = {}
    ok = {name: "throughput_tok_s" in s and not s.get("error") for name, s in sides.items()}
    if ok.get("engine") and ok.get("sequential"):
        thr = ratio(eng["throughput_tok_s"], seq["throughput_tok_s"])
        ttft = ratio(eng["ttft_ms"]["p50"], seq["ttft_ms"]["p50"])
        ratios["engine_vs_sequential"] = {"throughput": round(thr, 3), "ttft_p50": round(ttft, 3)}
        targets["throughput_vs_sequential"] = {
            "value": round(thr, 3), "target": f">= {TARGET_SEQ_THROUGHPUT}",
            "met": thr >= TARGET_SEQ_THROUGHPUT,
        }  # fmt: skip
        targets["ttft_p50_vs_sequential"] = {
            "value": round(ttft, 3),
            "target": "< 1",
            "met": ttft < 1,
        }
    if ok.get("engine") and ok.get("transformers"):
        thr = ratio(eng["throughput_tok_s"], tf["throughput_tok_s"])
        ttft = ratio(eng["ttft_ms"]["p90"], tf["ttft_ms"]["p90"])
        ratios["engine_vs_transformers"] = {"throughput": round(thr, 3), "ttft_p90": round(ttft, 3)}
        targets["throughput_vs_transformers"] = {
            "value": round(thr, 3),
            "target": "> 1",
            "met": thr > 1,
        }
        targets["ttft_p90_vs_transformers"] = {
            "value": round(ttft, 3),
            "target": "< 1",
            "met": ttft < 1,
        }
    if ok.get("engine"):
        share = eng["engine"]["cpu"]["engine_share_of_step_time"]
        targets["engine_cpu_share"] = {
            "value": share, "target": f"<= {TARGET_CPU_SHARE}", "met": share <= TARGET_CPU_SHARE,
        }  # fmt: skip
    if ok.get("engine") and "loop_lag_ms" in eng["engine"]:
        lag = eng["engine"]["loop_lag_ms"]["busy_p99"] / 1e3
        targets["loop_lag_p99_ms"] = {
            "value": _ms(lag), "target": f"<= {_ms(TARGET_LAG_P99)}", "met": lag <= TARGET_LAG_P99,
        }  # fmt: skip
    return ratios, targets


def measure_model(name: str, opts: EngineBenchOptions) -> JSON:
    """Build ``name`` and serve the workload on every side; the model's part of the report."""
    spec = SPECS[opts.size][name]
    model = build_gpt2(spec) if isinstance(spec, GPT2Spec) else build_llama(spec)
    vocab = spec.vocab_size if isinstance(spec, GPT2Spec) else spec.vocab
    wl = make_workload(opts, vocab)
    positions = _model_info(spec)["positions"]
    if wl.longest() > positions:
        raise InvalidInputError(f"the longest conversation ({wl.longest()}) exceeds {positions}")
    pages = opts.device_pages or _pool_pages(wl, opts.page_size)
    if wl.longest() > pages * opts.page_size:
        raise InvalidInputError(f"{pages} device pages cannot hold a {wl.longest()}-token request")
    reference_generate(model, wl.warmup, 2)  # the first forward passes of a process are slow
    load = [round(x, 2) for x in os.getloadavg()]  # other work on the machine skews timings
    all_runs = run_loop(_sides(model, spec, wl, opts, pages))
    runs = {side: _median_run(rs) for side, rs in all_runs.items()}
    sides: JSON = {}
    for side, run in runs.items():
        sides[side] = summarize(run)
        sides[side]["rounds_wall_s"] = [round(r.wall, 4) for r in all_runs[side]]
        if side == "engine" and run.error is None:
            sides[side]["engine"] = _engine_extra(run)
        if side == "transformers" and run.extra:
            sides[side]["transformers"] = dict(run.extra)
    identical: JSON = {}
    if "engine" in runs and "sequential" in runs:
        diffs = [  # every round: greedy replies never differ
            _differing(e.turns, q.turns)
            if e.error is None and q.error is None and len(e.turns) == wl.requests
            else wl.requests
            for e, q in zip(all_runs["engine"], all_runs["sequential"], strict=True)
        ]
        diff = max(diffs)
        identical["engine_vs_sequential"] = {"identical": diff == 0, "differing": diff}
    if "engine" in runs and "transformers" in runs and runs["transformers"].error is None:
        differing = _differing(runs["engine"].turns, runs["transformers"].turns)
        identical["engine_vs_transformers"] = {"differing": differing}
    ratios, targets = _verdicts(sides)
    return {
        "model": {"name": spec.name, **_model_info(spec)},
        "cache": {"page_size": opts.page_size, "device_pages": pages, "host_pages": 2 * pages},
        "load_average": load,
        "sides": sides,
        "ratios": ratios,
        "targets": targets,
        "identical": identical,
    }


def _cell(side: JSON, *path: str, fmt: str = "{:.1f}") -> str:
    value: Any = side
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return "-"
        value = value[key]
    return fmt.format(value)


def _print_model(name: str, res: JSON) -> None:
    m = res["model"]
    print(
        f"\n{name}: {m['layers']} layers x {m['heads']} heads ({m['kv_heads']} KV) x "
        f"{m['head_dim']} dims, vocab {m['vocab']}; page {res['cache']['page_size']}, "
        f"device pool {res['cache']['device_pages']} pages; load average "
        f"{res['load_average'][0]:.1f} at start"
    )
    rows: list[Sequence[object]] = []
    same = res["identical"]
    for side, s in res["sides"].items():
        if "throughput_tok_s" not in s:
            rows.append([side, *["-"] * 9, f"ERROR: {s.get('error')}"])
            continue
        if side == "sequential" and "engine_vs_sequential" in same:
            check = "yes" if same["engine_vs_sequential"]["identical"] else "NO"
        elif side == "transformers" and "engine_vs_transformers" in same:
            check = f"{same['engine_vs_transformers']['differing']} differ"
        else:
            check = "ref" if side == "engine" else "-"
        rows.append([
            side, _cell(s, "wall_s", fmt="{:.2f}"), _cell(s, "throughput_tok_s"),
            _cell(s, "ttft_ms", "p50"), _cell(s, "ttft_ms", "p90"), _cell(s, "ttft_ms", "p99"),
            _cell(s, "itl_ms", "mean"), _cell(s, "itl_ms", "p90"),
            s["prompt_tokens_computed"], s["prompt_tokens_reused"],
            check if not s.get("error") else f"{check}; error",
        ])  # fmt: skip
    table(
        ["side", "wall s", "tok/s", "TTFT p50 ms", "p90", "p99", "ITL mean ms", "p90",
         "prompt computed", "reused", "same as engine"],
        rows,
    )  # fmt: skip
    e = res["sides"].get("engine", {}).get("engine")
    if e:
        cpu = e["cpu"]
        lag = e.get("loop_lag_ms")
        lag_text = (
            f"; loop lag p99 {lag['busy_p99']:.2f} ms with the batch full (separate pass), "
            f"{lag['idle_p99']:.2f} ms idle"
            if lag
            else ""
        )
        print(
            f"engine: {e['steps']} steps, {e['mean_batch']:.1f} requests/step, "
            f"{e['step_seconds']:.2f} s in forward passes ({e['forward_share_of_wall']:.0%} of "
            f"wall); loop-side CPU: step loop {cpu['step_loop_s'] * 1e3:.0f} ms + admission "
            f"{cpu['admission_s'] * 1e3:.0f} ms ({cpu['engine_share_of_step_time']:.1%} of step "
            f"time){lag_text}; {e['preemptions']} preemptions"
        )
    labels = {
        "throughput_vs_sequential": "throughput engine / sequential",
        "ttft_p50_vs_sequential": "TTFT p50 engine / sequential",
        "throughput_vs_transformers": "throughput engine / transformers",
        "ttft_p90_vs_transformers": "TTFT p90 engine / transformers",
        "engine_cpu_share": "engine loop CPU / step time",
        "loop_lag_p99_ms": "loop lag p99 ms (batch full)",
    }
    rows = [
        [labels[k], f"{v['value']:.3g}", v["target"], "MET" if v["met"] else "NOT met"]
        for k, v in res["targets"].items()
    ]
    if rows:
        table(["target", "value", "target", "verdict"], rows, align="lrrl")


def run(opts: EngineBenchOptions) -> JSON:
    """Run the benchmark, print its tables and return the JSON-able results."""
    _check(opts)
    heading("bench engine: batched engine vs one-at-a-time vs transformers CB (multi-turn chat)")
    lo, hi = opts.user_tokens
    print(
        f"workload: {opts.conversations} conversations x {opts.turns} turns, a shared "
        f"{opts.system_tokens}-token system prompt, user messages {lo}-{hi} tokens, greedy "
        f"replies of {opts.reply_tokens} tokens; next turn sent when the reply arrives; seed "
        f"{opts.seed}. Engine: max_batch_tokens {opts.max_batch_tokens}, max_running "
        f"{opts.max_running}. TTFT = submission -> first token (queueing included). "
        + (
            f"{opts.repeats} interleaved rounds, each side's median-wall round shown."
            if opts.repeats > 1
            else "One round (--engine-repeats N for medians)."
        )
    )
    t0 = time.perf_counter()
    models: JSON = {}
    for name in opts.models:
        print(f"bench engine: {name} ...", file=sys.stderr)
        models[name] = measure_model(name, opts)
        _print_model(name, models[name])
    same = [m["identical"].get("engine_vs_sequential") for m in models.values()]
    identical = all(s is None or s["identical"] for s in same)
    if not identical:
        print("\nFAILED: engine and sequential replies differ (greedy: they must be identical)")
    print(f"(bench engine took {time.perf_counter() - t0:.1f} s)")
    errors = [
        f"{name}/{side}: {s['error']}"
        for name, m in models.items()
        for side, s in m["sides"].items()
        if s.get("error")
    ]
    return {
        "workload": {
            "conversations": opts.conversations,
            "turns": opts.turns,
            "system_tokens": opts.system_tokens,
            "user_tokens": [lo, hi],
            "reply_tokens": opts.reply_tokens,
            "requests": opts.conversations * opts.turns,
            "seed": opts.seed,
        },
        "repeats": opts.repeats,
        "engine_options": {
            "max_batch_tokens": opts.max_batch_tokens,
            "max_running": opts.max_running,
        },
        "size": opts.size,
        "models": models,
        "identical": identical,
        "errors": errors,
    }
