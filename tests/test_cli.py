"""The ``aiocache-kv`` command line, run as a subprocess: demo and both bench suites."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from aiocache_kv.cli import build_parser


def run_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Run ``python -m aiocache_kv.cli ARGS`` and capture its output."""
    return subprocess.run(
        [sys.executable, "-m", "aiocache_kv.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def positive_numbers(obj: Any) -> list[float]:
    """Every int/float leaf of a JSON value (bools excluded)."""
    if isinstance(obj, bool):
        return []
    if isinstance(obj, (int, float)):
        return [float(obj)]
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in positive_numbers(v)]
    if isinstance(obj, list):
        return [x for v in obj for x in positive_numbers(v)]
    return []


def test_demo_runs_and_passes_its_data_check() -> None:
    proc = run_cli("demo")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "device hit" in out and "host hit" in out
    assert "data check PASSED" in out
    assert "BlockStored" in out and "BlockRemoved" in out
    assert "load_back_done" in out
    assert "cache_started" in proc.stderr  # structlog console logs go to stderr


def test_demo_other_page_size_and_seed() -> None:
    proc = run_cli("demo", "--page-size", "1", "--seed", "7", "--device-pages", "200")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "data check PASSED" in proc.stdout


def test_demo_too_small_device_pool_fails_cleanly() -> None:
    proc = run_cli("demo", "--device-pages", "4")
    assert proc.returncode == 1
    assert "CapacityError" in proc.stdout
    assert "Traceback" not in proc.stderr


def test_bench_tree_tiny(tmp_path: Path) -> None:
    report = tmp_path / "tree.json"
    proc = run_cli(
        "bench", "tree", "--sequences", "20", "--tree-repeats", "2", "--json", str(report)
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gc.freeze()" in proc.stdout
    assert "<= 20 ms" in proc.stdout  # targets printed beside the numbers
    data = json.loads(report.read_text())
    assert set(data) >= {"aiocache_kv", "machine", "suites"}
    tree = data["suites"]["tree"]
    assert tree["sequences"] == 20 and tree["repeats"] == 2
    assert set(tree["page_sizes"]) == {"1", "16"}
    for level in tree["page_sizes"].values():
        for name in ("tree", "hicache"):
            med = level[name]["median_ms"]
            assert set(med) >= {"insert", "match", "evict"}
            assert all(v > 0 for v in med.values())
            assert level[name]["pages"] > 0
        assert all(v > 0 for v in level["hicache"]["overhead_vs_tree"].values())


def test_bench_transfer_tiny(tmp_path: Path) -> None:
    report = tmp_path / "transfer.json"
    proc = run_cli(
        "bench",
        "transfer",
        "--mib",
        "4",
        "--lag-mib",
        "8",
        "--page-kib",
        "64",
        "256",
        "--transfer-repeats",
        "2",
        "--json",
        str(report),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(report.read_text())
    xfer = data["suites"]["transfer"]
    assert set(xfer["page_sizes"]) == {"64KiB", "256KiB"}
    keys = {
        "baseline_gather",
        "kernel_d2h_random",
        "kernel_h2d_random",
        "kernel_d2h_runs",
        "kernel_h2d_runs",
        "cache_write_through",
        "cache_load_back",
    }
    for entry in xfer["page_sizes"].values():
        assert set(entry["gbs"]) == keys
        assert set(entry["ratio"]) == keys
        assert entry["ratio"]["baseline_gather"] == pytest.approx(1.0)
        assert all(v > 0 for v in positive_numbers(entry["gbs"]))
        assert all(v > 0 for v in positive_numbers(entry["ratio"]))
    lag = xfer["loop_lag"]
    assert set(lag) >= {"p50_ms", "p99_ms", "max_ms", "idle_p99_ms", "samples", "bytes"}
    assert lag["samples"] > 0 and lag["bytes"] == 8 << 20
    assert lag["p99_ms"] >= 0 and lag["target_p99_ms"] == 2.0


def test_bench_parser_defaults() -> None:
    args = build_parser().parse_args(["bench"])
    assert args.suite == "all"
    assert args.sequences == 2000 and args.page_sizes == [1, 16]
    assert args.page_kib == [64, 256, 1024]
    args = build_parser().parse_args(["bench", "tree", "--sizes", "4", "--json", "x.json"])
    assert args.suite == "tree" and args.page_sizes == [4] and args.json == "x.json"


def test_bench_rejects_unknown_suite(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["bench", "nope"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
