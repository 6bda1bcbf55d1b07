"""The ``aiocache-kv`` command line: ``demo`` and ``bench [tree|transfer]``.

Output meant for people (walkthrough, benchmark tables) goes to stdout; logs go to stderr
through structlog, as concise console lines.  ``main`` returns the exit code.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence

import structlog

from aiocache_kv.bench import SUITES

log = structlog.get_logger(__name__)

LOG_LEVELS = ("debug", "info", "warning", "error")


def configure_logging(level: str) -> None:
    """Concise structlog console logs on stderr, filtered at ``level``."""
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%H:%M:%S"),
            structlog.processors.StackInfoRenderer(),
            structlog.dev.ConsoleRenderer(
                colors=sys.stderr.isatty(), exception_formatter=structlog.dev.plain_traceback
            ),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
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
        help="in-process walkthrough on CPU: insert, match, evict to host, load back, verify",
        description="A small walkthrough of HiCache on CPU (see aiocache_kv/demo.py).",
    )
    demo.add_argument("--device-pages", type=_positive, default=64, help="L1 pages (default 64)")
    demo.add_argument("--host-pages", type=_positive, default=256, help="L2 pages (default 256)")
    demo.add_argument("--page-size", type=_positive, default=4, help="tokens per page (default 4)")
    demo.add_argument("--seed", type=int, default=0, help="prompt seed (default 0)")
    demo.set_defaults(func=cmd_demo, default_log_level="info")

    bench = sub.add_parser(
        "bench",
        help="benchmarks: radix tree and device<->host transfer (all suites by default)",
        description="Run benchmark suites; numbers are printed next to their targets and as "
        "ratios against baselines measured in the same run. Timings on a shared machine are "
        "noisy: compare medians, not single runs.",
    )
    bench.add_argument(
        "suite", nargs="?", choices=[*SUITES, "all"], default="all", help="suite (default: all)"
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
    xfer = bench.add_argument_group("transfer suite")
    xfer.add_argument(
        "--page-kib",
        type=_positive,
        nargs="+",
        default=[64, 256, 1024],
        metavar="KIB",
        help="page sizes in KiB, multiples of 16 (default: 64 256 1024)",
    )
    xfer.add_argument(
        "--mib", type=_positive, default=256, help="MiB moved per measurement (default 256)"
    )
    xfer.add_argument(
        "--lag-mib",
        type=_positive,
        default=1024,
        help="MiB written through while measuring event-loop lag (default 1024)",
    )
    xfer.add_argument(
        "--transfer-repeats", type=_positive, default=5, help="repeats, median reported (default 5)"
    )
    bench.set_defaults(func=cmd_bench, default_log_level="warning")
    return parser


def cmd_demo(args: argparse.Namespace) -> int:
    """``aiocache-kv demo``."""
    from aiocache_kv.demo import run_demo

    return asyncio.run(run_demo(args))


def cmd_bench(args: argparse.Namespace) -> int:
    """``aiocache-kv bench [tree|transfer|all]``."""
    from aiocache_kv.bench import report

    suites = SUITES if args.suite == "all" else (args.suite,)
    results: dict[str, report.JSON] = {}
    print(
        "note: timings on a shared 2-core machine are noisy; numbers are medians of repeats "
        "and ratios use baselines measured in this same run."
    )
    for suite in suites:
        if suite == "tree":
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
                    page_kib=tuple(args.page_kib),
                    mib=args.mib,
                    lag_mib=args.lag_mib,
                    repeats=args.transfer_repeats,
                    seed=args.seed,
                )
            )
    if args.json:
        report.write_json(report.make_report(results), args.json)
        print(f"\nJSON report written to {args.json}")
    return 0


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
