"""Shared printing and JSON helpers of the benchmarks.

A suite returns a plain ``dict`` (JSON-able: str, int, float, bool, lists, dicts).  The CLI
merges the suites into one report with :func:`make_report` and writes it with
:func:`write_json`; each suite prints its own table through :func:`table` as it goes, so a
long run shows progress.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

import torch

JSON = dict[str, Any]


def median(values: Sequence[float]) -> float:
    """Median of ``values`` (which must not be empty)."""
    return float(statistics.median(values))


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, nearest-rank, or 0.0 when empty."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return float(ordered[rank])


def ratio(value: float, baseline: float) -> float:
    """``value / baseline``, or 0.0 when the baseline is not positive."""
    return value / baseline if baseline > 0 else 0.0


def fmt_ms(seconds: float) -> str:
    """Seconds as milliseconds with adaptive precision."""
    ms = seconds * 1e3
    return f"{ms:.2f} ms" if ms < 10 else f"{ms:.1f} ms"


def fmt_gbs(bytes_per_second: float) -> str:
    """Bytes per second as GB/s (10^9)."""
    return f"{bytes_per_second / 1e9:.2f} GB/s"


def fmt_bytes(n: int) -> str:
    """A byte count with a binary unit."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def table(
    headers: Sequence[str],
    rows: Sequence[Sequence[object]],
    *,
    out: TextIO | None = None,
    align: str | None = None,
) -> None:
    """Print ``rows`` under ``headers`` as a plain aligned text table.

    ``align`` is one character per column, ``l`` or ``r`` (default: first column left, the
    rest right).
    """
    stream = out if out is not None else sys.stdout
    cells = [[str(c) for c in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    spec = align if align is not None else "l" + "r" * (len(headers) - 1)

    def line(row: Sequence[str]) -> str:
        parts = [
            c.ljust(w) if a == "l" else c.rjust(w)
            for c, w, a in zip(row, widths, spec, strict=True)
        ]
        return "  ".join(parts).rstrip()

    print(line(cells[0]), file=stream)
    print("  ".join("-" * w for w in widths), file=stream)
    for row in cells[1:]:
        print(line(row), file=stream)
    stream.flush()


def heading(text: str, *, out: TextIO | None = None) -> None:
    """Print a section heading."""
    stream = out if out is not None else sys.stdout
    print(f"\n== {text} ==", file=stream)
    stream.flush()


def timed(fn: Callable[[], object]) -> float:
    """Run ``fn`` once and return the elapsed ``perf_counter`` seconds."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def machine_info() -> JSON:
    """What the numbers were measured on."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }


def make_report(suites: dict[str, JSON]) -> JSON:
    """The JSON report of one ``aiocache-kv bench`` run."""
    from aiocache_kv import __version__

    return {
        "aiocache_kv": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(),
        "suites": suites,
    }


def write_json(report: JSON, path: str | os.PathLike[str]) -> None:
    """Write ``report`` to ``path`` (parents created), pretty-printed."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")
