"""A healthy Mooncake run prints no INFO/WARNING lines from the C++ client by default, and a
level the user chose is kept."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.storage.conftest import LOOPBACK, MasterProc

pytestmark = pytest.mark.mooncake

SCRIPT = """
import sys
from aiocache_kv.storage.mooncake import MooncakeStorage
st = MooncakeStorage(master=sys.argv[1], metadata_server=sys.argv[2], local_hostname="{host}",
                     protocol="tcp", device_name="", global_segment_size=16 << 20,
                     local_buffer_size=16 << 20)
st.open()
print(st.exists(["quiet-test-key"]))
st.close()
""".replace("{host}", LOOPBACK)

GLOG_INFO_OR_WARNING = re.compile(r"^[IW]\d{4} ", re.MULTILINE)


def run_client(master: MasterProc, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MC_LOG")}
    environ.update(env, MC_STORE_CLIENT_SETUP_RETRIES="1")
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, master.rpc_addr, master.metadata_url],
        capture_output=True,
        text=True,
        timeout=120,
        env=environ,
        check=True,
    )


def test_client_info_lines_are_quiet_by_default(mooncake_master: MasterProc) -> None:
    out = run_client(mooncake_master)
    assert out.stdout.strip() == "[False]"
    assert not GLOG_INFO_OR_WARNING.search(out.stderr), out.stderr


def test_a_level_the_user_set_is_kept(mooncake_master: MasterProc) -> None:
    out = run_client(mooncake_master, MC_LOG_LEVEL="INFO")
    assert GLOG_INFO_OR_WARNING.search(out.stderr), out.stderr
