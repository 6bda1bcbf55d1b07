"""A loopback ``mooncake_master`` never outlives the :class:`LoopbackMaster` that started it.

Found while benchmarking: scripts that started a master and returned without ``terminate()``
left 46 masters running (each taking CPU from every later measurement) and 67 log
directories in the temp dir.  Real masters, real processes.
"""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aiocache_kv.errors import StorageUnavailableError
from aiocache_kv.testing.mooncake_master import LoopbackMaster

from .conftest import master_executable

pytestmark = pytest.mark.mooncake


def _gone(pid: int, timeout: float = 10.0) -> bool:
    """``pid`` exited (and was reaped, or is a zombie nobody will run again)."""
    end = time.monotonic() + timeout
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(0.02)


def _reaped(pid: int, what: str) -> None:
    """Assert ``pid`` is gone (after a collection); kill it if not, so no test leaks one."""
    gc.collect()
    try:
        assert _gone(pid), what
    finally:
        if not _gone(pid, 0):
            os.kill(pid, 9)


def test_a_script_that_returns_without_terminate_leaves_no_master() -> None:
    master_executable()  # skips locally / fails in CI without Mooncake
    code = (
        "from aiocache_kv.testing.mooncake_master import LoopbackMaster\n"
        "m = LoopbackMaster(); m.start()\n"
        "print(m.pid, m.logdir, flush=True)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    pid_s, logdir = out.stdout.split()
    _reaped(int(pid_s), "mooncake_master outlived the script that started it")
    assert not Path(logdir).exists(), f"the master's own log dir {logdir} was left behind"


def test_a_script_dying_of_an_exception_leaves_no_stopped_master() -> None:
    """Even a master left SIGSTOPped (a fault test that failed midway) is killed."""
    master_executable()
    code = (
        "from aiocache_kv.testing.mooncake_master import LoopbackMaster\n"
        "m = LoopbackMaster(); m.start()\n"
        "print(m.pid, flush=True)\n"
        "m.stop()\n"
        "raise SystemExit('a test failed with the master stopped')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0, out.stderr
    _reaped(int(out.stdout.split()[0]), "a stopped mooncake_master outlived its script")


def test_a_collected_master_object_takes_its_process_along(tmp_path: Path) -> None:
    master_executable()
    (tmp_path / "logs").mkdir()
    m = LoopbackMaster(tmp_path / "logs")
    m.start()
    pid = m.pid
    del m
    _reaped(pid, "mooncake_master outlived its collected LoopbackMaster")
    assert (tmp_path / "logs").is_dir()  # a log dir the caller gave is the caller's: kept


def test_terminate_then_restart_keeps_watching_the_new_process() -> None:
    master_executable()
    m = LoopbackMaster()
    m.start()
    first = m.pid
    m.terminate()
    assert _gone(first)
    m.start()  # a fresh log dir, a fresh process: the object still owns both
    second, logdir = m.pid, m.logdir
    assert second != first and logdir is not None
    del m
    _reaped(second, "the restarted master outlived its object")
    assert not logdir.exists()


def test_a_kill_and_same_ports_restart_is_still_watched() -> None:
    """Fault injection: SIGKILL, restart where it was; the new process dies with the object."""
    master_executable()
    m = LoopbackMaster()
    m.start()
    m.kill()
    m.start(same_ports=True)
    pid = m.pid
    del m
    _reaped(pid, "the master restarted after a kill outlived its object")


def test_a_master_that_never_starts_keeps_the_logs_its_error_names() -> None:
    """A failed start kills every attempt and points at its log dir: that dir outlives the
    object (the reaper must not remove what the error tells the user to read)."""
    master_executable()
    m = LoopbackMaster(extra_args=("--no_such_flag_for_mooncake=1",))
    message = ""
    try:
        m.start(timeout=5.0)
    except StorageUnavailableError as exc:
        message = str(exc)  # (the traceback would keep the object alive: not kept)
    assert "see logs in " in message, message
    logdir = Path(message.rsplit("see logs in ", 1)[1])
    del m
    gc.collect()
    try:
        assert logdir.is_dir() and any(logdir.iterdir()), "the logs the error names are gone"
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
