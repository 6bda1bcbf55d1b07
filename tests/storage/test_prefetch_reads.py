"""prefetch_reads: a prefetch's reads handed to the workers without a turn of the loop where
a slot is free, in a task where none is; the workers take parts from one shared order (a
slow part holds up no other); what landed is reported before the wait ends; a read still
running at the prefetch's deadline is abandoned, not failed."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from typing import Any

from aiocache_kv.errors import StorageTimeoutError
from aiocache_kv.storage import PageBuffer, StorageIO
from aiocache_kv.storage.batch_reports import BatchReports, part_runner
from aiocache_kv.storage.prefetch_reads import TIMER_GRACE, _start
from tests.storage.test_executor import SLOT, GatedBackend, wait_entered


def start(
    io: StorageIO, n: int, rec: Recorder, timeout: float = 10.0, workers: int = 1
) -> list[asyncio.Future[None]]:
    """``n`` one-page parts read by ``workers`` runners sharing one order."""
    parts = [([f"k{i}"], [PageBuffer.allocate(SLOT)], None) for i in range(n)]
    reports = BatchReports(rec.report)
    order = iter(range(n))
    stop = time.monotonic() + timeout
    every = [b for _, bufs, _ in parts for b in bufs]
    return [
        _start(
            io,
            part_runner(io.backend.get_into, parts.__getitem__, order, reports, stop, 0.0),
            reports,
            every,
            timeout,
            rec.release,
        )
        for _ in range(workers)
    ]


class Recorder:
    def __init__(self) -> None:
        self.got: list[tuple[int, object]] = []
        self.released = 0

    def report(self, i: int, res: object) -> None:
        self.got.append((i, res))

    def release(self) -> None:
        self.released += 1


async def test_a_free_slot_hands_the_batches_over_before_the_loop_turns() -> None:
    """The worker is inside the first read before this coroutine ever yields; every batch
    is reported, in order, before the future ends, and the buffers are released once."""
    backend = GatedBackend()
    io = StorageIO(backend, workers=1)
    rec = Recorder()
    try:
        (fut,) = start(io, 3, rec)
        assert not isinstance(fut, asyncio.Task)
        assert backend.entered.acquire(timeout=5)  # blocking: the loop has not turned
        backend.gate.set()
        await fut
        assert [i for i, _ in rec.got] == [0, 1, 2] and all(r == [True] for _, r in rec.got)
        await io.drain()
        assert rec.released == 1
    finally:
        backend.gate.set()
        await io.aclose()


async def test_without_a_free_slot_the_batches_wait_for_one_in_a_task() -> None:
    backend = GatedBackend()
    io = StorageIO(backend, workers=1, max_pending=1)
    rec = Recorder()
    try:
        held = asyncio.ensure_future(io.exists(["x"]))
        await wait_entered(backend)
        (fut,) = start(io, 2, rec)
        assert isinstance(fut, asyncio.Task)
        await asyncio.sleep(0.02)
        assert rec.got == [] and backend.finished == 0
        backend.gate.set()
        assert await held == [True]
        await fut
        assert [i for i, _ in rec.got] == [0, 1]
    finally:
        backend.gate.set()
        await io.aclose()


async def test_the_wait_at_the_deadline_abandons_a_running_read() -> None:
    """The read outlives the deadline: a wait that ends at the deadline finds it still
    running (not failed); its own timer fails it only a grace later; its buffers are
    released when the worker lets go, and a batch not started by then never starts."""
    backend = GatedBackend()
    io = StorageIO(backend, workers=1)
    rec = Recorder()
    try:
        timeout = 0.1
        (fut,) = start(io, 2, rec, timeout)
        await wait_entered(backend)
        done, _ = await asyncio.wait([fut], timeout=timeout)
        assert not done
        await asyncio.sleep(TIMER_GRACE * 2)
        assert fut.done() and isinstance(fut.exception(), StorageTimeoutError)
        assert rec.released == 0  # the worker still holds the buffers
        backend.gate.set()
        await io.drain()
        assert rec.released == 1
        assert backend.finished == 1  # the second batch never started
    finally:
        backend.gate.set()
        await io.aclose()


class SlowFirst(GatedBackend):
    """Holds the read of ``k0`` at the gate; every other read returns at once, recording
    the thread that did it."""

    def __init__(self) -> None:
        super().__init__()
        self.readers: dict[str, str] = {}

    def get_into(self, keys: Sequence[str], buffers: Sequence[PageBuffer], **kw: Any) -> list[bool]:
        self.readers[keys[0]] = threading.current_thread().name
        if keys[0] == "k0":
            return super().get_into(keys, buffers)
        return [True for _ in keys]


async def test_the_workers_share_one_order_so_a_slow_part_holds_up_no_other() -> None:
    """Two workers, six parts: while part 0 is held, the other worker reads parts 1-5
    (with a fixed split, part 2 and 4 would wait behind part 0)."""
    backend = SlowFirst()
    io = StorageIO(backend, workers=2)
    rec = Recorder()
    try:
        futs = start(io, 6, rec, workers=2)
        await wait_entered(backend)
        for _ in range(500):
            if len(rec.got) == 5:
                break
            await asyncio.sleep(0.005)
        assert sorted(i for i, _ in rec.got) == [1, 2, 3, 4, 5]
        assert len({backend.readers[f"k{i}"] for i in range(1, 6)}) == 1
        assert backend.readers["k0"] != backend.readers["k1"]
        backend.gate.set()
        await asyncio.gather(*futs)
        assert sorted(i for i, _ in rec.got) == list(range(6))
    finally:
        backend.gate.set()
        await io.aclose()
