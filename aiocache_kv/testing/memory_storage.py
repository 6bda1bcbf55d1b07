"""``MemoryStorage``: an in-memory ``StorageBackend`` with seeded fault injection."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence

import torch

from aiocache_kv.errors import StorageUnavailableError
from aiocache_kv.storage import integrity
from aiocache_kv.storage.base import PageBuffer, StatsCounter, StorageStats, leading_run
from aiocache_kv.storage.keys import check_keys, check_tag


class MemoryStorage:
    """An in-memory, thread-safe :class:`~aiocache_kv.storage.base.StorageBackend` for tests.

    Pages are kept as whole sealed slots (``payload | trailer``): ``put`` seals each slot with
    :mod:`~aiocache_kv.storage.integrity` and stores a copy of its bytes; ``get_into`` copies
    them back and verifies them (a failing page is a miss, counted ``corrupt`` and deleted, as
    the file backend does).  The caller's buffers are used only during the call: every call
    first waits (its gate, then a seeded random delay or stall) and only then reads or writes
    them, which models a worker that starts late - e.g. after the caller's deadline.

    Fault injection (all seeded; probabilities per call or per key as named):

    * ``max_delay``: uniform delay before every call; ``stall_probability`` /
      ``stall_seconds``: sometimes a long stall instead (make it exceed the cache's
      ``storage_timeout`` to exercise late completions);
    * ``put_failure`` / ``get_failure``: per key, the key fails (``False``) in that call;
      ``fail_put_keys`` / ``fail_get_keys``: keys that always fail;
    * ``vanish``: per ``exists``/``get_into`` call, one random stored key silently disappears
      (a store evicting behind the cache's back); ``capacity_pages``: LRU eviction;
    * ``corrupt``: per stored page, the stored copy gets one byte flipped;
      :meth:`corrupt_key` / :meth:`drop` do the same by hand;
    * ``gates``: per method (``"put"``, ``"get_into"``, ``"exists"``, ``"remove"``,
      ``"remove_tag"``) a ``threading.Event`` that a call waits on (at most ``gate_timeout``
      s) before anything else: clear one to hold calls deterministically, set it to let them
      go; ``entered[method]`` is set when a call reaches its gate.

    Keys dropped or damaged behind the cache's back are listed in ``dropped`` / ``corrupted``.
    ``contents()`` / ``payload(key)`` expose the raw bytes.  The worker threads draw from one
    locked RNG, so with several workers the order of draws (not the set of fault rates)
    depends on thread timing.  ``close`` keeps the data: a new cache can :meth:`open` it again.
    """

    _FAULTS = (
        "max_delay",
        "stall_probability",
        "stall_seconds",
        "put_failure",
        "get_failure",
        "vanish",
        "corrupt",
    )

    #: one object may serve several caches at once, as one store serves several nodes (no
    #: per-user state; see ``aiocache_kv.storage.owners``); its ``close`` closes it for all
    multi_user = True

    def __init__(
        self,
        seed: int = 0,
        *,
        max_delay: float = 0.0,
        stall_probability: float = 0.0,
        stall_seconds: float = 0.0,
        put_failure: float = 0.0,
        get_failure: float = 0.0,
        vanish: float = 0.0,
        corrupt: float = 0.0,
        capacity_pages: int | None = None,
        gate_timeout: float = 30.0,
    ) -> None:
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._data: dict[str, bytes] = {}  # insertion order = LRU order (oldest first)
        self._stats = StatsCounter()
        self._closed = False
        self.capacity_pages = capacity_pages
        self.gate_timeout = gate_timeout
        gated = ("put", "get_into", "exists", "remove", "remove_tag")
        self.gates = {name: threading.Event() for name in gated}
        self.entered = {name: threading.Event() for name in gated}
        for gate in self.gates.values():
            gate.set()
        self.fail_put_keys: set[str] = set()
        self.fail_get_keys: set[str] = set()
        self.dropped: set[str] = set()  #: keys that vanished, were evicted or found corrupt
        self.corrupted: set[str] = set()  #: keys whose stored bytes were damaged on purpose
        self.calls: dict[str, int] = dict.fromkeys(("put", "get_into", "exists", "remove"), 0)
        self.max_delay = max_delay
        self.stall_probability = stall_probability
        self.stall_seconds = stall_seconds
        self.put_failure = put_failure
        self.get_failure = get_failure
        self.vanish = vanish
        self.corrupt = corrupt

    def __repr__(self) -> str:
        return f"MemoryStorage(pages={len(self._data)}, closed={self._closed})"

    def set_faults(self, **faults: float) -> None:
        """Change fault knobs (names as in the constructor); ``quiet()`` turns all off."""
        for name, value in faults.items():
            if name not in self._FAULTS:
                raise TypeError(f"unknown fault {name!r}; known: {self._FAULTS}")
            setattr(self, name, value)

    def quiet(self) -> None:
        """No more delays or injected faults (stored data and gates unchanged)."""
        self.set_faults(**dict.fromkeys(self._FAULTS, 0.0))

    # -- inspection ----------------------------------------------------------------------------

    def contents(self) -> dict[str, bytes]:
        """A copy of every stored slot (payload and trailer), by key."""
        with self._lock:
            return dict(self._data)

    def payload(self, key: str) -> bytes | None:
        """The stored payload of ``key`` (the slot without its trailer), or ``None``."""
        with self._lock:
            raw = self._data.get(key)
        return None if raw is None else raw[: len(raw) - integrity.FRAME_OVERHEAD]

    def corrupt_key(self, key: str, offset: int = 0) -> None:
        """Flip one payload byte of stored ``key`` (``KeyError`` if absent)."""
        with self._lock:
            raw = bytearray(self._data[key])
            raw[offset] ^= 0xFF
            self._data[key] = bytes(raw)
            self.corrupted.add(key)

    def drop(self, key: str) -> bool:
        """Make ``key`` disappear silently (as a store evicting it); ``True`` if present."""
        with self._lock:
            present = self._data.pop(key, None) is not None
            if present:
                self.dropped.add(key)
        if present:
            self._stats.add(removed=1, evictions=1)
        return present

    # -- helpers -------------------------------------------------------------------------------

    def _ensure_open(self) -> None:
        if self._closed:
            raise StorageUnavailableError("MemoryStorage is closed")

    def _chance(self, p: float) -> bool:
        return p > 0 and self._rng.random() < p

    def _pause(self, method: str) -> None:
        """Wait for the method's gate, then a random delay (worker thread: may block)."""
        self.entered[method].set()
        self.gates[method].wait(self.gate_timeout)
        with self._lock:
            self.calls[method] += 1
            if self._chance(self.stall_probability):
                delay = self.stall_seconds
            else:
                delay = self._rng.uniform(0, self.max_delay) if self.max_delay > 0 else 0.0
        if delay > 0:
            time.sleep(delay)

    def _vanish_one(self) -> None:
        with self._lock:
            if not self._data or not self._chance(self.vanish):
                return
            key = self._rng.choice(list(self._data))
            del self._data[key]
            self.dropped.add(key)
        self._stats.add(removed=1, evictions=1)

    # -- StorageBackend ------------------------------------------------------------------------

    def open(self) -> None:
        """(Re)open: the data survives a ``close``."""
        self._closed = False

    def close(self) -> None:
        """Refuse calls until :meth:`open`; the data is kept."""
        self._closed = True

    def register_buffer(self, tensor: torch.Tensor) -> None:
        """Nothing to register."""

    def statistics(self) -> StorageStats:
        """Frozen snapshot of the counters."""
        return self._stats.snapshot()

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Per key: present?"""
        check_keys(keys)
        self._ensure_open()
        self._pause("exists")
        self._vanish_one()
        with self._lock:
            return [k in self._data for k in keys]

    def leading_hits(self, keys: Sequence[str]) -> int:
        """Leading run of present keys."""
        return leading_run(self.exists(keys))

    def put(
        self,
        keys: Sequence[str],
        buffers: Sequence[PageBuffer],
        identities: Sequence[bytes] | None = None,
    ) -> list[bool]:
        """Seal (binding ``identities``) and store each slot (after the delay); present keys
        are skipped."""
        integrity.check_batch(keys, buffers)
        idents = integrity.identities_for(keys, identities)
        self._ensure_open()
        self._pause("put")
        n = len(keys)
        results = [False] * n
        todo: list[int] = []
        first: dict[str, int] = {}
        skipped = 0
        with self._lock:
            for i, key in enumerate(keys):
                if key in self.fail_put_keys or self._chance(self.put_failure):
                    continue
                if key in self._data:
                    results[i] = True
                    skipped += 1
                elif key in first:
                    continue  # rides along with its first occurrence below
                else:
                    first[key] = i
                    todo.append(i)
        integrity.seal_checked(
            [buffers[i] for i in todo], [keys[i] for i in todo], [idents[i] for i in todo]
        )
        written = 0
        evicted = 0
        with self._lock:
            for i in todo:
                raw = bytes(buffers[i].view)
                self.corrupted.discard(keys[i])
                if self._chance(self.corrupt):
                    damaged = bytearray(raw)
                    damaged[self._rng.randrange(len(raw) - integrity.FRAME_OVERHEAD)] ^= 0xFF
                    raw = bytes(damaged)
                    self.corrupted.add(keys[i])
                self._data.pop(keys[i], None)
                self._data[keys[i]] = raw
                self.dropped.discard(keys[i])
                written += len(raw)
                results[i] = True
            while self.capacity_pages is not None and len(self._data) > self.capacity_pages:
                victim = next(iter(self._data))
                del self._data[victim]
                self.dropped.add(victim)
                evicted += 1
            for i, key in enumerate(keys):
                j = first.get(key, i)
                if j != i and results[j] and not results[i]:
                    results[i] = True
                    skipped += 1
        ok = len(todo)
        self._stats.add(
            puts=n,
            put_ok=ok,
            put_skipped=skipped,
            put_failed=n - sum(results),
            bytes_written=written,
            evictions=evicted,
            removed=evicted,
        )
        return results

    def get_into(
        self,
        keys: Sequence[str],
        buffers: Sequence[PageBuffer],
        identities: Sequence[bytes] | None = None,
    ) -> list[bool]:
        """Copy each present key into its slot (after the delay) and verify it (against
        ``identities``)."""
        integrity.check_batch(keys, buffers)
        idents = integrity.identities_for(keys, identities)
        self._ensure_open()
        self._pause("get_into")
        self._vanish_one()
        n = len(keys)
        results = [False] * n
        read: list[int] = []
        sizes: list[int] = []
        misses = failed = 0
        for i, key in enumerate(keys):
            with self._lock:
                fail = key in self.fail_get_keys or self._chance(self.get_failure)
                raw = None if fail else self._data.get(key)
            if fail:
                failed += 1
                continue
            if raw is None:
                misses += 1
                continue
            m = min(len(raw), buffers[i].nbytes)
            buffers[i].view[:m] = raw[:m]
            read.append(i)
            sizes.append(len(raw))
        verdicts = integrity.verify_many(
            [buffers[i] for i in read],
            [keys[i] for i in read],
            list(sizes),
            [idents[i] for i in read],
        )
        corrupt: list[tuple[str, integrity.Verdict]] = []
        nbytes = 0
        for i, verdict in zip(read, verdicts, strict=True):
            if verdict is integrity.Verdict.OK:
                results[i] = True
                nbytes += buffers[i].nbytes
                continue
            corrupt.append((keys[i], verdict))
            with self._lock:
                if self._data.pop(keys[i], None) is not None:
                    self.dropped.add(keys[i])
        self._stats.add(
            gets=n,
            hits=len(read) - len(corrupt),
            misses=misses,
            corrupt=len(corrupt),
            get_failed=failed,
            bytes_read=nbytes,
            removed=len(corrupt),
        )
        integrity.log_failures("memory", corrupt)
        return results

    def remove_tag(self, tag: str) -> int:
        """Delete every key ``"{tag}/..."``; how many were present."""
        prefix = check_tag(tag) + "/"
        self.entered["remove_tag"].set()
        self.gates["remove_tag"].wait(self.gate_timeout)
        self._ensure_open()
        with self._lock:
            self.calls["remove_tag"] = self.calls.get("remove_tag", 0) + 1
            doomed = [k for k in self._data if k.startswith(prefix)]
            for k in doomed:
                del self._data[k]
        self._stats.add(removed=len(doomed))
        return len(doomed)

    def remove(self, keys: Sequence[str]) -> list[bool]:
        """Delete keys; per key ``True`` if it was present."""
        check_keys(keys)
        self.entered["remove"].set()
        self.gates["remove"].wait(self.gate_timeout)
        self._ensure_open()
        with self._lock:
            self.calls["remove"] += 1
            out = [self._data.pop(k, None) is not None for k in keys]
        self._stats.add(removed=sum(out))
        return out
