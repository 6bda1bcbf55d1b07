"""Multi-turn serving benchmark in the shape of SGLang's ``benchmark/hicache/bench_multiturn.py``.

``--clients`` clients (default 12) share a system prompt (``--system-tokens``); each plays
``--rounds`` rounds (default 6): the conversation so far plus a new ``--user-tokens`` message,
answered greedily with ``--output-len`` tokens; a client's next turn is sent when its reply
arrived, so its history grows every round.  Clients' first turns arrive by a Poisson process
(``--request-rate``; ``inf``: all at once), at most ``--max-in-flight`` requests are
outstanding, and ``--round-barrier`` holds every client until all finished the round.

The same requests run through every arm (:mod:`aiocache_kv.bench.serve_arms`): the engine with
no prefix reuse, with device-only reuse, with device + host, with device + host + file
storage, after a restart warm only from that storage, and ``transformers``' continuous
batching.  The device pool is sized so the workload's working set (the sum over clients of
their final history's pages) is about 3x the pool and fits in the host pool: the regime
hierarchical caching exists for.  Engine arms must agree token for token (greedy);
``transformers`` differences are counted, not failed (its kernels may round differently).

With ``--url`` the same workload goes to an OpenAI-compatible server instead
(:mod:`aiocache_kv.bench.serve_http`).
"""

from __future__ import annotations

import importlib
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from aiocache_kv.bench.engine import SPECS, EngineBenchOptions, _differing, make_workload
from aiocache_kv.bench.engine_sides import SideRun, Turn, Workload
from aiocache_kv.bench.report import JSON, Progress, heading, percentile, ratio, table
from aiocache_kv.bench.serve_arms import (
    ARMS,
    ENGINE_ARMS,
    HOST_ARMS,
    STORAGE_ARMS,
    Pacing,
    serve_engine_arm,
    serve_transformers_arm,
    tiers,
)
from aiocache_kv.errors import InvalidInputError
from aiocache_kv.loop import run as run_loop
from aiocache_kv.models import GPT2Spec, build_gpt2, cache_config_for, reference_generate

__all__ = ["ARMS", "PLOT_HINT", "ServeBenchOptions", "pool_sizes", "run"]

#: what ``--plot`` says without matplotlib
PLOT_HINT = "--plot needs matplotlib: pip install -e .[plot]"
#: working set / device pool
DEVICE_FRACTION = 3.0
#: host pool / working set
HOST_HEADROOM = 1.25
TIERS = ("device", "host", "storage")


@dataclass(frozen=True)
class ServeBenchOptions:
    """Options of ``aiocache-kv bench serve``."""

    clients: int = 12
    rounds: int = 8
    system_tokens: int = 2048
    user_tokens: int = 256
    output_len: int = 16
    max_in_flight: int = 4
    request_rate: float = math.inf
    round_barrier: bool = False
    arms: tuple[str, ...] = tuple(ARMS)
    page_size: int = 16
    max_batch_tokens: int = 256
    max_running: int = 16
    device_pages: int | None = None  #: None: working set / 3
    host_pages: int | None = None  #: None: working set x 1.25
    size: str = "small"  #: GPT-2 size: "small" (the demo's) or "tiny" (tests)
    seed: int = 0
    plot: str | None = None
    storage_dir: str | None = None  #: where the storage arms' temp dir goes (default TMPDIR)
    url: str | None = None  #: drive this OpenAI-compatible server instead of the arms
    model: str | None = None  #: ``model`` field of HTTP requests (default: /v1/models' first)
    vocab: int | None = None  #: token ids drawn below this (default: the model spec's vocab)
    progress: bool = True


def _check(opts: ServeBenchOptions) -> None:
    bad = [a for a in opts.arms if a not in ARMS]
    counts = (opts.clients, opts.rounds, opts.system_tokens, opts.user_tokens, opts.output_len)
    if bad or not opts.arms or opts.size not in SPECS:
        raise InvalidInputError(f"arms must be among {tuple(ARMS)}, size one of {tuple(SPECS)}")
    if min(*counts, opts.max_in_flight, opts.page_size) < 1 or not opts.request_rate > 0:
        raise InvalidInputError(f"workload sizes and the request rate must be positive: {opts}")
    if "storage-restart" in opts.arms and "device+host+storage" not in opts.arms:
        raise InvalidInputError("the storage-restart arm replays device+host+storage's storage")


def workload(opts: ServeBenchOptions, vocab: int) -> Workload:
    """The seeded multi-turn workload (``bench engine``'s generator, fixed message length)."""
    eng = EngineBenchOptions(
        conversations=opts.clients, turns=opts.rounds, system_tokens=opts.system_tokens,
        user_tokens=(opts.user_tokens, opts.user_tokens), reply_tokens=opts.output_len,
        seed=opts.seed,
    )  # fmt: skip
    return make_workload(eng, vocab)


def pool_sizes(wl: Workload, opts: ServeBenchOptions) -> JSON:
    """Working set (pages), device pool (about a third of it, but room for the requests in
    flight) and host pool (all of it with headroom)."""
    page = opts.page_size
    finals = [
        len(wl.system) + sum(len(u) for u in turns) + len(turns) * wl.reply_tokens
        for turns in wl.users
    ]
    working = sum(-(-n // page) for n in finals)
    longest = -(-max(finals) // page) + 1
    device = opts.device_pages or max(math.ceil(working / DEVICE_FRACTION), 2 * longest)
    host = opts.host_pages or math.ceil(working * HOST_HEADROOM) + 16
    return {
        "page_size": page,
        "working_set_pages": working,
        "device_pages": device,
        "host_pages": host,
        "working_set_over_device": round(working / device, 2),
        "longest_request_tokens": max(finals),
    }


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def _rates(turns: Sequence[Turn]) -> JSON:
    prompt = sum(t.prompt_len for t in turns)
    split = [sum(tiers(t.served)[i] for t in turns) for i in range(3)]
    out = {tier: round(ratio(n, prompt), 4) for tier, n in zip(TIERS, split, strict=True)}
    out["total"] = round(ratio(sum(split), prompt), 4)
    return out


def summarize(run: SideRun, rounds: int) -> JSON:
    """One arm's numbers: times in ms, throughput in tokens per second, hit rates per tier
    (reused prompt tokens / prompt tokens) overall and per round."""
    if run.error is not None and not run.turns:
        return {"error": run.error}
    served = [t.served for t in run.turns]
    ttft = [s.ttft for s in served]
    itl = [x for s in served for x in s.itl]
    prompt = sum(t.prompt_len for t in run.turns)
    out_tokens = sum(len(s.tokens) for s in served)
    return {
        "error": run.error,
        "requests": len(served),
        "wall_s": round(run.wall, 4),
        "input_tokens": prompt,
        "output_tokens": out_tokens,
        "input_tok_s": round(ratio(prompt, run.wall), 2),
        "output_tok_s": round(ratio(out_tokens, run.wall), 2),
        "ttft_ms": {f"p{q}": _ms(percentile(ttft, q)) for q in (50, 90, 99)},
        "itl_ms": {
            "mean": _ms(sum(itl) / len(itl) if itl else 0.0),
            **{f"p{q}": _ms(percentile(itl, q)) for q in (50, 90, 99)},
        },
        "latency_ms_p50": _ms(percentile([s.latency for s in served], 50)),
        "prompt_tokens_computed": sum(s.computed for s in served),
        "prompt_tokens_reused": sum(s.reused for s in served),
        "hit_rate": _rates(run.turns),
        "hit_rate_per_round": [
            _rates([t for t in run.turns if t.turn == r]) for r in range(rounds)
        ],
        "ttft_s_sorted": sorted(round(x, 6) for x in ttft),
        "extra": dict(run.extra),
    }


async def _arms(
    model: Any, spec: GPT2Spec, wl: Workload, opts: ServeBenchOptions, sizes: JSON, root: str
) -> dict[str, SideRun]:
    from aiocache_kv.storage import FileStorage

    pacing = Pacing(opts.max_in_flight, opts.request_rate, opts.round_barrier, opts.seed)
    bar = Progress(wl.requests * len(opts.arms)) if opts.progress else None
    runs: dict[str, SideRun] = {}
    for arm in opts.arms:

        def done(t: Turn, arm: str = arm) -> None:
            if bar is not None:
                bar.advance(f"{arm}: client {t.conversation} round {t.turn + 1}")

        t0 = time.perf_counter()
        try:
            if arm == "transformers":
                run = await serve_transformers_arm(
                    model, wl, pacing, page_size=opts.page_size,
                    num_blocks=sizes["device_pages"], max_batch_tokens=opts.max_batch_tokens,
                    max_requests=opts.max_running, attn_implementation=spec.attn_implementation,
                    on_done=done,
                )  # fmt: skip
            else:
                cfg = cache_config_for(
                    model,
                    page_size=opts.page_size,
                    device_pages=sizes["device_pages"],
                    host_pages=sizes["host_pages"] if arm in HOST_ARMS else 0,
                    host_memory_reserve_bytes=0,
                    namespace=f"{spec.name}-bench-serve",
                    enable_kv_events=False,
                    storage=FileStorage(root) if arm in STORAGE_ARMS else None,
                    prefetch_threshold_tokens=0,  # chat turns are short: prefetch what is there
                )
                run = await serve_engine_arm(
                    arm, model, wl, cfg, pacing, max_batch_tokens=opts.max_batch_tokens,
                    max_running=opts.max_running, on_done=done,
                )  # fmt: skip
        except Exception as exc:  # an arm that breaks is reported, the others still run
            run = SideRun(error=f"{type(exc).__name__}: {exc}")
        runs[arm] = run
        if bar is not None:
            bar.clear()
        print(f"  {arm}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        if bar is not None:
            bar.draw()
    if bar is not None:
        bar.clear()
    return runs


def _identity(runs: dict[str, SideRun], requests: int) -> JSON:
    """Every arm's differing replies against the first engine arm that served them all."""
    ref = next((a for a in ENGINE_ARMS if a in runs and len(runs[a].turns) == requests), None)
    out: JSON = {"reference": ref}
    for arm, run in runs.items():
        if ref is None or arm == ref:
            continue
        differing = _differing(run.turns, runs[ref].turns)
        out[arm] = {"differing": differing, "must_match": arm in ENGINE_ARMS}
    return out


def _pct(x: float) -> str:
    return f"{x * 100:.0f}%"


def _print(res: JSON) -> None:
    rows: list[Sequence[object]] = []
    same = res["identical_detail"]
    for arm, s in res["arms"].items():
        if "ttft_ms" not in s:
            rows.append([arm, *["-"] * 12, f"ERROR: {s.get('error')}"])
            continue
        if arm in same:
            n = same[arm]["differing"]
            check = ("yes" if n == 0 else f"NO ({n})") if same[arm]["must_match"] else f"{n} differ"
        else:
            check = "ref" if arm == same.get("reference") else "-"
        h = s["hit_rate"]
        rows.append([
            arm, f"{s['wall_s']:.2f}", f"{s['input_tok_s']:.0f}", f"{s['output_tok_s']:.1f}",
            f"{s['ttft_ms']['p50']:.1f}", f"{s['ttft_ms']['p90']:.1f}",
            f"{s['ttft_ms']['p99']:.1f}", f"{s['itl_ms']['mean']:.1f}",
            _pct(h["device"]), _pct(h["host"]), _pct(h["storage"]),
            s["prompt_tokens_computed"], s["prompt_tokens_reused"],
            check + ("; error" if s.get("error") else ""),
        ])  # fmt: skip
    table(
        ["arm", "wall s", "in tok/s", "out tok/s", "TTFT p50 ms", "p90", "p99", "ITL ms",
         "hit dev", "host", "stor", "computed", "reused", "same"],
        rows,
    )  # fmt: skip
    arms = [a for a, s in res["arms"].items() if "hit_rate_per_round" in s]
    if not arms:
        return
    rounds = len(res["arms"][arms[0]]["hit_rate_per_round"])
    print("\nhit rate per round (total; device/host/storage):")
    prow: list[Sequence[object]] = []
    for arm in arms:
        cells = [
            f"{_pct(r['total'])} ({_pct(r['device'])}/{_pct(r['host'])}/{_pct(r['storage'])})"
            for r in res["arms"][arm]["hit_rate_per_round"]
        ]
        prow.append([arm, *cells])
    table(["arm", *[f"round {r + 1}" for r in range(rounds)]], prow)


def _plot(res: JSON, path: str) -> str | None:
    try:
        matplotlib: Any = importlib.import_module("matplotlib")
        matplotlib.use("Agg")
        plt: Any = importlib.import_module("matplotlib.pyplot")
    except ImportError:
        return f"{PLOT_HINT} (no plot written)"
    arms = {a: s for a, s in res["arms"].items() if "ttft_ms" in s}
    fig, (cdf, thr, hits) = plt.subplots(1, 3, figsize=(16, 4.5))
    for arm, s in arms.items():
        xs = [x * 1e3 for x in s["ttft_s_sorted"]]
        cdf.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=arm)
        per = s["hit_rate_per_round"]
        hits.plot(range(1, len(per) + 1), [r["total"] * 100 for r in per], "o-", label=arm)
    cdf.set_xscale("log")
    cdf.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT CDF")
    thr.bar(list(arms), [s["output_tok_s"] for s in arms.values()])
    thr.set(ylabel="output tokens/s", title="throughput")
    thr.tick_params(axis="x", rotation=30)
    hits.set(xlabel="round", ylabel="prompt tokens reused (%)", title="hit rate per round")
    for ax in (cdf, hits):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def run(opts: ServeBenchOptions) -> JSON:
    """Run the benchmark, print its tables and return the JSON-able results."""
    _check(opts)
    heading("bench serve: multi-turn chat, per arm (SGLang bench_multiturn shape)")
    spec = SPECS[opts.size]["gpt2"]
    assert isinstance(spec, GPT2Spec)
    wl = workload(opts, opts.vocab or spec.vocab_size)
    sizes = pool_sizes(wl, opts)
    rate = "all at once" if math.isinf(opts.request_rate) else f"{opts.request_rate:g}/s Poisson"
    print(
        f"workload: {opts.clients} clients x {opts.rounds} rounds, a shared "
        f"{opts.system_tokens}-token system prompt, {opts.user_tokens}-token user messages, "
        f"{opts.output_len}-token greedy replies; first turns {rate}; at most "
        f"{opts.max_in_flight} requests in flight; round barrier "
        f"{'on' if opts.round_barrier else 'off'}; seed {opts.seed}. TTFT = submission -> "
        "first token (queueing included)."
    )
    t0 = time.perf_counter()
    pacing_json = {
        "max_in_flight": opts.max_in_flight,
        "request_rate": None if math.isinf(opts.request_rate) else opts.request_rate,
        "round_barrier": opts.round_barrier,
    }
    result: JSON = {
        "workload": {
            "clients": opts.clients, "rounds": opts.rounds, "system_tokens": opts.system_tokens,
            "user_tokens": opts.user_tokens, "output_len": opts.output_len,
            "requests": wl.requests, "seed": opts.seed, **pacing_json,
        },
        "engine_options": {"max_batch_tokens": opts.max_batch_tokens,
                           "max_running": opts.max_running},
        "size": opts.size,
    }  # fmt: skip
    if opts.url is not None:
        from aiocache_kv.bench.serve_http import serve_url

        print(
            f"server: {opts.url} (OpenAI /v1/completions, streamed). The API reports one "
            "cached_tokens count: it shows as device hits unless the server splits it by tier."
        )
        pacing = Pacing(opts.max_in_flight, opts.request_rate, opts.round_barrier, opts.seed)
        try:
            runs = {"server": run_loop(serve_url(opts.url, wl, pacing, model=opts.model))}
        except Exception as exc:
            runs = {"server": SideRun(error=f"{type(exc).__name__}: {exc}")}
        result["url"] = opts.url
    else:
        print(
            f"model: GPT-2 {spec.n_layer} layers x {spec.n_head} heads x {spec.head_dim} dims, "
            f"random weights. Pools: working set {sizes['working_set_pages']} pages of "
            f"{opts.page_size} tokens (sum of clients' final histories) = "
            f"{sizes['working_set_over_device']}x the device pool of {sizes['device_pages']} "
            f"pages; host pool {sizes['host_pages']} pages. Arms: "
            + "; ".join(f"{a}: {ARMS[a]}" for a in opts.arms)
        )
        # random weights: the position table is sized to the workload (GPT-2's 1,024 is a
        # trained model's limit, not this one's)
        spec = replace(spec, n_positions=max(spec.n_positions, sizes["longest_request_tokens"]))
        model = build_gpt2(spec)
        reference_generate(model, wl.warmup, 2)  # the first forward passes of a process are slow
        root = tempfile.mkdtemp(prefix="aiocache-kv-bench-serve-", dir=opts.storage_dir)
        try:
            runs = run_loop(_arms(model, spec, wl, opts, sizes, root))
        finally:
            shutil.rmtree(root, ignore_errors=True)
        result["cache"] = sizes
        result["load_average"] = [round(x, 2) for x in os.getloadavg()]
    result["arms"] = {arm: summarize(r, opts.rounds) for arm, r in runs.items()}
    result["identical_detail"] = _identity(runs, wl.requests)
    mismatched = [
        f"{arm} ({d['differing']} replies)"
        for arm, d in result["identical_detail"].items()
        if isinstance(d, dict) and d["must_match"] and d["differing"]
    ]
    result["identical"] = not mismatched
    result["errors"] = [f"{a}: {s['error']}" for a, s in result["arms"].items() if s.get("error")]
    #: an engine arm (or the server) failed: transformers' failures are reported, not fatal
    result["fatal"] = any(not e.startswith("transformers:") for e in result["errors"])
    _print(result)
    if mismatched:
        print(
            "\nFAILED: engine arms' greedy replies differ from "
            f"{result['identical_detail']['reference']}: {', '.join(mismatched)}"
        )
    if opts.plot:
        problem = _plot(result, opts.plot)
        print(f"bench serve: {problem}" if problem else f"plot written to {opts.plot}")
    print(f"(bench serve took {time.perf_counter() - t0:.1f} s)")
    return result
