"""A ``mooncake_master`` on 127.0.0.1 for ``aiocache-kv bench storage`` and the demo.

The same recipe as the test fixture (tests/storage/conftest.py ``MasterProc``, from
MOONCAKE.md): every listener the master lets us choose is bound to loopback, ports are picked
free (retried if taken before the master binds them), readiness is the RPC port accepting a
connection *and* ``/health`` answering 200.  Clients must publish 127.0.0.1 too:
:func:`loopback_client_env` sets the ``MC_*`` variables before any client ``setup()``.

Blocking (process start, readiness polling, ``terminate``): call it off the event loop.

A master never outlives its :class:`LoopbackMaster`: one that was not terminated is killed
(and the log directory the object made is removed) when the object is garbage-collected or
the interpreter exits, so a script that starts one and returns, or dies of an exception,
leaves no process behind.  (A parent killed by SIGKILL still orphans it.)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import weakref
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from aiocache_kv.errors import StorageUnavailableError
from aiocache_kv.storage.mooncake import MooncakeNotInstalledError

LOOPBACK = "127.0.0.1"
#: bounds each call to a hung master (the client's default is 30 s)
RPC_TIMEOUT_MS = 5000
#: what to install where the client is missing: the CUDA build on GPU machines, else the CPU one
_EXTRAS = "'aiocache_kv[mooncake]' (GPU) or 'aiocache_kv[mooncake-cpu]' (CPU only)"

__all__ = [
    "LOOPBACK",
    "LoopbackMaster",
    "loopback_client_env",
    "master_executable",
    "mooncake_available",
]


def loopback_client_env() -> None:
    """Client settings for a loopback deployment (only where not already set).

    ``MC_TCP_BIND_ADDRESS`` is the address a client publishes and peers dial (without it: the
    first non-``lo`` interface); the retries bound a failed ``setup`` to seconds, not ~90 s.
    """
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", LOOPBACK)
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
    os.environ.setdefault("MC_RPC_TIMEOUT_MS", str(RPC_TIMEOUT_MS))
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")


def mooncake_available() -> str | None:
    """``None`` if the mooncake client imports and ``mooncake_master`` exists, else why not."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # before the first import: glog reads it once
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        return f"mooncake client not importable ({exc}); pip install {_EXTRAS}"
    try:
        master_executable()
    except MooncakeNotInstalledError as exc:
        return str(exc)
    return None


def master_executable() -> str:
    """Path of the ``mooncake_master`` binary (PATH, then beside the interpreter).

    Raises:
        MooncakeNotInstalledError: not found or not executable.
    """
    exe = shutil.which("mooncake_master") or os.path.join(
        os.path.dirname(sys.executable), "mooncake_master"
    )
    if not os.access(exe, os.X_OK):
        raise MooncakeNotInstalledError(
            f"mooncake_master binary not found ({exe}); pip install {_EXTRAS}"
        )
    return exe


def _proc_state(pid: int) -> str | None:
    """The one-letter state of ``pid`` from ``/proc`` (``None``: gone, or no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(b")") + 2 :][:1].decode()  # the name may hold spaces and ")"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        port: int = s.getsockname()[1]
        return port


def _reap(proc: subprocess.Popen[bytes], logdir: Path | None) -> None:
    """A master whose :class:`LoopbackMaster` went away unterminated (collected, or the
    interpreter exiting): SIGKILL it (its state is a test's or a bench's, never worth a
    graceful exit), and remove the log directory the object made (``None``: not its own)."""
    if proc.poll() is None:
        with contextlib.suppress(OSError):
            os.kill(proc.pid, signal.SIGCONT)  # (a stopped process dies of SIGKILL too)
        proc.kill()
        proc.wait()
    if logdir is not None:
        shutil.rmtree(logdir, ignore_errors=True)


class LoopbackMaster:
    """One ``mooncake_master`` child process on 127.0.0.1; ``with LoopbackMaster() as m:``."""

    def __init__(
        self, logdir: str | os.PathLike[str] | None = None, *, extra_args: Sequence[str] = ()
    ) -> None:
        """``extra_args``: more ``--flag=value`` options for the master (e.g. a short
        ``--default_kv_lease_ttl`` so a test's reads do not shield objects from eviction)."""
        self.extra_args = tuple(extra_args)
        self._own_logdir = logdir is None
        self.logdir = Path(logdir) if logdir is not None else None
        self.rpc = self.http = self.metrics = 0
        self.proc: subprocess.Popen[bytes] | None = None
        #: kills ``proc`` if this object goes unterminated (see the module docstring)
        self._reaper: (
            weakref.finalize[[subprocess.Popen[bytes], Path | None], LoopbackMaster] | None
        ) = None

    @property
    def rpc_addr(self) -> str:
        """``host:port`` of the master's RPC service (``MooncakeStorage(master=...)``)."""
        return f"{LOOPBACK}:{self.rpc}"

    @property
    def metadata_url(self) -> str:
        """The HTTP metadata server URL (``MooncakeStorage(metadata_server=...)``)."""
        return f"http://{LOOPBACK}:{self.http}/metadata"

    @property
    def pid(self) -> int:
        """The master's pid (the ``mooncake_master`` script ``exec``s the binary)."""
        assert self.proc is not None, "master not started"
        return self.proc.pid

    def start(self, timeout: float = 30.0, *, same_ports: bool = False) -> None:
        """Start the master and wait until it serves RPC and ``/health``.

        ``same_ports`` restarts it where it was (clients reconnect on their own).

        Raises:
            MooncakeNotInstalledError: no ``mooncake_master`` binary.
            StorageUnavailableError: it did not become ready (3 attempts; see the log dir).
        """
        exe = master_executable()
        loopback_client_env()
        if self.logdir is None:
            self.logdir = Path(tempfile.mkdtemp(prefix="aiocache-kv-mooncake-"))
        for _ in range(3):  # a free port can be taken before the master binds it
            if not same_ports:
                self.rpc, self.http, self.metrics = _free_port(), _free_port(), _free_port()
            with open(self.logdir / f"master-{self.rpc}.log", "ab") as logf:
                self.proc = subprocess.Popen(
                    [
                        exe,
                        f"--rpc_address={LOOPBACK}",
                        f"--rpc_port={self.rpc}",
                        "--enable_http_metadata_server=true",
                        f"--http_metadata_server_host={LOOPBACK}",
                        f"--http_metadata_server_port={self.http}",
                        f"--metrics_host={LOOPBACK}",
                        f"--metrics_port={self.metrics}",
                        "--enable_metric_reporting=false",
                        *self.extra_args,
                    ],
                    stdout=logf,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            self._watch(self.proc)
            if self._ready(timeout):
                return
            self.kill()
            if same_ports:
                time.sleep(0.5)  # the old sockets may linger briefly
        if self._reaper is not None:  # every attempt was killed: keep the logs the error names
            self._reaper.detach()
            self._reaper = None
        raise StorageUnavailableError(f"mooncake_master did not start; see logs in {self.logdir}")

    def _watch(self, proc: subprocess.Popen[bytes]) -> None:
        """``proc`` is the master now: it dies with this object (see the module docstring);
        the previous process, if any, was waited for (killed or terminated) already."""
        if self._reaper is not None:
            self._reaper.detach()
        own = self.logdir if self._own_logdir else None
        self._reaper = weakref.finalize(self, _reap, proc, own)

    def _ready(self, timeout: float) -> bool:
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
        """SIGKILL (fault injection): the master's state is lost."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self, timeout: float = 5.0) -> None:
        """SIGSTOP (a hung master); returns once the kernel reports it stopped.

        A signal to another process is not synchronous: on a busy machine the master may still
        answer a request sent right after ``os.kill`` returns, so this waits for state ``T``.
        """
        os.kill(self.pid, signal.SIGSTOP)
        deadline = time.monotonic() + timeout
        while _proc_state(self.pid) not in ("T", "t", None) and time.monotonic() < deadline:
            time.sleep(0.001)

    def cont(self) -> None:
        """SIGCONT after :meth:`stop`."""
        os.kill(self.pid, signal.SIGCONT)

    def terminate(self) -> None:
        """SIGTERM (exits in ~1 s), SIGKILL after 10 s; removes a log dir it created."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)  # a stopped master cannot handle SIGTERM
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._reaper is not None:
            self._reaper.detach()  # nothing left for it: the process was waited for
            self._reaper = None
        if self._own_logdir and self.logdir is not None:
            shutil.rmtree(self.logdir, ignore_errors=True)
            self.logdir = None

    def __enter__(self) -> LoopbackMaster:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.terminate()
