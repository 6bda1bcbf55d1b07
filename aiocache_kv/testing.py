"""Test helpers shipped with the package: fakes behind the real protocols, and a detector of
blocking calls on the event loop.

* :class:`ManualCopyEngine` - a :class:`~aiocache_kv.transfer.CopyEngine` whose copies run only
  when the test says so (``complete``/``fail``), in any order, for deterministic interleavings.
* :class:`BlockingCallDetector` - patches well-known blocking calls so that calling one on a
  thread that is running an asyncio loop raises :class:`~aiocache_kv.errors.BlockingCallError`
  (and is recorded, so a swallowed error still fails the test).
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import io
import os
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch

from aiocache_kv.errors import BlockingCallError
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
            caller = sys._getframe(2).f_code.co_filename
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


__all__ = ["BlockingCallDetector", "ManualCopyEngine", "RandomDelayEngine"]
