"""CPU page copies on idle helpers (``CacheConfig.worker_idle``, ``storage/_idlerun.h``).

The copy worker hands each large CPU copy to C threads under ``SCHED_IDLE`` and relieves them
when they starve.  These tests check the bytes (plain and fused copies, against the copy the
worker makes itself), the helpers' policy, the relief with every core taken by a CPU hog, and
a forked child's copies.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from aiocache_kv.priority import (
    IDLE_INLINE_BYTES,
    copy_on_idle_helpers,
    forget_idle_starvation,
    idle_copies,
    idle_helpers_ready,
    idle_relief_ns,
)
from aiocache_kv.storage import deferred, presum
from aiocache_kv.transfer.copy import device_to_host, host_to_device

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="SCHED_IDLE is Linux's")

LAYERS, ELEMS = 4, 4096  # 128 KiB pages of float32 K and V
PAGE = LAYERS * 2 * ELEMS * 4


def _ext_built() -> None:
    assert presum.FUSED, "the C extension (aiocache_kv.storage._blocksum) is not built"


@pytest.fixture(autouse=True)
def _fresh_adaptation() -> Iterator[None]:
    """Each test starts without an earlier one's starvation history, and leaves none."""
    forget_idle_starvation()
    yield
    forget_idle_starvation()


#: a deadline no copy here reaches unless its helpers starve for seconds (the machine may be
#: busy: a relief would not change the bytes, but these tests count copies on the helpers)
PATIENT = 5.0


@contextlib.contextmanager
def on_idle_helpers(relief_s: float = PATIENT) -> Iterator[None]:
    copy_on_idle_helpers(relief_s)
    try:
        yield
    finally:
        copy_on_idle_helpers(None)


def _policies() -> dict[int, int]:
    """Every thread of this process: its scheduling policy."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            out[int(tid)] = os.sched_getscheduler(int(tid))
    return out


def _pages(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYERS, 2, n, ELEMS, generator=g), torch.zeros(n, LAYERS, 2, ELEMS)


@pytest.mark.parametrize("order", ["runs", "scattered"])
def test_idle_copies_equal_the_workers_own(order: str) -> None:
    """8 MiB each way on idle helpers: byte for byte what torch copies, counted as idle."""
    _ext_built()
    n = 64
    dev, host = _pages(n, seed=1)
    g = torch.Generator().manual_seed(2)
    src = torch.arange(n) if order == "runs" else torch.randperm(n, generator=g)
    dst = torch.arange(n) if order == "runs" else torch.randperm(n, generator=g)
    before = idle_copies()
    with on_idle_helpers():
        assert idle_relief_ns() == 5_000_000_000
        device_to_host(dev, host, src, dst)
        back = torch.zeros_like(dev)
        host_to_device(host, back, dst, src)
    assert idle_relief_ns() == 0
    assert torch.equal(host[dst], dev[:, :, src].permute(2, 0, 1, 3))
    assert torch.equal(back, dev)
    assert idle_copies().copies - before.copies == 2


def test_a_small_copy_stays_on_the_worker() -> None:
    """At most IDLE_INLINE_BYTES: two wake-ups would cost what the copy does."""
    _ext_built()
    n = IDLE_INLINE_BYTES // PAGE
    dev, host = _pages(n, seed=3)
    before = idle_copies()
    with on_idle_helpers():
        device_to_host(dev, host, torch.arange(n), torch.arange(n))
    assert torch.equal(host, dev.permute(2, 0, 1, 3))
    assert idle_copies().copies == before.copies


def test_fused_copies_on_idle_helpers_sum_and_verify_like_the_worker() -> None:
    """The backup's copy with its checksums and the load-back's verifying copy: the same sums
    as at once, and the first failing page found across chunks helpers took out of order."""
    _ext_built()
    n, slot = 48, PAGE + 64
    dev, _ = _pages(n, seed=4)
    raw = torch.zeros(n, slot, dtype=torch.uint8)
    ids = np.random.default_rng(5).permutation(n).astype(np.int64)
    want = np.zeros((n, 3), dtype=np.uint64)
    got = np.zeros((n, 3), dtype=np.uint64)
    assert presum.copy_to_host(dev, raw, PAGE, ids, ids, want)  # at once: the reference
    before = idle_copies()
    with on_idle_helpers():
        assert presum.copy_to_host(dev, raw, PAGE, ids, ids, got)
        expect = got[ids].copy()  # by position
        back = torch.zeros_like(dev)
        tids = torch.from_numpy(ids)
        assert deferred.copy_to_device(raw, PAGE, back, tids, tids, expect) == -1
        for bad in ([41], [7, 30, 45], [2, 3]):
            wrong = expect.copy()
            wrong[bad, 0] += np.uint64(1)
            assert deferred.copy_to_device(raw, PAGE, back, tids, tids, wrong) == bad[0], bad
    np.testing.assert_array_equal(got, want)
    assert torch.equal(back, dev)
    assert idle_copies().copies - before.copies == 5


def test_helpers_run_under_sched_idle_and_the_caller_does_not() -> None:
    _ext_built()
    dev, host = _pages(64, seed=6)
    me = threading.get_native_id()
    mine = os.sched_getscheduler(me)
    with on_idle_helpers():
        device_to_host(dev, host, torch.arange(64), torch.arange(64))
    policies = _policies()
    assert os.SCHED_IDLE in policies.values(), policies
    assert policies[me] == mine != os.SCHED_IDLE


@contextlib.contextmanager
def _one_cpu_with_a_hog() -> Iterator[int]:
    """Every thread of this process on one CPU, which a CPU-bound process at our priority
    keeps busy (so an idle helper there gets next to nothing)."""
    mask = os.sched_getaffinity(0)
    cpu = min(mask)
    for tid in _policies():
        with contextlib.suppress(OSError):
            os.sched_setaffinity(tid, {cpu})
    hog = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import os, time; os.sched_setaffinity(0, {{{cpu}}}); print(flush=True)\n"
            "end = time.monotonic() + 120\n"  # never outlives the test by much, nor us
            f"while os.getppid() == {os.getpid()} and time.monotonic() < end: pass",
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert hog.stdout is not None
        hog.stdout.readline()  # pinned and spinning
        yield cpu
    finally:
        hog.kill()
        hog.wait(10)
        if hog.stdout is not None:
            hog.stdout.close()
        for tid in _policies():  # helpers started meanwhile too
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, mask)


def test_starved_helpers_are_relieved_and_the_process_holds_to_copies_at_once() -> None:
    """With the only CPU taken by a hog the helpers starve: the caller copies what is left by
    the deadline (8 MiB: 16 ms), later copies get shorter deadlines, then run at once for a
    while (``idle_helpers_ready()`` false); once the hog is gone, copies probe the helpers
    again, from the full deadline."""
    _ext_built()
    dev, host = _pages(64, seed=7)
    ids = torch.arange(64)
    with on_idle_helpers(0.005), _one_cpu_with_a_hog():
        before = idle_copies()
        for _ in range(40):  # the helpers may still get the CPU for a moment as the hog starts
            host.zero_()
            device_to_host(dev, host, ids, ids)
            assert torch.equal(host, dev.permute(2, 0, 1, 3))
            if idle_copies().relieved > before.relieved:
                break
        after = idle_copies()
        assert after.relieved - before.relieved == 1, (before, after)
        for _ in range(40):  # shorter deadlines, each relieved, until the process holds
            host.zero_()
            device_to_host(dev, host, ids, ids)
            assert torch.equal(host, dev.permute(2, 0, 1, 3))
            if not idle_helpers_ready():
                break
        assert not idle_helpers_ready(), idle_copies()
        # (a relief finds nothing to take when the helpers have claimed every chunk by then)
        assert idle_copies().relieved_chunks > before.relieved_chunks
        held = idle_copies()
        host.zero_()
        device_to_host(dev, host, ids, ids)  # at once: not an idle copy
        assert idle_copies().copies == held.copies
        assert torch.equal(host, dev.permute(2, 0, 1, 3))
    deadline = time.monotonic() + 10
    while not idle_helpers_ready():  # the hold ends (100 ms for the first in turn)
        assert time.monotonic() < deadline, "the process never probed its helpers again"
        time.sleep(0.02)
    probe = idle_copies()
    with on_idle_helpers(0.005):
        host.zero_()
        device_to_host(dev, host, ids, ids)  # the probe: on the helpers, from the full deadline
        assert torch.equal(host, dev.permute(2, 0, 1, 3))
    assert idle_copies().copies - probe.copies == 1


def test_a_forked_child_starts_its_own_helpers() -> None:
    """A child forked after the helpers started has none of their threads: its first idle
    copy starts a pool of its own instead of waiting out the deadline for threads that do not
    exist there."""
    _ext_built()
    dev, host = _pages(64, seed=8)
    ids = np.arange(64, dtype=np.int64)
    raw = host.view(64, -1).view(torch.uint8)
    with on_idle_helpers():  # a child relieving would take PATIENT seconds
        assert presum.copy_to_host(dev, raw, PAGE, ids, ids, None)  # the parent's pool
        pid = os.fork()
        if pid == 0:  # the child: only C and numpy, no torch kernels (OpenMP after fork)
            code = 1
            try:
                before = idle_copies()
                raw.numpy()[:] = 0
                t0 = time.monotonic()
                presum.copy_to_host(dev, raw, PAGE, ids, ids, None)
                after = idle_copies()
                same = np.array_equal(
                    raw.numpy().view(np.float32).reshape(64, LAYERS, 2, ELEMS),
                    dev.numpy().transpose(2, 0, 1, 3),
                )
                fast = time.monotonic() - t0 < 4.0
                code = 0 if same and fast and after.relieved == before.relieved else 2
            finally:
                os._exit(code)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            pytest.fail("the forked child's copy hung")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("seed", range(2))
def test_concurrent_copies_share_the_helpers_and_each_gets_its_bytes(seed: int) -> None:
    """Several workers (threads) post copies of random sizes and pages to the one pool at
    once, some plain, some verifying with a planted failure: every copy lands whole, every
    verdict is its own, and nothing hangs."""
    _ext_built()
    errors: list[str] = []

    def worker(k: int) -> None:
        copy_on_idle_helpers(PATIENT)
        rng = np.random.default_rng(seed * 100 + k)
        g = torch.Generator().manual_seed(seed * 100 + k)
        try:
            for i in range(8):
                n = int(rng.integers(9, 48))  # > 1 MiB of 128 KiB pages: on the helpers
                dev = torch.randn(LAYERS, 2, n, ELEMS, generator=g)
                host = torch.zeros(n, LAYERS, 2, ELEMS)
                src, dst = torch.randperm(n, generator=g), torch.randperm(n, generator=g)
                device_to_host(dev, host, src, dst)
                if not torch.equal(host[dst], dev[:, :, src].permute(2, 0, 1, 3)):
                    errors.append(f"seed {seed} worker {k} copy {i}: bytes differ")
                raw = host.view(n, -1).view(torch.uint8)
                table = np.zeros((n, 3), dtype=np.uint64)
                presum.copy_to_host(dev, raw, PAGE, src.numpy(), dst.numpy(), table)
                expect = table[dst.numpy()].copy()
                bad = int(rng.integers(0, n))
                expect[bad, 1] ^= np.uint64(1)
                back = torch.zeros_like(dev)
                got = deferred.copy_to_device(raw, PAGE, back, dst, src, expect)
                if got != bad:
                    errors.append(f"seed {seed} worker {k} copy {i}: first bad {got}, not {bad}")
        finally:
            copy_on_idle_helpers(None)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), f"seed {seed}: a copy hung"
    assert not errors, errors
