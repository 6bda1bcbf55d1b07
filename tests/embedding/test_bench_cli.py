"""``aiocache-kv bench embedding`` end to end (tiny settings, real master, two processes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import master_executable

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(180)]


@pytest.mark.allow_blocking
def test_bench_embedding_cli(tmp_path: Path) -> None:
    master_executable()  # fails in CI, skips locally, without mooncake
    report = tmp_path / "emb.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "aiocache_kv.cli",
            "bench",
            "embedding",
            "--emb-mib",
            "2",
            "--emb-repeats",
            "1",
            "--emb-requests",
            "8",
            "--json",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "raw+copy" in proc.stdout and "with the global store" in proc.stdout
    data = json.loads(report.read_text())["suites"]["embedding"]
    for row in data["throughput"]:
        assert row["insert_gbs"] > 0 and row["get_gbs"] > 0 and row["insert_ratio"] > 0
    enc = data["encoder"]
    assert enc["encoder_calls_global"] <= enc["encoder_calls_local_only"]
    assert enc["encoder_calls_saved"] == enc["encoder_calls_no_cache"] - enc["encoder_calls_global"]
    assert enc["node_b_saved_by_node_a"] >= 0
