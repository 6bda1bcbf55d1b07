"""StorageIO: deadlines, a loop that never blocks, cancellation, bounded work, buffer release."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from aiocache_kv.errors import (
    ConfigError,
    StorageError,
    StorageTimeoutError,
    StorageUnavailableError,
)
from aiocache_kv.storage import FRAME_OVERHEAD, FileStorage, PageBuffer, StorageIO, StorageStats

SLOT = 256 + FRAME_OVERHEAD


class GatedBackend:
    """A fake backend whose calls block until the test opens the gate (hand-triggered)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Semaphore(0)
        self.finished = 0
        self.fail: BaseException | None = None
        self.closed = False

    def _block(self) -> None:
        self.entered.release()
        assert self.gate.wait(10), "test never opened the gate"
        self.finished += 1
        if self.fail is not None:
            raise self.fail

    def open(self) -> None:
        pass

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self._block()
        return [True for _ in keys]

    def leading_hits(self, keys: Sequence[str]) -> int:
        return sum(self.exists(keys))

    def put(
        self,
        keys: Sequence[str],
        buffers: Sequence[PageBuffer],
        identities: Sequence[bytes] | None = None,
    ) -> list[bool]:
        self._block()
        return [True for _ in keys]

    def get_into(
        self,
        keys: Sequence[str],
        buffers: Sequence[PageBuffer],
        identities: Sequence[bytes] | None = None,
    ) -> list[bool]:
        self._block()
        for b in buffers:
            b.view[0] = 0x5A  # the worker writes into the caller's slot
        return [True for _ in keys]

    def remove(self, keys: Sequence[str]) -> list[bool]:
        return [False for _ in keys]

    def register_buffer(self, tensor: torch.Tensor) -> None:
        pass

    def statistics(self) -> StorageStats:
        return StorageStats()

    def close(self) -> None:
        self.closed = True


async def wait_entered(backend: GatedBackend, n: int = 1) -> None:
    for _ in range(n):
        assert await asyncio.to_thread(backend.entered.acquire, True, 5)


class LagProbe:
    """Measures the worst event-loop lag while a test awaits (a blocked loop shows up here)."""

    def __init__(self) -> None:
        self.max_lag = 0.0
        self.ticks = 0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(0.005)
            self.max_lag = max(self.max_lag, loop.time() - t - 0.005)
            self.ticks += 1

    def __enter__(self) -> LagProbe:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


async def test_deadline_raises_in_time_and_loop_stays_free() -> None:
    backend = GatedBackend()
    io = StorageIO(backend, workers=1, default_timeout=5.0)
    buf = PageBuffer.allocate(SLOT)
    loop = asyncio.get_running_loop()
    with LagProbe() as probe:
        t0 = loop.time()
        with pytest.raises(StorageTimeoutError):
            await io.get_into(["k"], [buf], timeout=0.2)
        elapsed = loop.time() - t0
    assert 0.19 <= elapsed < 1.0  # the 0.2 s deadline, not the 5 s default (slack: a loaded CI)
    assert probe.ticks >= 10 and probe.max_lag < 0.1
    # The worker still holds the slot: the caller must not reuse it yet.
    assert io.holds([buf]) and io.io_statistics().in_flight == 1
    backend.gate.set()
    await asyncio.wait_for(io.wait_released([buf]), 5)
    assert not io.holds([buf])
    st = io.io_statistics()
    assert (st.timeouts, st.late_results, st.in_flight, st.completed) == (1, 1, 0, 1)
    await io.aclose()


async def test_cancel_discards_late_result() -> None:
    backend = GatedBackend()
    io = StorageIO(backend, workers=1)
    buf = PageBuffer.allocate(SLOT)
    task = asyncio.create_task(io.get_into(["k"], [buf], timeout=5))
    await wait_entered(backend)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert io.holds([buf])
    backend.gate.set()
    await asyncio.wait_for(io.drain(), 5)
    st = io.io_statistics()
    assert (st.cancelled, st.late_results, st.in_flight) == (1, 1, 0)
    assert buf.view[0] == 0x5A  # the worker did write: that is why wait_released exists
    await io.aclose()


async def test_late_failure_after_timeout_is_discarded() -> None:
    backend = GatedBackend()
    backend.fail = OSError("disk on fire")
    io = StorageIO(backend, workers=1)
    with pytest.raises(StorageTimeoutError):
        await io.exists(["k"], timeout=0.05)
    backend.gate.set()
    await io.drain()
    assert io.io_statistics().late_results == 1
    await io.aclose()


async def test_stuck_workers_bound_the_backlog() -> None:
    backend = GatedBackend()
    io = StorageIO(backend, workers=1, max_pending=2)
    # Two calls whose callers give up: their slots stay taken until the worker finishes.
    for _ in range(2):
        with pytest.raises(StorageTimeoutError):
            await io.exists(["k"], timeout=0.05)
    assert io.io_statistics().in_flight == 2
    # A third caller cannot even get a slot: it times out without submitting work.
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(StorageTimeoutError):
        await io.exists(["k"], timeout=0.1)
    assert loop.time() - t0 < 0.3
    st = io.io_statistics()
    assert (st.submitted, st.in_flight, st.timeouts) == (2, 2, 3)
    backend.gate.set()  # the store comes back: the pool recovers by itself
    await io.drain()
    assert await io.exists(["a", "b"], timeout=2) == [True, True]
    assert io.io_statistics().in_flight == 0
    await io.aclose()


async def test_start_hands_a_call_over_without_a_task() -> None:
    """``start``: the call reaches a worker at once (no task, no await); its outcome comes
    to ``on_done``, a timeout first and the worker's late answer dropped; ``on_release``
    runs when the worker returns; with every slot taken nothing is handed over."""
    backend = GatedBackend()
    io = StorageIO(backend, workers=1, max_pending=1)
    buf = PageBuffer.allocate(SLOT)
    outcomes: list[asyncio.Future[object]] = []
    released: list[int] = []
    assert io.start(
        "put",
        backend.put,
        ["k"],
        [buf],
        timeout=0.1,
        on_done=outcomes.append,
        buffers=[buf],
        on_release=lambda: released.append(1),
    )
    assert io.io_statistics().submitted == 1 and io.holds([buf])  # handed over already
    # the only slot is taken: nothing is handed over, on_release does not run
    assert not io.start("put", backend.put, ["j"], [buf], timeout=1.0, on_done=outcomes.append)
    await wait_entered(backend)
    await _until(lambda: bool(outcomes))
    assert isinstance(outcomes[0].exception(), StorageTimeoutError) and not released
    assert io.holds([buf])  # the worker still reads it
    backend.gate.set()
    await asyncio.wait_for(io.wait_released([buf]), 5)
    assert released == [1] and len(outcomes) == 1  # the late answer is dropped
    assert io.io_statistics().late_results == 1
    assert io.start("exists", backend.exists, ["k"], timeout=1.0, on_done=outcomes.append)
    await _until(lambda: len(outcomes) == 2)
    assert outcomes[1].result() == [True]
    await io.aclose()
    assert not io.start("exists", backend.exists, ["k"], timeout=1.0, on_done=outcomes.append)


async def _until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "condition never held"
        await asyncio.sleep(0.005)


async def test_cancel_while_waiting_for_a_slot_returns_it() -> None:
    backend = GatedBackend()
    io = StorageIO(backend, workers=1, max_pending=1)
    first = asyncio.create_task(io.exists(["a"], timeout=5))
    await wait_entered(backend)
    waiter = asyncio.create_task(io.exists(["b"], timeout=5))
    await asyncio.sleep(0)
    assert io.io_statistics().waiting == 1
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    backend.gate.set()
    assert await first == [True]
    assert await io.exists(["c"], timeout=2) == [True]  # the slot was not leaked
    st = io.io_statistics()
    assert (st.in_flight, st.waiting, st.cancelled, st.submitted) == (0, 0, 1, 2)
    await io.aclose()


async def test_grant_then_cancel_hands_the_slot_back() -> None:
    backend = GatedBackend()
    io = StorageIO(backend, workers=1, max_pending=1)
    first = asyncio.create_task(io.exists(["a"], timeout=5))
    await wait_entered(backend)
    waiter = asyncio.create_task(io.exists(["b"], timeout=5))
    await asyncio.sleep(0)
    backend.gate.set()
    await first  # _finish granted the slot to the waiter; cancel it before it resumes
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await io.drain()
    assert await io.exists(["c"], timeout=2) == [True]
    assert io.io_statistics().in_flight == 0
    await io.aclose()


async def test_errors_are_typed() -> None:
    backend = GatedBackend()
    backend.gate.set()
    io = StorageIO(backend, workers=2)
    backend.fail = StorageUnavailableError("master down")
    with pytest.raises(StorageUnavailableError, match="master down"):
        await io.put(["k"], [PageBuffer.allocate(SLOT)])
    backend.fail = OSError("EIO")
    with pytest.raises(StorageError) as info:
        await io.exists(["k"])
    assert isinstance(info.value.__cause__, OSError)
    await io.aclose()
    assert backend.closed
    with pytest.raises(StorageUnavailableError):
        await io.exists(["k"])


async def test_concurrent_calls_through_a_real_file_backend(tmp_path: Path) -> None:
    io = StorageIO(FileStorage(tmp_path), workers=2, max_pending=4)
    await io.open()
    pool = torch.randint(0, 256, (32 * SLOT,), dtype=torch.uint8)
    bufs = [PageBuffer.from_tensor(pool[i * SLOT : (i + 1) * SLOT]) for i in range(32)]
    keys = [f"k{i}" for i in range(32)]
    results = await asyncio.gather(
        *(io.put(keys[i : i + 4], bufs[i : i + 4]) for i in range(0, 32, 4))
    )
    assert all(all(r) for r in results)
    out = torch.zeros_like(pool)
    dst = [PageBuffer.from_tensor(out[i * SLOT : (i + 1) * SLOT]) for i in range(32)]
    got = await asyncio.gather(
        *(io.get_into(keys[i : i + 8], dst[i : i + 8]) for i in range(0, 32, 8))
    )
    assert all(all(r) for r in got) and torch.equal(out, pool)
    assert await io.leading_hits([*keys, "missing"]) == 32
    assert io.statistics().hits == 32
    await io.aclose()


class ScriptedBackend(GatedBackend):
    """``get_into`` of batch ``i`` (numbered by call): fails for ``fail_at``, blocks on the
    gate for ``block_at``, else marks its slots and reports every key present."""

    def __init__(self, fail_at: int = -1, block_at: int = -1) -> None:
        super().__init__()
        self.calls = 0
        self.fail_at, self.block_at = fail_at, block_at
        self.threads: set[int] = set()

    def get_into(
        self,
        keys: Sequence[str],
        buffers: Sequence[PageBuffer],
        identities: Sequence[bytes] | None = None,
    ) -> list[bool]:
        i = self.calls
        self.calls += 1
        self.threads.add(threading.get_ident())
        if i == self.block_at:
            self._block()
        if i == self.fail_at:
            raise OSError(f"batch {i} failed")
        for b in buffers:
            b.view[0] = i
        return [True for _ in keys]


def _batches(n: int, size: int) -> list[tuple[list[str], list[PageBuffer], None]]:
    return [
        (
            [f"k{i}-{j}" for j in range(size)],
            [PageBuffer.allocate(SLOT) for _ in range(size)],
            None,  # no identities: the backend binds each page to its key
        )
        for i in range(n)
    ]


async def test_batches_report_in_order_on_the_loop_and_survive_a_failure() -> None:
    backend = ScriptedBackend(fail_at=2)
    io = StorageIO(backend, workers=2)
    loop_thread = threading.get_ident()
    seen: list[tuple[int, object, int]] = []
    released: list[bool] = []
    batches = _batches(5, 3)
    await io.get_into_batches(
        batches,
        lambda i, res: seen.append((i, res, threading.get_ident())),
        on_release=lambda: released.append(True),
    )
    assert [i for i, _, _ in seen] == [0, 1, 2, 3, 4]  # all reported before the await ends
    assert all(t == loop_thread for _, _, t in seen)  # never from the worker thread
    assert isinstance(seen[2][1], OSError) and "batch 2" in str(seen[2][1])
    assert [res for i, res, _ in seen if i != 2] == [[True] * 3] * 4
    assert len(backend.threads) == 1  # one hand-off: every batch on one worker
    assert released == [True] and not io.holds([b for _, bufs, _ in batches for b in bufs])
    assert [bufs[0].view[0] for _, bufs, _ in batches] == [0, 1, 0, 3, 4]  # 2 wrote nothing
    await io.aclose()


async def test_batches_past_the_deadline_are_skipped_and_buffers_held() -> None:
    """A store that stalls in batch 1: the call times out at its deadline with batch 0
    reported, the buffers stay the worker's until the stalled batch returns, and the batches
    after it never start (the deadline passed) nor get reported."""
    backend = ScriptedBackend(block_at=1)
    io = StorageIO(backend, workers=1)
    seen: list[int] = []
    released: list[bool] = []
    batches = _batches(4, 2)
    bufs = [b for _, bs, _ in batches for b in bs]
    with pytest.raises(StorageTimeoutError):
        await io.get_into_batches(
            batches,
            lambda i, res: seen.append(i),
            timeout=0.2,
            on_release=lambda: released.append(True),
        )
    assert seen == [0] and not released and io.holds(bufs)
    backend.gate.set()
    await asyncio.wait_for(io.wait_released(bufs), 5)
    assert released == [True] and backend.calls == 2  # batches 2 and 3 never started
    assert seen == [0, 1]  # the stalled batch still reports (the caller ignores it)
    await io.aclose()


def test_bad_config() -> None:
    with pytest.raises(ConfigError):
        StorageIO(GatedBackend(), workers=0)
    with pytest.raises(ConfigError):
        StorageIO(GatedBackend(), workers=4, max_pending=2)
    with pytest.raises(ConfigError):
        StorageIO(GatedBackend(), default_timeout=0)
