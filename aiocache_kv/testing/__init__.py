"""Test helpers shipped with the package: fakes behind the real protocols, and a detector of
blocking calls on the event loop.

* :class:`ManualCopyEngine` - a :class:`~aiocache_kv.transfer.CopyEngine` whose copies run only
  when the test says so (``complete``/``fail``), in any order, for deterministic interleavings.
* :class:`MemoryStorage` - an in-memory, thread-safe
  :class:`~aiocache_kv.storage.base.StorageBackend` that seals on put and verifies on get, with
  seeded fault injection (delays and stalls, per-key put/get failures, keys that vanish,
  corrupted pages) and raw inspection of what it holds.
* :class:`FakeMooncakeStorage` / :class:`FakeMooncakeClient` - the real ``MooncakeStorage``
  logic over an in-memory client whose answers (scripted codes) and timing (gates) a test
  controls: the one fake Mooncake client of the test suite (:class:`ChaosMooncakeClient`: with
  seeded faults, for stress tests).
* :class:`LoopbackMaster` - a real ``mooncake_master`` on 127.0.0.1 (kill/stop/cont/restart on
  the same ports), for tests, the demo and the examples.
* :class:`BlockingCallDetector` - patches well-known blocking calls so that calling one on a
  thread that is running an asyncio loop raises :class:`~aiocache_kv.errors.BlockingCallError`
  (and is recorded, so a swallowed error still fails the test).
"""

from aiocache_kv.testing.blocking import BlockingCallDetector
from aiocache_kv.testing.engines import ManualCopyEngine, RandomDelayEngine
from aiocache_kv.testing.fake_mooncake import (
    ChaosMooncakeClient,
    FakeMooncakeClient,
    FakeMooncakeStorage,
)
from aiocache_kv.testing.logs import capture_logs
from aiocache_kv.testing.memory_storage import MemoryStorage
from aiocache_kv.testing.mooncake_master import (
    LoopbackMaster,
    loopback_client_env,
    mooncake_available,
)

__all__ = [
    "BlockingCallDetector",
    "ChaosMooncakeClient",
    "FakeMooncakeClient",
    "FakeMooncakeStorage",
    "LoopbackMaster",
    "ManualCopyEngine",
    "MemoryStorage",
    "RandomDelayEngine",
    "capture_logs",
    "loopback_client_env",
    "mooncake_available",
]
