"""Device<->host copies run off the event loop and completed on it."""

from aiocache_kv.transfer.copy import device_to_host, host_to_device, page_runs
from aiocache_kv.transfer.engine import (
    CopyEngine,
    CopyJob,
    CudaCopyEngine,
    Direction,
    ThreadCopyEngine,
    default_engine,
)

__all__ = [
    "CopyEngine",
    "CopyJob",
    "CudaCopyEngine",
    "Direction",
    "ThreadCopyEngine",
    "default_engine",
    "device_to_host",
    "host_to_device",
    "page_runs",
]
