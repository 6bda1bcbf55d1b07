"""The ``aiocache-kv`` command line: ``demo`` and
``bench [tree|transfer|lag|storage|embedding|e2e|engine|serve]``.

Output meant for people (walkthrough, benchmark tables) goes to stdout; logs go to stderr
as concise lines (:func:`aiocache_kv.logs.configure_console`).  ``main`` returns the exit code.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from aiocache_kv.bench import ENGINE_MODELS, ENGINE_SIDES, SERVE_ARMS, SUITE_HELP, SUITES
from aiocache_kv.demo_defaults import DEFAULTS as D
from aiocache_kv.logs import configure_console, get_logger
from aiocache_kv.loop import run as run_loop

log = get_logger(__name__)

LOG_LEVELS = ("debug", "info", "warning", "error")


def configure_logging(level: str) -> None:
    """Concise log lines on stderr, filtered at ``level`` (the library is silent otherwise)."""
    configure_console(level)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _int_list(text: str) -> list[int]:
    """``"64,256"`` (or ``"64"``) as positive ints; space-separated values also work (nargs)."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _rate(text: str) -> float:
    """A positive request rate per second, or ``inf``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or inf, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive (or inf), got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``aiocache-kv``."""
    parser = argparse.ArgumentParser(
        prog="aiocache-kv",
        description="asyncio-native hierarchical KV-cache runtime for LLM serving",
    )
    parser.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default=None,
        help="stderr log level (default: info for demo, warning for bench)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = sub.add_parser(
        "demo",
        help="multi-turn chat on a small random-weight GPT-2 whose KV lives in the cache: "
        "TTFT with/without the cache, hits per tier, identity check",
        description="Multi-turn chat on a small GPT-2 (random weights, nothing downloaded) "
        "with a small device pool, host pool and storage tier, plus a restarted node; each "
        "round's turns are served at once, batched through one aiocache_kv.serving.Engine "
        "per node, and every turn is also generated without the cache and must be "
        "token-identical (see aiocache_kv/demo.py).",
    )
    for name, what in (
        ("device_pages", "L1 pages"),
        ("host_pages", "L2 pages"),
        ("page_size", "tokens per page"),
        ("seed", "workload seed"),
        ("conversations", "chats in parallel"),
        ("turns", "turns per chat"),
        ("new_tokens", "tokens per reply"),
        ("max_batch_tokens", "tokens the engine runs per forward pass at most"),
        ("system_tokens", "shared system prompt length"),
    ):
        demo.add_argument(
            "--" + name.replace("_", "-"),
            type=int if name == "seed" else _positive,
            default=D[name],
            help=what + " (default %(default)s)",
        )
    demo.add_argument(
        "--storage",
        choices=("file", "none", "mooncake"),
        default="file",
        help="L3 storage: file (FileStorage in --storage-dir; default), none, or mooncake "
        "(a loopback master is started unless --master is given)",
    )
    demo.add_argument(
        "--storage-dir",
        metavar="DIR",
        help="FileStorage directory (default: a temporary directory, removed afterwards)",
    )
    demo.add_argument("--master", metavar="ADDR", help="Mooncake master host:port")
    demo.add_argument("--metadata", metavar="URL", help="Mooncake metadata server URL")
    demo.set_defaults(func=cmd_demo, default_log_level="info")

    bench = sub.add_parser(
        "bench",
        help=f"benchmarks: {', '.join(SUITES)} (all by default)",
        description="Run benchmark suites; numbers are printed next to their targets and as "
        "ratios against baselines measured in the same run. Timings on a shared machine are "
        "noisy: compare medians, not single runs. Suites: "
        + "; ".join(f"{name}: {text}" for name, text in SUITE_HELP.items())
        + ".",
    )
    bench.add_argument(
        "suite",
        nargs="?",
        choices=[*SUITES, "all"],
        default="all",
        help="the suite to run (default: all, in this order)",
    )
    bench.add_argument("--json", metavar="PATH", help="write a JSON report to PATH")
    tree = bench.add_argument_group("tree suite")
    tree.add_argument(
        "--sizes",
        "--page-sizes",
        dest="page_sizes",
        type=_positive,
        nargs="+",
        default=[1, 16],
        metavar="N",
        help="page sizes in tokens (default: 1 16)",
    )
    tree.add_argument(
        "--sequences", type=_positive, default=2000, help="sequences to insert (default 2000)"
    )
    tree.add_argument(
        "--tree-repeats", type=_positive, default=5, help="repeats, median reported (default 5)"
    )
    tree.add_argument("--events", action="store_true", help="HiCache level: KV events on")
    tree.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    tree.add_argument(
        "--peer-sglang",
        nargs="+",
        metavar="DIR",
        help="instead: the serving step beside SGLang's radix caches, each DIR an unzipped "
        "sglang wheel (0.5.15: RadixCache; 0.5.23: UnifiedRadixCache, Python and Rust core)",
    )
    xfer = bench.add_argument_group("transfer and storage suites")
    xfer.add_argument(
        "--page-kib",
        type=_int_list,
        nargs="+",
        default=None,
        metavar="KIB",
        help="page sizes in KiB, multiples of 16, e.g. 64,256 or 64 256 (default: transfer "
        "64 256 1024; storage 64 256 1024 4096)",
    )
    xfer.add_argument(
        "--mib", type=_positive, default=256, help="MiB moved per measurement (default 256)"
    )
    xfer.add_argument(
        "--lag-mib",
        type=_positive,
        default=1024,
        help="MiB written through while measuring event-loop lag, transfer and lag suites "
        "(default 1024)",
    )
    xfer.add_argument(
        "--worker-idle",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="lag suite: the copy worker's copies on idle helpers (CacheConfig.worker_idle, "
        "the default); --no-worker-idle: the worker copies itself at nice +10",
    )
    xfer.add_argument(
        "--stdlib-loop",
        action="store_true",
        help="lag suite: asyncio's default loop, whose epoll waits are rounded up to whole "
        "milliseconds, instead of aiocache_kv.loop's precise one",
    )
    xfer.add_argument(
        "--transfer-repeats", type=_positive, default=5, help="repeats, median reported (default 5)"
    )
    stor = bench.add_argument_group("storage suite")
    stor.add_argument(
        "--backend",
        choices=("file", "mooncake", "all"),
        default="all",
        help="storage backend(s) (default: all; mooncake is skipped when not installed, "
        "unless named explicitly)",
    )
    stor.add_argument(
        "--batch",
        type=_int_list,
        nargs="+",
        default=None,
        metavar="N",
        help="pages per storage call, e.g. 16,128 (default: 16 128)",
    )
    stor.add_argument(
        "--storage-mib",
        type=_positive,
        default=128,
        help="MiB per measurement, at least one batch (default 128)",
    )
    stor.add_argument(
        "--storage-repeats", type=_positive, default=3, help="repeats, median reported (default 3)"
    )
    stor.add_argument(
        "--master",
        metavar="ADDR",
        help="Mooncake master host:port (default: start one on 127.0.0.1)",
    )
    stor.add_argument("--metadata", metavar="URL", help="Mooncake metadata server URL")
    stor.add_argument(
        "--storage-dir",
        metavar="DIR",
        help="where the file backend's temp dirs go (default: TMPDIR)",
    )
    emb = bench.add_argument_group("embedding suite (also uses --master/--metadata, --seed)")
    emb.add_argument("--emb-mib", type=_positive, default=64, help="MiB per measurement (64)")
    emb.add_argument("--emb-repeats", type=_positive, default=3, help="repeats (default 3)")
    emb.add_argument("--emb-requests", type=_positive, default=60, help="two-node requests (60)")
    e2e = bench.add_argument_group("e2e suite (also uses --seed, --storage-dir)")
    e2e.add_argument(
        "--prefix-lens",
        type=_int_list,
        nargs="+",
        default=None,
        metavar="N",
        help="cached prefix lengths in tokens (default: 128,512,1024,2000)",
    )
    e2e.add_argument(
        "--suffix", type=_positive, default=16, help="uncached tokens per prompt (default 16)"
    )
    e2e.add_argument(
        "--e2e-repeats", type=_positive, default=3, help="repeats, median reported (default 3)"
    )
    e2e.add_argument("--plot", metavar="PNG", help="write a TTFT plot (needs matplotlib)")
    eng = bench.add_argument_group("engine suite (also uses --seed)")
    eng.add_argument(
        "--engine-models",
        nargs="+",
        choices=ENGINE_MODELS,
        default=list(ENGINE_MODELS),
        metavar="MODEL",
        help="models: gpt2 and/or llama (default: both)",
    )
    eng.add_argument(
        "--engine-sides",
        nargs="+",
        choices=ENGINE_SIDES,
        default=list(ENGINE_SIDES),
        metavar="SIDE",
        help="sides: engine, sequential, transformers (default: all three)",
    )
    eng.add_argument(
        "--conversations", type=_positive, default=12, help="concurrent chats (default 12; 8-16)"
    )
    eng.add_argument("--turns", type=_positive, default=4, help="turns per chat (default 4)")
    eng.add_argument(
        "--system-tokens", type=_positive, default=160, help="shared system prompt (default 160)"
    )
    eng.add_argument(
        "--reply-tokens", type=_positive, default=16, help="greedy tokens per reply (default 16)"
    )
    eng.add_argument(
        "--max-batch-tokens",
        type=_positive,
        default=256,
        help="tokens per forward pass, engine and transformers (default 256)",
    )
    eng.add_argument(
        "--max-running",
        type=_positive,
        default=16,
        help="requests in the batch at once, engine and transformers (default 16)",
    )
    eng.add_argument(
        "--engine-repeats",
        type=_positive,
        default=1,
        help="interleaved rounds of every side; each reports its median (default 1)",
    )
    eng.add_argument(
        "--engine-size",
        choices=("small", "tiny"),
        default="small",
        help="model size: small (6 layers, the demo's GPT-2; default) or tiny (2 layers)",
    )
    _serve_arguments(bench)
    bench.set_defaults(func=cmd_bench, default_log_level="warning")
    return parser


def _serve_arguments(bench: argparse.ArgumentParser) -> None:
    srv = bench.add_argument_group(
        "serve suite (also uses --max-batch-tokens, --max-running, --seed, --plot, --storage-dir)"
    )
    srv.add_argument("--clients", type=_positive, default=12, help="clients (default 12)")
    srv.add_argument("--rounds", type=_positive, default=8, help="turns per client (default 8)")
    srv.add_argument(
        "--system-len", type=_positive, default=2048, help="shared system prompt (default 2048)"
    )
    srv.add_argument(
        "--user-len", type=_positive, default=256, help="tokens per user message (default 256)"
    )
    srv.add_argument(
        "--output-len", type=_positive, default=16, help="greedy tokens per reply (default 16)"
    )
    srv.add_argument(
        "--max-in-flight", type=_positive, default=4, help="requests outstanding (default 4)"
    )
    srv.add_argument(
        "--request-rate",
        type=_rate,
        default=float("inf"),
        help="clients' first turns per second, Poisson (default inf: all at once)",
    )
    srv.add_argument(
        "--round-barrier",
        action="store_true",
        help="no client starts round r+1 before every client finished round r",
    )
    srv.add_argument(
        "--arms",
        nargs="+",
        choices=SERVE_ARMS,
        default=list(SERVE_ARMS),
        metavar="ARM",
        help=f"arms (default: all): {', '.join(SERVE_ARMS)}",
    )
    srv.add_argument(
        "--serve-size",
        choices=("small", "tiny"),
        default="small",
        help="GPT-2 size: small (6 layers; default) or tiny (2 layers)",
    )
    srv.add_argument(
        "--device-pages", type=_positive, help="device pool (default: working set / 3)"
    )
    srv.add_argument(
        "--url", metavar="URL", help="drive this OpenAI-compatible server instead of the arms"
    )
    srv.add_argument("--served-model", metavar="NAME", help="--url: the requests' model field")
    srv.add_argument(
        "--vocab", type=_positive, help="token ids drawn below this (default: the model's)"
    )


def cmd_demo(args: argparse.Namespace) -> int:
    """``aiocache-kv demo``."""
    from aiocache_kv.demo import run_demo

    return run_loop(run_demo(args))


def cmd_bench(args: argparse.Namespace) -> int:
    """``aiocache-kv bench [SUITE|all]`` (:func:`aiocache_kv.bench.command.run_bench`)."""
    from aiocache_kv.bench.command import run_bench

    return run_bench(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``aiocache-kv``; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level or args.default_log_level)
    try:
        code: int = args.func(args)
    except KeyboardInterrupt:
        log.warning("interrupted")
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
