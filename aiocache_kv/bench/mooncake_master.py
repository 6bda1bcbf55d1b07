"""Moved to :mod:`aiocache_kv.testing.mooncake_master` (one place for test helpers); this alias
keeps the old import path working."""

from aiocache_kv.testing.mooncake_master import (
    LOOPBACK,
    LoopbackMaster,
    loopback_client_env,
    master_executable,
    mooncake_available,
)

__all__ = [
    "LOOPBACK",
    "LoopbackMaster",
    "loopback_client_env",
    "master_executable",
    "mooncake_available",
]
