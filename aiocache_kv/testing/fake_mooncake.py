"""One in-memory stand-in for the Mooncake client, behind the real ``MooncakeStorage``.

:class:`FakeMooncakeStorage` is a ``MooncakeStorage`` whose ``open`` installs a
:class:`FakeMooncakeClient` instead of connecting, so the backend's own logic (existence check,
seal, verify, return-code mapping, retries) runs unchanged while a test decides:

* what the store holds (``client.objects``, raw bytes per key: corrupt or truncate them);
* what each call answers: queue code lists in ``client.exist_codes`` / ``client.put_codes`` /
  ``client.get_codes`` and the next call returns them instead of the store's real answer (a
  put still stores the keys whose code is 0), to script error codes, short results, retries;
* when each call returns: clear ``client.gates[name]`` and a worker calling ``name`` blocks
  until it is set again (``client.entered[name]`` tells that a worker is inside);
* what was called: ``client.calls`` counts calls by name, ``client.log`` lists ``(name, keys)``
  in order, ``client.puts_per_key`` counts the puts that stored a key.

:class:`ChaosMooncakeClient` adds seeded faults for stress tests: delays, stalls, failed
batches, stored objects damaged or removed by "another client".

Bytes move with ``ctypes`` from and to the buffers' addresses, as with the zero-copy client.
The codes are Mooncake's: 0 success, ``-704`` object not found, ``-600`` buffer too small.
"""

from __future__ import annotations

import collections
import ctypes
import random
import re
import threading
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from aiocache_kv.storage.mooncake import MooncakeStorage

__all__ = [
    "BUFFER_TOO_SMALL",
    "GATED",
    "MISSING",
    "ChaosMooncakeClient",
    "FakeMooncakeClient",
    "FakeMooncakeStorage",
]

MISSING = -704
BUFFER_TOO_SMALL = -600
#: the calls a test can hold at a gate
GATED = ("batch_put_from", "batch_get_into", "batch_is_exist", "batch_get_replica_desc")


class FakeMooncakeClient:
    """Thread-safe dict store with the Mooncake calls the cache uses (see the module doc)."""

    def __init__(
        self,
        exist_codes: Sequence[Sequence[int]] = (),
        put_codes: Sequence[Sequence[int]] = (),
        get_codes: Sequence[Sequence[int]] = (),
    ) -> None:
        self.objects: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self.gates = {name: threading.Event() for name in GATED}
        self.entered = {name: threading.Event() for name in GATED}
        for g in self.gates.values():
            g.set()
        self.exist_codes: list[list[int]] = [list(c) for c in exist_codes]
        self.put_codes: list[list[int]] = [list(c) for c in put_codes]
        self.get_codes: list[list[int]] = [list(c) for c in get_codes]
        self.calls: collections.Counter[str] = collections.Counter()
        self.log: list[tuple[str, list[str]]] = []
        self.puts_per_key: collections.Counter[str] = collections.Counter()
        self.closed = False

    @property
    def put_calls(self) -> list[list[str]]:
        """The keys of every ``batch_put_from``, in order."""
        return [keys for name, keys in self.log if name == "batch_put_from"]

    def _enter(self, name: str, keys: Sequence[str]) -> None:
        with self.lock:
            self.calls[name] += 1
            self.log.append((name, list(keys)))
        self.entered[name].set()
        assert self.gates[name].wait(30), f"gate {name} never opened"

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        self._enter("batch_is_exist", keys)
        with self.lock:
            if self.exist_codes:
                return self.exist_codes.pop(0)
            return [1 if k in self.objects else 0 for k in keys]

    def batch_get_replica_desc(self, keys: Sequence[str]) -> dict[str, list[Any]]:
        self._enter("batch_get_replica_desc", keys)
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
        self._enter("batch_put_from", keys)
        with self.lock:
            codes = self.put_codes.pop(0) if self.put_codes else [0] * len(keys)
            for k, p, n, code in zip(keys, ptrs, sizes, codes, strict=False):
                if code == 0 and k not in self.objects:  # Mooncake keeps the old value
                    self.objects[k] = ctypes.string_at(p, n)
                    self.puts_per_key[k] += 1
        return codes

    def batch_get_into(
        self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        self._enter("batch_get_into", keys)
        with self.lock:
            if self.get_codes:
                return self.get_codes.pop(0)
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

    def remove_by_regex(self, pattern: str, force: bool = False) -> int:
        compiled = re.compile(pattern)
        with self.lock:
            doomed = [k for k in self.objects if compiled.search(k)]
            for k in doomed:
                del self.objects[k]
        return len(doomed)

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        with self.lock:
            return [0 if self.objects.pop(k, None) is not None else MISSING for k in keys]

    def register_buffer(self, ptr: int, nbytes: int) -> int:
        return 0

    def unregister_buffer(self, ptr: int) -> int:
        return 0

    def close(self) -> None:
        self.closed = True


class FakeMooncakeStorage(MooncakeStorage):
    """``MooncakeStorage`` over a :class:`FakeMooncakeClient` (no master, no network)."""

    def __init__(self, client: FakeMooncakeClient | None = None, **options: Any) -> None:
        options.setdefault("master", "127.0.0.1:1")
        options.setdefault("metadata_server", "http://127.0.0.1:1/metadata")
        super().__init__(**options)
        self.client = client if client is not None else FakeMooncakeClient()

    def open(self) -> None:
        """Install the fake client (no connection)."""
        with self._open_lock:
            self._store = self.client


class ChaosMooncakeClient(FakeMooncakeClient):
    """A :class:`FakeMooncakeClient` with seeded faults, for stress tests.

    Every put and get first sleeps up to ``max_delay`` seconds, or ``stall_seconds`` with
    probability ``stall``; then fails the whole batch (code ``-1``) with probability
    ``put_failure`` / ``get_failure``.  After a put that ran, with probability ``damage``
    another client damages a random stored object: flips one bit of it (70%) or removes it;
    its key goes into :attr:`damaged`.  :meth:`quiet` turns every fault off.
    """

    def __init__(
        self,
        seed: int,
        *,
        max_delay: float = 0.003,
        stall: float = 0.03,
        stall_seconds: float = 0.25,
        put_failure: float = 0.08,
        get_failure: float = 0.05,
        damage: float = 0.2,
    ) -> None:
        super().__init__()
        self._rng = random.Random(seed)
        self._rng_lock = threading.Lock()
        self.max_delay, self.stall, self.stall_seconds = max_delay, stall, stall_seconds
        self.put_failure, self.get_failure, self.damage = put_failure, get_failure, damage
        self.damaged: set[str] = set()  #: keys whose object was flipped or removed

    def quiet(self) -> None:
        """No more delays, stalls, failures or damage."""
        self.max_delay = self.stall = self.put_failure = self.get_failure = self.damage = 0.0

    def _roll(self) -> tuple[float, float, float]:
        with self._rng_lock:
            stall = self._rng.random() < self.stall
            delay = self.stall_seconds if stall else self._rng.uniform(0, self.max_delay)
            return delay, self._rng.random(), self._rng.random()

    def batch_put_from(
        self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        """The store's put, after this client's faults."""
        delay, fail, damage = self._roll()
        time.sleep(delay)  # a storage worker's thread, never the loop
        if fail < self.put_failure:
            return [-1] * len(keys)
        codes = super().batch_put_from(keys, ptrs, sizes)
        if damage < self.damage:
            self._damage_one()
        return codes

    def batch_get_into(
        self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        """The store's read, after this client's faults."""
        delay, fail, _ = self._roll()
        time.sleep(delay)
        if fail < self.get_failure:
            return [-1] * len(keys)
        return super().batch_get_into(keys, ptrs, sizes)

    def _damage_one(self) -> None:
        with self.lock, self._rng_lock:
            if not self.objects:
                return
            key = self._rng.choice(sorted(self.objects))
            if self._rng.random() < 0.7:
                obj = bytearray(self.objects[key])
                obj[self._rng.randrange(len(obj))] ^= 1 << self._rng.randrange(8)
                self.objects[key] = bytes(obj)
            else:
                del self.objects[key]
            self.damaged.add(key)
