"""An in-memory stand-in for the Mooncake client, behind the real ``MooncakeStorage``.

``FakeMooncakeStorage`` is a ``MooncakeStorage`` whose ``open`` installs a
:class:`FakeClient` instead of connecting, so the backend's own logic (existence check, seal,
verify, codes) runs unchanged while the test decides when each call returns: clear
``client.gates[name]`` and the worker calling ``name`` blocks until it is set again
(``client.entered[name]`` tells that a worker is inside).  Bytes move with ``ctypes`` to and
from the pool's addresses, exactly like the zero-copy client.
"""

from __future__ import annotations

import collections
import ctypes
import threading
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from aiocache_kv.storage.mooncake import MooncakeStorage

MISSING = -704
BUFFER_TOO_SMALL = -600
GATED = ("batch_put_from", "batch_get_into", "batch_is_exist", "batch_get_replica_desc")


class FakeClient:
    """Thread-safe dict store with the Mooncake calls the cache uses."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self.gates = {name: threading.Event() for name in GATED}
        self.entered = {name: threading.Event() for name in GATED}
        for g in self.gates.values():
            g.set()
        self.calls: collections.Counter[str] = collections.Counter()
        self.puts_per_key: collections.Counter[str] = collections.Counter()

    def _enter(self, name: str) -> None:
        with self.lock:
            self.calls[name] += 1
        self.entered[name].set()
        assert self.gates[name].wait(30), f"gate {name} never opened"

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        self._enter("batch_is_exist")
        with self.lock:
            return [1 if k in self.objects else 0 for k in keys]

    def batch_get_replica_desc(self, keys: Sequence[str]) -> dict[str, list[Any]]:
        self._enter("batch_get_replica_desc")
        out: dict[str, list[Any]] = {}
        with self.lock:
            for k in keys:
                if k in self.objects:
                    desc = SimpleNamespace(
                        buffer_descriptor=SimpleNamespace(size=len(self.objects[k]))
                    )
                    out[k] = [
                        SimpleNamespace(
                            status=SimpleNamespace(name="COMPLETE"),
                            is_memory_replica=lambda: True,
                            get_memory_descriptor=lambda d=desc: d,
                        )
                    ]
        return out

    def get_size(self, key: str) -> int:
        with self.lock:
            obj = self.objects.get(key)
        return MISSING if obj is None else len(obj)

    def batch_put_from(
        self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        self._enter("batch_put_from")
        with self.lock:
            for k, p, n in zip(keys, ptrs, sizes, strict=True):
                if k not in self.objects:  # Mooncake keeps the old value
                    self.objects[k] = ctypes.string_at(p, n)
                    self.puts_per_key[k] += 1
        return [0] * len(keys)

    def batch_get_into(
        self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        self._enter("batch_get_into")
        out = []
        for k, p, n in zip(keys, ptrs, sizes, strict=True):
            with self.lock:
                obj = self.objects.get(k)
            if obj is None:
                out.append(MISSING)
            elif len(obj) > n:
                out.append(BUFFER_TOO_SMALL)
            else:
                ctypes.memmove(p, obj, len(obj))
                out.append(len(obj))
        return out

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        with self.lock:
            return [0 if self.objects.pop(k, None) is not None else MISSING for k in keys]

    def register_buffer(self, ptr: int, nbytes: int) -> int:
        return 0

    def unregister_buffer(self, ptr: int) -> int:
        return 0

    def close(self) -> None:
        pass


class FakeMooncakeStorage(MooncakeStorage):
    """``MooncakeStorage`` over a :class:`FakeClient` (no master, no network)."""

    def __init__(self) -> None:
        super().__init__(master="127.0.0.1:1", metadata_server="http://127.0.0.1:1/metadata")
        self.client = FakeClient()

    def open(self) -> None:
        with self._open_lock:
            self._store = self.client
