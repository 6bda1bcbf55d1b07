"""Fixtures for the storage tests: a real ``mooncake_master`` on 127.0.0.1 and real clients.

Adapted from /work/shared/MOONCAKE.md.  Without the mooncake client or the master binary the
Mooncake fixtures skip locally but FAIL when ``CI=true``: a skip never counts as a pass in CI.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

LOOPBACK = "127.0.0.1"
RPC_TIMEOUT_MS = 1500

# Before any client exists: publish/dial loopback only, fail setup fast, bound hung-master calls.
os.environ.setdefault("MC_TCP_BIND_ADDRESS", LOOPBACK)
os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
os.environ.setdefault("MC_RPC_TIMEOUT_MS", str(RPC_TIMEOUT_MS))
os.environ.setdefault("MC_LOG_LEVEL", "WARNING")


def _missing(reason: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"mooncake dependency missing in CI: {reason}")
    pytest.skip(reason)


def master_executable() -> str:
    """Path of ``mooncake_master``; fails (CI) or skips (local) when it or the client is absent."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        _missing(f"mooncake client not importable: {exc}")
    exe = shutil.which("mooncake_master") or os.path.join(
        os.path.dirname(sys.executable), "mooncake_master"
    )
    if not os.access(exe, os.X_OK):
        _missing(f"mooncake_master binary not found ({exe})")
    return exe


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        port: int = s.getsockname()[1]
        return port


class MasterProc:
    """A ``mooncake_master`` child bound to 127.0.0.1 that can be killed, stopped, restarted."""

    def __init__(self, exe: str, logdir: Path) -> None:
        self.exe = exe
        self.logdir = logdir
        self.rpc = self.http = self.metrics = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def rpc_addr(self) -> str:
        return f"{LOOPBACK}:{self.rpc}"

    @property
    def metadata_url(self) -> str:
        return f"http://{LOOPBACK}:{self.http}/metadata"

    @property
    def pid(self) -> int:
        assert self.proc is not None, "master not started"
        return self.proc.pid

    def start(self, *, same_ports: bool = False) -> None:
        for _ in range(3):  # a free port can be taken before the master binds it
            if not same_ports:
                self.rpc, self.http, self.metrics = free_port(), free_port(), free_port()
            with open(self.logdir / f"master-{self.rpc}.log", "ab") as logf:
                self.proc = subprocess.Popen(
                    [
                        self.exe,
                        f"--rpc_address={LOOPBACK}",
                        f"--rpc_port={self.rpc}",
                        "--enable_http_metadata_server=true",
                        f"--http_metadata_server_host={LOOPBACK}",
                        f"--http_metadata_server_port={self.http}",
                        f"--metrics_host={LOOPBACK}",
                        f"--metrics_port={self.metrics}",
                        "--enable_metric_reporting=false",
                    ],
                    stdout=logf,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            if self._ready():
                return
            self.kill()
            if same_ports:
                time.sleep(0.5)  # the old sockets may linger briefly
        pytest.fail(f"mooncake_master did not start, see {self.logdir}")

    def _ready(self, timeout: float = 30.0) -> bool:
        assert self.proc is not None
        end = time.monotonic() + timeout
        while time.monotonic() < end and self.proc.poll() is None:
            try:
                socket.create_connection((LOOPBACK, self.rpc), timeout=0.2).close()
                url = f"http://{LOOPBACK}:{self.http}/health"
                with urllib.request.urlopen(url, timeout=0.5) as r:
                    if r.status == 200:
                        return True
            except OSError:
                pass
            time.sleep(0.05)
        return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def cont(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def terminate(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.pid, signal.SIGCONT)  # a stopped master cannot handle SIGTERM
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="session")
def mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MasterProc]:
    """One master for the whole session (do not kill it: use ``fault_master`` for that)."""
    master = MasterProc(master_executable(), tmp_path_factory.mktemp("mooncake"))
    master.start()
    yield master
    master.terminate()


@pytest.fixture
def fault_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MasterProc]:
    """A dedicated master for one fault test (killed / stopped / restarted freely)."""
    master = MasterProc(master_executable(), tmp_path_factory.mktemp("mooncake-fault"))
    master.start()
    yield master
    master.terminate()


@pytest.fixture(scope="session")
def mc_storage(mooncake_master: MasterProc) -> Iterator[object]:
    """A session-scoped ``MooncakeStorage`` client (close costs ~2 s and drops its segment)."""
    from aiocache_kv.storage.mooncake import MooncakeStorage

    storage = MooncakeStorage(
        master=mooncake_master.rpc_addr,
        metadata_server=mooncake_master.metadata_url,
        local_hostname=LOOPBACK,
        protocol="tcp",
        device_name="",
        global_segment_size=64 << 20,
        local_buffer_size=16 << 20,
    )
    storage.open()
    yield storage
    storage.close()


@pytest.fixture
def tag() -> str:
    """A namespace tag unique to the test (keys never collide across tests)."""
    return f"t{uuid.uuid4().hex[:12]}"
