"""Every Python snippet of the README runs as written, and the server example's shell lines
show a cache hit."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PYTHON = re.findall(r"^```python\n(.*?)^```", README, re.S | re.M)
BASH = re.findall(r"^ *```bash\n(.*?)^ *```", README, re.S | re.M)


def test_the_readme_has_its_snippets() -> None:
    assert len(PYTHON) >= 3  # the extraction itself works


def _env(tmp_path: Path) -> dict[str, str]:
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    pythonpath = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PATH": path, "PYTHONPATH": pythonpath, "TMPDIR": str(tmp_path)}


@pytest.mark.parametrize("index", range(len(PYTHON)))
def test_python_snippet_runs_as_written(index: int, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", PYTHON[index]],
        cwd=tmp_path,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, f"README python snippet {index}:\n{PYTHON[index]}\n{proc.stderr}"


def test_model_adapter_snippet_hits_the_second_time(tmp_path: Path) -> None:
    (snippet,) = [s for s in PYTHON if "CachedLM(model, cache)" in s]
    out = subprocess.run(
        [sys.executable, "-c", snippet], cwd=tmp_path, env=_env(tmp_path),
        capture_output=True, text=True, timeout=240, check=True,
    ).stdout.splitlines()  # fmt: skip
    # "tokens hit_device hit_host hit_storage ttft" per generation
    assert [line.split("] ")[1].split()[:3] for line in out] == [["0", "0", "0"], ["32", "0", "0"]]


def test_server_example_shell_lines_show_a_hit(tmp_path: Path) -> None:
    pytest.importorskip("aiohttp")
    (block,) = [b for b in BASH if "examples/server.py --port 8000" in b]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        ["bash", "-c", block.replace("8000", str(port))], cwd=ROOT, env=_env(tmp_path),
        text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # bash and the server it started
        out, err = proc.communicate()
        pytest.fail(f"the README's server lines did not finish:\n{out}\n{err}")
    finally:
        _reap_group(proc.pid)
    replies = [line for line in out.splitlines() if line.startswith("{")]
    assert len(replies) == 2, out + err
    assert '"device": 0' in replies[0] and '"computed_tokens": 40' in replies[0]
    assert '"device": 32' in replies[1] and '"computed_tokens": 8' in replies[1]
    assert "aiocache_kv_prompt_tokens_total" in out


def _reap_group(pgid: int, grace: float = 20.0) -> None:
    """Let the server that ``kill %1`` stopped shut down; SIGKILL whatever is left after
    ``grace`` seconds."""
    end = time.monotonic() + grace
    while time.monotonic() < end:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
