"""``aiocache-kv bench``: run the chosen suites, print their tables, write the JSON report.

Bad arguments are found before any suite runs (a ``--json`` path that cannot be written, a
``--page-kib`` the transfer suite cannot use, an e2e prefix longer than the model) and exit
with status 2 and one line on stderr, as argparse's own errors do; so does an option a suite
refuses when it starts (``InvalidInputError`` / ``ConfigError``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from aiocache_kv.bench import SUITES
from aiocache_kv.errors import ConfigError, InvalidInputError
from aiocache_kv.loop import run as run_loop

__all__ = ["bad_arguments", "flat", "page_kib", "run_bench"]


def flat(values: Sequence[Sequence[int]] | None, default: Sequence[int]) -> tuple[int, ...]:
    if not values:
        return tuple(default)
    return tuple(v for group in values for v in group)


#: ``--page-kib`` when not given, per suite
TRANSFER_PAGE_KIB = (64, 256, 1024)
STORAGE_PAGE_KIB = (64, 256, 1024, 4096)
STORAGE_BATCHES = (16, 128)


def page_kib(args: argparse.Namespace, suite: str) -> tuple[int, ...]:
    """The page sizes (KiB) ``suite`` uses: ``--page-kib`` or the suite's default."""
    default = STORAGE_PAGE_KIB if suite == "storage" else TRANSFER_PAGE_KIB
    return flat(args.page_kib, default)


def run_bench(args: argparse.Namespace) -> int:
    """``aiocache-kv bench [SUITE|all]``; returns the exit code (2: bad arguments)."""
    problem = bad_arguments(args)
    if problem is None:
        try:
            return _run(args)
        except (InvalidInputError, ConfigError) as exc:  # an option a suite refused
            problem = str(exc)
    print(f"aiocache-kv bench: {problem}", file=sys.stderr)
    return 2


def bad_arguments(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments, found before any suite runs (``None``: nothing)."""
    suites = SUITES if args.suite == "all" else (args.suite,)
    if args.json:
        path = Path(args.json)
        if path.is_dir():
            return f"--json {path} is a directory"
        parent = path.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return f"--json {path}: cannot create {parent}: {exc.strerror}"
        if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
            return f"--json {path} cannot be written"
    if "transfer" in suites:
        from aiocache_kv.bench.transfer import TOKEN_BYTES

        step = TOKEN_BYTES // 1024
        odd = [k for k in page_kib(args, "transfer") if k % step]
        if odd:
            return f"--page-kib {odd[0]}: the transfer suite needs multiples of {step} KiB"
    if "e2e" in suites:
        from aiocache_kv.bench import e2e

        lens = flat(args.prefix_lens, e2e.E2EBenchOptions.prefix_lens)
        need = max(lens) + args.suffix + 1
        if need > e2e.SPEC.n_positions:
            return (
                f"--prefix-lens {max(lens)} + --suffix {args.suffix} exceeds the model's "
                f"{e2e.SPEC.n_positions} positions"
            )
    return None


def _serve_plot(args: argparse.Namespace) -> str | None:
    """``--plot`` for the serve suite (beside e2e's when ``all`` runs both)."""
    if not args.plot or args.suite == "serve":
        return args.plot  # type: ignore[no-any-return]
    root, ext = os.path.splitext(args.plot)
    return f"{root}-serve{ext or '.png'}"


def _run(args: argparse.Namespace) -> int:
    from aiocache_kv.bench import report

    suites = SUITES if args.suite == "all" else (args.suite,)
    plots = [s for s in suites if s in ("e2e", "serve")]
    if args.plot and plots and importlib.util.find_spec("matplotlib") is None:
        from aiocache_kv.bench.e2e import PLOT_HINT

        print(f"bench {plots[0]}: {PLOT_HINT}", file=sys.stderr)  # before a long run, not after
        return 2
    results: dict[str, report.JSON] = {}
    identity_failed = False
    print(
        "note: timings on a shared 2-core machine are noisy; numbers are medians of repeats "
        "and ratios use baselines measured in this same run."
    )
    for suite in suites:
        if suite == "tree" and args.peer_sglang:
            from aiocache_kv.bench import peer_sglang

            opts = peer_sglang.PeerBenchOptions(
                wheels=tuple(Path(d) for d in args.peer_sglang),
                page_sizes=tuple(args.page_sizes),
                sequences=args.sequences,
                repeats=args.tree_repeats,
                seed=args.seed,
            )
            try:
                results["tree_peer_sglang"] = peer_sglang.run(opts)
            except FileNotFoundError as e:
                sys.exit(f"bench tree: {e}")
        elif suite == "tree":
            from aiocache_kv.bench import tree

            results["tree"] = tree.run(
                tree.TreeBenchOptions(
                    page_sizes=tuple(args.page_sizes),
                    sequences=args.sequences,
                    repeats=args.tree_repeats,
                    seed=args.seed,
                    events=args.events,
                )
            )
        elif suite == "transfer":
            from aiocache_kv.bench import transfer

            results["transfer"] = transfer.run(
                transfer.TransferBenchOptions(
                    page_kib=page_kib(args, "transfer"),
                    mib=args.mib,
                    lag_mib=args.lag_mib,
                    repeats=args.transfer_repeats,
                    seed=args.seed,
                )
            )
        elif suite == "cuda":
            from aiocache_kv.bench import cuda_copies as cu

            kib = flat(args.page_kib, cu.PAGE_KIB)
            cuda_opts = cu.CudaBenchOptions(kib, args.mib, args.transfer_repeats, args.seed)
            if (res := cu.run_if_cuda(cuda_opts, run_loop)) is not None:
                results["cuda"] = res
        elif suite == "lag":
            from aiocache_kv.bench import lag

            results["lag"] = lag.run(
                lag.LagBenchOptions(
                    lag_mib=args.lag_mib,
                    max_running=args.max_running,
                    max_batch_tokens=args.max_batch_tokens,
                    worker_idle=args.worker_idle,
                    stdlib_loop=args.stdlib_loop,
                    seed=args.seed,
                )
            )
        elif suite == "storage":
            from aiocache_kv.bench import storage

            if (args.master is None) != (args.metadata is None):
                print("bench storage: --master and --metadata go together", file=sys.stderr)
                return 2
            results["storage"] = storage.run(
                storage.StorageBenchOptions(
                    backends=storage.BACKENDS if args.backend == "all" else (args.backend,),
                    page_kib=page_kib(args, "storage"),
                    batches=flat(args.batch, STORAGE_BATCHES),
                    mib=args.storage_mib,
                    repeats=args.storage_repeats,
                    master=args.master,
                    metadata=args.metadata,
                    storage_dir=args.storage_dir,
                    explicit_backend=args.backend != "all",
                )
            )
        elif suite == "embedding":
            from aiocache_kv.bench import embedding

            if (args.master is None) != (args.metadata is None):
                print("bench embedding: --master and --metadata go together", file=sys.stderr)
                return 2
            results["embedding"] = embedding.run(
                embedding.EmbeddingBenchOptions(
                    mib=args.emb_mib,
                    repeats=args.emb_repeats,
                    requests=args.emb_requests,
                    seed=args.seed,
                    master=args.master,
                    metadata=args.metadata,
                    explicit=args.suite == "embedding",
                )
            )
        elif suite == "e2e":
            from aiocache_kv.bench import e2e

            results["e2e"] = e2e.run(
                e2e.E2EBenchOptions(
                    prefix_lens=flat(args.prefix_lens, e2e.E2EBenchOptions.prefix_lens),
                    suffix=args.suffix,
                    repeats=args.e2e_repeats,
                    seed=args.seed,
                    plot=args.plot,
                    storage_dir=args.storage_dir,
                )
            )
            if not results["e2e"]["identical"]:
                identity_failed = True
        elif suite == "engine":
            from aiocache_kv.bench import engine

            results["engine"] = engine.run(
                engine.EngineBenchOptions(
                    models=tuple(args.engine_models),
                    sides=tuple(args.engine_sides),
                    conversations=args.conversations,
                    turns=args.turns,
                    system_tokens=args.system_tokens,
                    reply_tokens=args.reply_tokens,
                    max_batch_tokens=args.max_batch_tokens,
                    max_running=args.max_running,
                    size=args.engine_size,
                    repeats=args.engine_repeats,
                    seed=args.seed,
                )
            )
            if not results["engine"]["identical"]:
                identity_failed = True  # engine and sequential replies differ
        elif suite == "serve":
            from aiocache_kv.bench import serve

            results["serve"] = serve.run(
                serve.ServeBenchOptions(
                    clients=args.clients,
                    rounds=args.rounds,
                    system_tokens=args.system_len,
                    user_tokens=args.user_len,
                    output_len=args.output_len,
                    max_in_flight=args.max_in_flight,
                    request_rate=args.request_rate,
                    round_barrier=args.round_barrier,
                    arms=tuple(args.arms),
                    max_batch_tokens=args.max_batch_tokens,
                    max_running=args.max_running,
                    device_pages=args.device_pages,
                    size=args.serve_size,
                    seed=args.seed,
                    plot=_serve_plot(args),
                    storage_dir=args.storage_dir,
                    url=args.url,
                    model=args.served_model,
                    vocab=args.vocab,
                )
            )
            if not results["serve"]["identical"] or results["serve"]["fatal"]:
                identity_failed = True  # engine arms differ, or an engine arm (or --url) failed
        elif suite == "fairness":
            from aiocache_kv.bench import fairness

            results["fairness"] = fairness.run(fairness.FairnessOptions(seed=args.seed))
    errors = [results.get(s, {}).get("errors") for s in ("storage", "embedding")]
    code = 1 if any(errors) or identity_failed else 0
    if args.json:
        report.write_json(report.make_report(results), args.json)
        print(f"\nJSON report written to {args.json}")
    return code
