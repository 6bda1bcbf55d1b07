"""Shared printing and JSON helpers of the benchmarks.

A suite returns a plain ``dict`` (JSON-able: str, int, float, bool, lists, dicts).  The CLI
merges the suites into one report with :func:`make_report` and writes it with
:func:`write_json`; each suite prints its own table through :func:`table` (``rich.table``:
fitted to a terminal, plain aligned text in a pipe or a file) as it goes, so a long run shows
progress.
"""

from __future__ import annotations

import io
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
from rich import box
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.progress import Progress as RichProgress
from rich.table import Table
from rich.text import Text

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


def fmt_bytes(n: int) -> str:
    """A byte count with a binary unit."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


#: the plain-text look of a table when the output is not a terminal: headers, a dashed rule,
#: rows; columns separated by spaces, no other drawing characters (greppable, diffable)
PLAIN_BOX = box.Box("    \n    \n -  \n    \n    \n    \n    \n    \n", ascii=True)


def is_terminal(stream: TextIO) -> bool:
    """``stream`` is an interactive terminal (not a pipe, a file or a ``StringIO``)."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


def console(stream: TextIO | None = None) -> Console:
    """A ``rich`` console writing to ``stream`` (default stdout).

    On a terminal: its width, colours, bold headers.  Anywhere else (a pipe, a file, a
    ``StringIO``): no escape codes and no wrapping, whatever ``FORCE_COLOR`` or ``COLUMNS``
    say, so the output stays plain text a script can parse.
    """
    stream = stream if stream is not None else sys.stdout
    tty = is_terminal(stream)
    return Console(
        file=stream,
        force_terminal=tty,
        color_system="auto" if tty else None,
        width=None if tty else 1_000_000,
        highlight=False,
        markup=False,
        emoji=False,
    )


def table(
    headers: Sequence[str],
    rows: Sequence[Sequence[object]],
    *,
    out: TextIO | None = None,
    align: str | None = None,
) -> None:
    """Print ``rows`` under ``headers`` as a table (``rich.table``).

    ``align`` is one character per column, ``l`` or ``r`` (default: first column left, the
    rest right).  On a terminal the table fits its width (long cells wrap); elsewhere it is
    plain aligned text, one line per row, no trailing spaces.
    """
    stream = out if out is not None else sys.stdout
    spec = align if align is not None else "l" + "r" * (len(headers) - 1)
    if len(spec) != len(headers):
        raise ValueError(f"align {spec!r} has {len(spec)} columns, headers {len(headers)}")
    tty = is_terminal(stream)
    grid = Table(
        box=box.SIMPLE_HEAD if tty else PLAIN_BOX,
        show_edge=False,
        pad_edge=False,
        padding=(0, 0, 0, 1),
        header_style="bold" if tty else "",
    )
    for name, a in zip(headers, spec, strict=True):
        grid.add_column(Text(str(name)), justify="left" if a == "l" else "right", no_wrap=not tty)
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"row {list(row)!r} has {len(row)} cells, headers {len(headers)}")
        grid.add_row(*(Text(str(c)) for c in row))
    if tty:
        console(stream).print(grid)
    else:  # rendered aside, then written without the cells' trailing padding
        buf = io.StringIO()
        console(buf).print(grid)
        stream.write("".join(line.rstrip() + "\n" for line in buf.getvalue().splitlines()))
    stream.flush()


def heading(text: str, *, out: TextIO | None = None) -> None:
    """Print a section heading (``== text ==`` after a blank line; bold on a terminal)."""
    stream = out if out is not None else sys.stdout
    console(stream).print(Text(f"\n== {text} ==", style="bold"))
    stream.flush()


class Progress:
    """A progress bar (``rich.progress``: steps, elapsed, ETA, the current step) on
    ``stream`` (default stderr) when it is a terminal; nothing otherwise.

    :meth:`clear` takes it off the screen (before printing a table on stdout, which may be
    the same terminal), :meth:`draw` brings it back.  While it shows, log lines written to
    ``sys.stderr`` are printed above it.
    """

    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.active = is_terminal(self.stream)
        self.bar = RichProgress(
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.description}"),
            console=console(self.stream),
            transient=True,
            redirect_stdout=False,  # stdout (the tables) may be a file: never onto stderr
            disable=not self.active,
        )
        self.task = self.bar.add_task("", total=max(1, total))

    def advance(self, label: str = "") -> None:
        """One step done; show ``label`` as the current step."""
        self.bar.update(self.task, advance=1, description=label)
        self.draw()

    def draw(self) -> None:
        """Show the bar (again)."""
        self.bar.start()

    def clear(self) -> None:
        """Take the bar off the screen; :meth:`draw` brings it back."""
        self.bar.stop()


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
