"""Test helpers shipped with the package: fakes behind the real protocols, and a detector of
blocking calls on the event loop.

* :class:`ManualCopyEngine` - a :class:`~aiocache_kv.transfer.CopyEngine` whose copies run only
  when the test says so (``complete``/``fail``), in any order, for deterministic interleavings.
* :class:`MemoryStorage` - an in-memory, thread-safe
  :class:`~aiocache_kv.storage.base.StorageBackend` that seals on put and verifies on get, with
  seeded fault injection (delays and stalls, per-key put/get failures, keys that vanish,
  corrupted pages) and raw inspection of what it holds.
* :class:`BlockingCallDetector` - patches well-known blocking calls so that calling one on a
  thread that is running an asyncio loop raises :class:`~aiocache_kv.errors.BlockingCallError`
  (and is recorded, so a swallowed error still fails the test).
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import inspect
import io
import os
import random
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import torch

from aiocache_kv.errors import BlockingCallError, StorageUnavailableError
from aiocache_kv.storage import integrity
from aiocache_kv.storage.base import PageBuffer, StatsCounter, StorageStats, leading_run
from aiocache_kv.storage.keys import check_keys
from aiocache_kv.transfer.engine import CopyJob, Done, ThreadCopyEngine


class ManualCopyEngine:
    """Copy engine for tests: jobs wait in ``pending`` until completed by hand.

    ``aclose`` completes whatever is still pending, so a cache always closes cleanly.
    """

    def __init__(self) -> None:
        self.pending: list[tuple[CopyJob, Done]] = []
        self.completed = 0

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Nothing to start."""

    def submit(self, job: CopyJob, done: Done) -> None:
        """Park ``job`` until :meth:`complete` or :meth:`fail`."""
        self.pending.append((job, done))

    def complete(self, index: int = 0) -> None:
        """Run the copy of pending job ``index`` and deliver its completion now."""
        job, done = self.pending.pop(index)
        job.run()
        self.completed += 1
        done(None)

    def fail(self, index: int = 0, error: BaseException | None = None) -> None:
        """Deliver a failure for pending job ``index`` without copying."""
        _, done = self.pending.pop(index)
        done(error if error is not None else RuntimeError("injected copy failure"))

    def complete_all(self) -> None:
        """Complete every pending job in submission order."""
        while self.pending:
            self.complete(0)

    async def aclose(self) -> None:
        """Complete every pending job."""
        self.complete_all()


_ASYNCIO_BASE = os.path.join("asyncio", "base_events.py")


class RandomDelayEngine(ThreadCopyEngine):
    """The real CPU copy engine with a seeded random delay before each copy.

    Completions then arrive in a different order and at different times on every rank: the
    interleavings that tensor-parallel agreement must make harmless.
    """

    def __init__(self, seed: int, max_delay: float = 0.02) -> None:
        super().__init__("aiocache-kv-random-copy")
        self._rng = random.Random(seed)
        self._max_delay = max_delay

    def submit(self, job: Any, done: Done) -> None:
        """Queue ``job`` behind a random delay."""
        delay = self._rng.uniform(0, self._max_delay)
        super().submit(_Delayed(job, delay), done)


class _Delayed:
    def __init__(self, job: Any, delay: float) -> None:
        self.job = job
        self.delay = delay

    def run(self, *, non_blocking: bool = False) -> None:
        time.sleep(self.delay)  # on the copy worker thread, never on the loop
        self.job.run(non_blocking=non_blocking)


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
    * ``gates``: per method (``"put"``, ``"get_into"``, ``"exists"``) a ``threading.Event``
      that a call waits on (at most ``gate_timeout`` s) before anything else: clear one to
      hold calls deterministically, set it to let them go.

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
        self.gates = {name: threading.Event() for name in ("put", "get_into", "exists")}
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

    def put(self, keys: Sequence[str], buffers: Sequence[PageBuffer]) -> list[bool]:
        """Seal and store each slot (after the delay); present keys are skipped."""
        integrity.check_batch(keys, buffers)
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
        integrity.seal_many([buffers[i] for i in todo], [keys[i] for i in todo])
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

    def get_into(self, keys: Sequence[str], buffers: Sequence[PageBuffer]) -> list[bool]:
        """Copy each present key into its slot (after the delay) and verify it."""
        integrity.check_batch(keys, buffers)
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
            [buffers[i] for i in read], [keys[i] for i in read], list(sizes)
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

    def remove(self, keys: Sequence[str]) -> list[bool]:
        """Delete keys; per key ``True`` if it was present."""
        check_keys(keys)
        self._ensure_open()
        with self._lock:
            self.calls["remove"] += 1
            out = [self._data.pop(k, None) is not None for k in keys]
        self._stats.add(removed=sum(out))
        return out


def _caller_file(depth: int) -> str:
    """File name of the frame ``depth`` levels above this function's caller."""
    frame = inspect.currentframe()
    for _ in range(depth):
        if frame is None:
            return ""
        frame = frame.f_back
    return frame.f_code.co_filename if frame is not None else ""


def _on_loop_thread() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class BlockingCallDetector:
    """Context manager: blocking calls made on a running loop's thread raise and are recorded."""

    def __init__(self) -> None:
        self.violations: list[str] = []
        self._saved: list[tuple[Any, str, Any]] = []

    def _guard(self, owner: Any, name: str, blocks: Callable[..., bool] | None = None) -> None:
        original = getattr(owner, name)
        detector = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if _on_loop_thread() and (blocks is None or blocks(*args, **kwargs)):
                what = f"{getattr(owner, '__name__', owner)}.{name}"
                detector.violations.append(what)
                raise BlockingCallError(f"blocking call {what}() on the event-loop thread")
            return original(*args, **kwargs)

        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        self._saved.append((owner, name, original))
        setattr(owner, name, wrapper)

    def __enter__(self) -> BlockingCallDetector:
        def sock_blocks(sock: socket.socket, *a: Any, **k: Any) -> bool:
            return sock.gettimeout() != 0.0

        def fut_blocks(fut: concurrent.futures.Future[Any], timeout: float | None = None) -> bool:
            return not fut.done() and timeout != 0

        def wait_blocks(obj: Any, timeout: float | None = None, *a: Any, **k: Any) -> bool:
            return timeout != 0

        def join_blocks(thread: threading.Thread, timeout: float | None = None) -> bool:
            # asyncio's own shutdown_default_executor joins a finished helper thread
            caller = _caller_file(3)
            return thread.is_alive() and timeout != 0 and not caller.endswith(_ASYNCIO_BASE)

        def sleep_blocks(seconds: float) -> bool:
            return seconds > 0

        self._guard(time, "sleep", sleep_blocks)

        def open_blocks(file: object, *a: Any, **k: Any) -> bool:
            return not isinstance(file, int)  # wrapping a pipe's fd (asyncio subprocess) is fine

        self._guard(builtins, "open", open_blocks)
        self._guard(io, "open", open_blocks)
        self._guard(os, "fsync")
        for meth in ("connect", "recv", "recv_into", "send", "sendall", "accept"):
            self._guard(socket.socket, meth, sock_blocks)
        self._guard(concurrent.futures.Future, "result", fut_blocks)
        # (threading.Event.wait is left alone: Thread.start waits on one, briefly)
        self._guard(threading.Thread, "join", join_blocks)
        self._guard(subprocess.Popen, "wait", wait_blocks)
        self._guard(subprocess.Popen, "communicate")
        self._guard(subprocess, "run")
        self._guard(urllib.request, "urlopen")
        self._guard(torch.cuda, "synchronize")
        self._guard(torch.cuda.Event, "synchronize")
        self._guard(torch.cuda.Stream, "synchronize")
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()


__all__ = ["BlockingCallDetector", "ManualCopyEngine", "MemoryStorage", "RandomDelayEngine"]
