"""Fixtures for the storage tests: a real ``mooncake_master`` on 127.0.0.1 and real clients.

Adapted from /work/shared/MOONCAKE.md.  Without the mooncake client or the master binary the
Mooncake fixtures skip locally but FAIL when ``CI=true``: a skip never counts as a pass in CI.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from aiocache_kv.testing.mooncake_master import LoopbackMaster

if TYPE_CHECKING:
    from aiocache_kv.storage.mooncake import MooncakeStorage

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


class MasterProc(LoopbackMaster):
    """The package's loopback master, with a test-owned log directory."""

    def __init__(self, exe: str, logdir: Path) -> None:
        del exe  # located again by start(); kept for the fixtures' call shape
        super().__init__(logdir)


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


def loopback_client(master: MasterProc, segment_bytes: int) -> MooncakeStorage:
    """A ``MooncakeStorage`` client of ``master`` over TCP on loopback, mounting
    ``segment_bytes`` of its own memory (not opened yet)."""
    from aiocache_kv.storage.mooncake import MooncakeStorage

    return MooncakeStorage(
        master=master.rpc_addr,
        metadata_server=master.metadata_url,
        local_hostname=LOOPBACK,
        protocol="tcp",
        device_name="",
        global_segment_size=segment_bytes,
        local_buffer_size=16 << 20,
    )


@pytest.fixture(scope="session")
def mc_storage(mooncake_master: MasterProc) -> Iterator[object]:
    """A session-scoped ``MooncakeStorage`` client (close costs ~2 s and drops its segment)."""
    storage = loopback_client(mooncake_master, 64 << 20)
    storage.open()
    yield storage
    storage.close()


@pytest.fixture
def tag() -> str:
    """A namespace tag unique to the test (keys never collide across tests)."""
    return f"t{uuid.uuid4().hex[:12]}"
