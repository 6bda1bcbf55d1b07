"""``examples/two_nodes.py``: a real master and two server processes; KV computed on node A is
served from Mooncake Store on node B, and both nodes generate the same tokens."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.mooncake
def test_two_nodes_share_kv_through_mooncake(tmp_path: Path) -> None:
    pytest.importorskip("aiohttp")
    from aiocache_kv.testing.mooncake_master import mooncake_available

    reason = mooncake_available()
    if reason is not None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"mooncake dependency missing in CI: {reason}")
        pytest.skip(reason)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples/two_nodes.py"), "--prompt-tokens", "300"],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "node B prefix from storage: yes" in out
    assert "outputs identical on both nodes: yes" in out
    rows = [line.split() for line in out.splitlines() if line.startswith(("A ", "B "))]
    assert len(rows) == 3
    # columns: ... prompt device host storage computed ttft
    prompt, device, host, storage, computed = (int(x) for x in rows[1][-6:-1])
    # node B, first request: 288 of 300 prompt tokens from storage (18 pages), 12 computed
    assert (prompt, device, host, storage, computed) == (300, 0, 0, 288, 12)
    assert int(rows[2][-5]) == 288  # node B again: a device hit
    # the servers' log dir and the master's are removed (torch may leave its own caches)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("aiocache-kv-")] == []
