"""The ``aiocache-kv`` command line, run as a subprocess: demo and the bench suites."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from aiocache_kv.bench.command import page_kib
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


SMALL = ("--conversations", "2", "--turns", "2", "--new-tokens", "4")


def test_demo_runs_and_passes_its_identity_check() -> None:
    proc = run_cli("demo")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "random-weight GPT-2" in out and "nothing downloaded" in out
    assert "L3: FileStorage at" in out
    for turn in range(1, 5):
        assert f"node 1, turn {turn}" in out
    assert "node 2, turn 5" in out and "restarted node" in out
    assert "TTFT no cache ms" in out and "TTFT cache ms" in out
    assert "device hit" in out and "host hit" in out and "storage hit" in out
    assert "every tier served hits" in out  # device, host and storage each served a prefix
    assert "identity check PASSED: 20/20 generations token-identical" in out
    assert " NO " not in out
    assert "BlockStored" in out and "BlockRemoved" in out and "STORAGE" in out
    assert "cache_started" in proc.stderr  # structlog console logs go to stderr
    assert "Traceback" not in proc.stderr


def test_demo_storage_dir_is_kept_and_reused(tmp_path: Path) -> None:
    store = tmp_path / "kv"
    proc = run_cli("demo", *SMALL, "--storage-dir", str(store))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "identity check PASSED: 6/6" in proc.stdout
    assert any(store.rglob("*.kv"))  # the pages stay where the user put them


def test_demo_without_storage_other_page_size_and_seed() -> None:
    args = ("--storage", "none", "--page-size", "8", "--seed", "7", "--device-pages", "96")
    proc = run_cli("demo", *SMALL, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "page_size=8" in proc.stdout
    assert "identity check PASSED: 4/4" in proc.stdout
    assert "restarted node" not in proc.stdout and "STORAGE" not in proc.stdout
    # the summary claims only what this run has: one node, no storage tier
    assert "both nodes" not in proc.stdout and "every tier" not in proc.stdout
    (hits,) = [line for line in proc.stdout.splitlines() if line.startswith("tokens hit per")]
    assert "storage" not in hits.split(" - ")[0]


def test_demo_too_small_device_pool_fails_cleanly() -> None:
    proc = run_cli("demo", *SMALL, "--device-pages", "4")
    assert proc.returncode == 1
    # the engine refuses a request the device pool cannot hold, before it touches the cache
    assert "demo failed: InvalidInputError" in proc.stdout
    assert "the device pool has 64" in proc.stdout
    assert "Traceback" not in proc.stderr


@pytest.mark.mooncake
def test_demo_on_mooncake() -> None:
    reason = _mooncake_missing()
    if reason is not None:
        pytest.skip(reason)
    proc = run_cli("demo", *SMALL, "--storage", "mooncake")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "L3: MooncakeStorage, master 127.0.0.1:" in proc.stdout
    assert "node 2 is a second client" in proc.stdout
    assert "identity check PASSED: 6/6" in proc.stdout


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
        for form in ("serving_step", "serving_step_all_slots"):
            assert level[form]["median_ms"] > 0
            assert level[form]["vs_tree_insert_match"] > 0
    hashing = tree["hashing"]  # us per page, old vs pure Python (vs C where built)
    assert set(hashing["page_sizes"]) == {"1", "16"}
    for chains in hashing["page_sizes"].values():
        for impls in chains.values():
            assert len(impls) == (3 if hashing["impl"] == "c" else 2)
            assert all(v > 0 for v in impls.values())


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


def _mooncake_missing() -> str | None:
    from aiocache_kv.testing.mooncake_master import mooncake_available

    reason = mooncake_available()
    if reason is not None and os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"mooncake dependency missing in CI: {reason}")
    return reason


def _check_storage_report(path: Path, backend: str, configs: set[str]) -> dict[str, Any]:
    data = json.loads(path.read_text())
    suite = data["suites"]["storage"]
    assert suite["errors"] == []
    entries = suite["backends"][backend]["configs"]
    assert set(entries) == configs
    for entry in entries.values():
        assert set(entry["gbs"]) == {
            "raw_put",
            "cache_backup",
            "raw_get",
            "cache_prefetch",
            "seal",
            "ceiling_put",
            "ceiling_get",
            "raw_put_awaited",
            "raw_get_awaited",
        }
        assert set(entry["ratio"]) == set(entry["ceiling"]) == {"backup", "prefetch"}
        # the raw call timed on the loop contains the same call timed in its thread: each
        # round's awaited time is the longer, so the ratio against it can only be higher
        for name, raw in (("backup", "put"), ("prefetch", "get")):
            inner, outer = entry["seconds"][f"raw_{raw}"], entry["seconds"][f"raw_{raw}_awaited"]
            assert all(o >= i for i, o in zip(inner, outer, strict=True)), (inner, outer)
            assert entry["ratio_vs_awaited"][name] >= entry["ratio"][name]
            assert entry["handoff_us"][raw] >= 0
        assert all(0 < v < 2 for v in entry["ceiling"].values())  # (at most ~1: noise aside)
        assert entry["pages"] > 0 and entry["bytes"] == entry["pages"] * entry["page_bytes"]
        assert all(v > 0 for v in positive_numbers(entry["gbs"]))
        assert all(v > 0 for v in positive_numbers(entry["ratio"]))
        assert all(len(v) == 2 for v in entry["seconds"].values())
        # the loop thread's CPU per page, backup and prefetch: measured, so positive
        assert set(entry["loop_us_per_page"]) == {"backup", "prefetch"}
        assert all(v > 0 for v in entry["loop_us_per_page"].values())
    return dict(suite)


def test_bench_storage_file_tiny(tmp_path: Path) -> None:
    report = tmp_path / "storage.json"
    proc = run_cli(
        "bench",
        "storage",
        "--backend",
        "file",
        "--page-kib",
        "64,256",
        "--batch",
        "4",
        "--storage-mib",
        "1",
        "--storage-repeats",
        "2",
        "--storage-dir",
        str(tmp_path),
        "--json",
        str(report),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "cache backup" in proc.stdout and "cache prefetch" in proc.stdout
    suite = _check_storage_report(report, "file", {"64KiB_b4", "256KiB_b4"})
    assert suite["target_ratio"] == {"file": 1.0, "mooncake": 0.95}
    assert suite["backends"]["file"]["target_ratio"] == 1.0 and "mooncake" not in suite["backends"]
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]  # temp dirs removed


@pytest.mark.mooncake
def test_bench_storage_mooncake_tiny(tmp_path: Path) -> None:
    reason = _mooncake_missing()
    if reason is not None:
        pytest.skip(reason)
    report = tmp_path / "storage.json"
    proc = run_cli(
        "bench",
        "storage",
        "--backend",
        "mooncake",
        "--page-kib",
        "64",
        "--batch",
        "4",
        "16",
        "--storage-mib",
        "1",
        "--storage-repeats",
        "2",
        "--json",
        str(report),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "started a loopback master at 127.0.0.1:" in proc.stdout
    suite = _check_storage_report(report, "mooncake", {"64KiB_b4", "64KiB_b16"})
    assert suite["backends"]["mooncake"]["target_ratio"] == 0.95


def test_bench_e2e_tiny(tmp_path: Path) -> None:
    report = tmp_path / "e2e.json"
    proc = run_cli(
        "bench", "e2e", "--prefix-lens", "64,256", "--suffix", "8", "--e2e-repeats", "1",
        "--storage-dir", str(tmp_path / "kv"), "--json", str(report),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no cache ms" in proc.stdout and "storage hit ms" in proc.stdout
    e2e = json.loads(report.read_text())["suites"]["e2e"]
    assert e2e["identical"] is True and set(e2e["prefix_lens"]) == {"64", "256"}
    for row in e2e["prefix_lens"].values():
        assert row["no_cache_ms"] > 0
        for tier in ("device", "host", "storage"):
            assert row[f"{tier}_ms"] > 0 and row[f"{tier}_speedup"] > 0
    assert e2e["prefix_lens"]["256"]["storage_hit_tokens"] == 256
    assert e2e["prefix_lens"]["256"]["host_hit_tokens"] == 256


def test_bench_parser_defaults() -> None:
    args = build_parser().parse_args(["bench"])
    assert args.suite == "all"
    assert args.sequences == 2000 and args.page_sizes == [1, 16]
    assert page_kib(args, "transfer") == (64, 256, 1024)
    assert page_kib(args, "storage") == (64, 256, 1024, 4096)
    assert args.backend == "all" and args.batch is None and args.storage_repeats == 3
    args = build_parser().parse_args(["bench", "storage", "--page-kib", "64,256", "1024"])
    assert args.suite == "storage" and page_kib(args, "storage") == (64, 256, 1024)
    args = build_parser().parse_args(["bench", "tree", "--sizes", "4", "--json", "x.json"])
    assert args.suite == "tree" and args.page_sizes == [4] and args.json == "x.json"


def test_bench_rejects_unknown_suite(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["bench", "nope"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "storage", "--batch", "16,x"])
    assert "comma-separated integers" in capsys.readouterr().err


def test_help_lists_every_bench_suite(capsys: pytest.CaptureFixture[str]) -> None:
    suites = ("tree", "transfer", "storage", "embedding", "e2e", "engine")
    for argv in (["--help"], ["bench", "--help"]):
        with pytest.raises(SystemExit) as exc:
            build_parser().parse_args(argv)
        assert exc.value.code == 0
        text = " ".join(capsys.readouterr().out.split())
        assert all(name in text for name in suites), (argv, text)
    assert build_parser().parse_args(["bench", "e2e"]).suite == "e2e"


def test_plot_without_matplotlib_exits_2_with_the_readme_hint(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from aiocache_kv.bench.e2e import PLOT_HINT
    from aiocache_kv.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not importable
    png = tmp_path / "ttft.png"
    assert main(["bench", "e2e", "--plot", str(png), "--prefix-lens", "64"]) == 2
    err = capsys.readouterr().err
    assert PLOT_HINT in err and not png.exists()
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "pip install -e .[plot]" in PLOT_HINT and "pip install -e .[plot]" in readme


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["bench", "tree", "--json", "{dir}"], "is a directory"),
        (["bench", "tree", "--json", "{file}/report.json"], "--json"),
        (["bench", "transfer", "--page-kib", "24"], "multiples of 16 KiB"),
        (["bench", "e2e", "--prefix-lens", "100000"], "exceeds the model's"),
    ],
)
def test_bad_bench_arguments_exit_2_before_any_suite_runs(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Found before the suites run (a ``--json`` that cannot be written used to fail with a
    traceback after the whole run; a page size or prefix the suite refused, with one when
    its suite started)."""
    from aiocache_kv.cli import main

    afile = tmp_path / "afile"
    afile.write_text("")
    argv = [a.format(dir=tmp_path, file=afile) for a in argv]
    assert main(argv) == 2
    out = capsys.readouterr()
    assert says in out.err and "bench tree" not in out.out and "== bench" not in out.out


def test_demo_that_cannot_fit_the_model_exits_2_before_building_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from aiocache_kv.cli import main

    assert main(["--log-level", "error", "demo", "--system-tokens", "5000"]) == 2
    out = capsys.readouterr()
    assert "positions" in out.err and "random-weight GPT-2" not in out.out
