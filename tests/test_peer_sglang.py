"""The SGLang peer harness's import machinery (``bench/peer_stubs.py``) on a tiny fake wheel,
and its clear exit when the wheel folder is missing.  The real wheels are not needed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from aiocache_kv.bench.peer_sglang import wheel_version
from aiocache_kv.bench.peer_stubs import sglang_wheel

MEM_CACHE = """
import triton_peer_test_absent_pkg as tr
from sglang.srt.managers.schedule_batch import Req, rank_consensus
from sglang.srt.mem_cache.helper import double

@rank_consensus(same_params=["x"])
class Thing:
    def __init__(self, req: Req | None = None) -> None:
        self.req = req

    def twice(self, x):
        return double(x)
"""


def _fake_wheel(root: Path) -> Path:
    pkg = root / "sglang"
    (pkg / "srt" / "mem_cache").mkdir(parents=True)
    (pkg / "srt" / "managers").mkdir(parents=True)
    # sglang/__init__.py must never run: it would import the whole server
    (pkg / "__init__.py").write_text("raise RuntimeError('sglang/__init__.py ran')\n")
    (pkg / "srt" / "__init__.py").write_text("raise RuntimeError('sglang/srt ran')\n")
    (pkg / "srt" / "managers" / "schedule_batch.py").write_text("raise RuntimeError('stub?')\n")
    (pkg / "srt" / "mem_cache" / "__init__.py").write_text("")
    (pkg / "srt" / "mem_cache" / "helper.py").write_text("def double(x):\n    return 2 * x\n")
    (pkg / "srt" / "mem_cache" / "thing.py").write_text(MEM_CACHE)
    (root / "sglang-9.9.9.dist-info").mkdir()
    return root


def test_stubs_load_mem_cache_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from aiocache_kv.bench import peer_stubs

    monkeypatch.setattr(
        peer_stubs,
        "THIRD_PARTY_STUBS",
        (*peer_stubs.THIRD_PARTY_STUBS, "triton_peer_test_absent_pkg"),
    )
    root = _fake_wheel(tmp_path)
    assert wheel_version(root) == "9.9.9"
    with sglang_wheel(root) as get:
        thing = get("sglang.srt.mem_cache.thing:Thing")
        assert thing is not None and thing().twice(21) == 42  # the real module ran
        assert get("sglang.srt.mem_cache.thing:Missing") is None
        first = sys.modules["sglang.srt.mem_cache.thing"]
    # out of the block: nothing of the wheel (or of the third-party stubs) is importable
    assert not any(m.split(".")[0] == "sglang" for m in sys.modules)
    assert "triton_peer_test_absent_pkg" not in sys.modules
    with sglang_wheel(root):  # entered again: the same modules come back (no re-import)
        assert sys.modules["sglang.srt.mem_cache.thing"] is first
    assert "sglang" not in sys.modules


def test_missing_wheel_is_a_clear_error(tmp_path: Path) -> None:
    with (
        pytest.raises(FileNotFoundError, match="not an unpacked SGLang wheel"),
        sglang_wheel(tmp_path),
    ):
        pass
    proc = subprocess.run(
        [sys.executable, "-m", "aiocache_kv.cli", "bench", "tree", "--peer-sglang", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "not an unpacked SGLang wheel" in proc.stderr
    assert "pip download --no-deps sglang" in proc.stderr


def test_run_without_peers_reports_our_side(capsys: pytest.CaptureFixture[str]) -> None:
    from aiocache_kv.bench.peer_sglang import PeerBenchOptions, run

    out = run(PeerBenchOptions(wheels=(), page_sizes=(1, 16), sequences=20, repeats=2))
    ours = out["arms"]["aiocache_kv"]
    assert set(ours) == {f"events_{e}_page_{p}" for e in ("off", "on") for p in (1, 16)}
    for cell in ours.values():
        assert cell["us_per_request"] > 0 and cell["cpu_us_per_request"] > 0
        assert cell["ratio"] == cell["cpu_ratio"] == 1.0
    assert "aiocache_kv" in capsys.readouterr().out
