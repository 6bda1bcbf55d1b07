"""Copy engines for tests: completed by hand, or after seeded random delays."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

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
