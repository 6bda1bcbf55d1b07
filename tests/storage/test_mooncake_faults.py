"""Master faults with a real mooncake_master: every await ends by its deadline, then recovery.

Each test owns a master (``fault_master``) and a client, so killing or stopping them cannot
break other tests.  ``MC_RPC_TIMEOUT_MS`` is 1500 (conftest, before any client exists).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from aiocache_kv.errors import StorageTimeoutError, StorageUnavailableError
from aiocache_kv.storage import FRAME_OVERHEAD, MooncakeStorage, PageBuffer, StorageIO
from aiocache_kv.storage.keys import storage_key

from .conftest import LOOPBACK, RPC_TIMEOUT_MS, MasterProc

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(90)]

PAGE = 16 << 10
SLOT = PAGE + FRAME_OVERHEAD
BATCH = 4


def client(master: MasterProc) -> MooncakeStorage:
    return MooncakeStorage(
        master=master.rpc_addr,
        metadata_server=master.metadata_url,
        local_hostname=LOOPBACK,
        global_segment_size=32 << 20,
        local_buffer_size=16 << 20,
        rpc_timeout_ms=RPC_TIMEOUT_MS,
    )


def slots(t: torch.Tensor) -> list[PageBuffer]:
    return [PageBuffer.from_tensor(t[i * SLOT : (i + 1) * SLOT]) for i in range(t.numel() // SLOT)]


async def test_sigkill_during_batches_then_restart(fault_master: MasterProc, tag: str) -> None:
    io = StorageIO(client(fault_master), workers=2, default_timeout=2.0)
    await io.open(timeout=30)
    src_t = torch.randint(0, 256, (BATCH * SLOT,), dtype=torch.uint8)
    dst_t = torch.zeros_like(src_t)
    await io.register_buffer(src_t)
    await io.register_buffer(dst_t)
    src, dst = slots(src_t), slots(dst_t)
    loop = asyncio.get_running_loop()
    deadline = 1.5
    old_keys: list[str] = []
    outcomes: list[str] = []
    for it in range(4):  # 3 healthy rounds, then one put + get with the master dead
        if it == 3:
            await asyncio.to_thread(fault_master.kill)
        keys = [storage_key(tag, (it * 100 + j).to_bytes(32, "big")) for j in range(BATCH)]
        for op in ("put", "get"):
            t0 = loop.time()
            try:
                if op == "put":
                    ok = await io.put(keys, src, timeout=deadline)
                else:
                    dst_t.zero_()
                    ok = await io.get_into(keys, dst, timeout=deadline)
                outcome = "ok" if all(ok) else ("partial" if any(ok) else "false")
            except StorageTimeoutError:
                outcome = "timeout"
            except StorageUnavailableError:
                outcome = "unavailable"
            elapsed = loop.time() - t0
            assert elapsed < deadline + 1.0, f"{op} took {elapsed:.2f} s past its deadline"
            outcomes.append(outcome)
            if it < 3:
                assert outcome == "ok", outcomes
                if op == "get":
                    assert torch.equal(dst_t, src_t)
            else:
                assert outcome in ("timeout", "unavailable", "false"), outcomes
            if op == "get":
                await io.wait_released(dst)  # never reuse dst while a worker may write it
        if it < 3:
            old_keys += keys

    await asyncio.to_thread(fault_master.start, same_ports=True)
    await asyncio.wait_for(io.drain(), 10)  # stuck calls come back on their own (-900)
    recovered_after = None
    t0 = loop.time()
    for attempt in range(100):
        keys = [
            storage_key(tag, (10_000 + attempt * 10 + j).to_bytes(32, "big")) for j in range(BATCH)
        ]
        try:
            if await io.put(keys, src, timeout=deadline) == [True] * BATCH:
                recovered_after = loop.time() - t0
                break
        except (StorageTimeoutError, StorageUnavailableError):
            pass
        await asyncio.sleep(0.2)
    assert recovered_after is not None and recovered_after < 15
    dst_t.zero_()
    assert await io.get_into(keys, dst, timeout=deadline) == [True] * BATCH
    assert torch.equal(dst_t, src_t)
    # The master kept its objects in memory: everything from before the kill is gone.
    assert await io.get_into(old_keys[:BATCH], dst, timeout=deadline) == [False] * BATCH
    await io.aclose(timeout=10)


async def test_sigstop_is_bounded_by_rpc_timeout(fault_master: MasterProc, tag: str) -> None:
    storage = client(fault_master)
    io = StorageIO(storage, workers=2, default_timeout=5.0)
    await io.open(timeout=30)
    src_t = torch.randint(0, 256, (BATCH * SLOT,), dtype=torch.uint8)
    dst_t = torch.zeros_like(src_t)
    await io.register_buffer(src_t)
    await io.register_buffer(dst_t)
    keys = [storage_key(tag, j.to_bytes(32, "big")) for j in range(BATCH)]
    assert await io.put(keys, slots(src_t)) == [True] * BATCH
    loop = asyncio.get_running_loop()
    await asyncio.to_thread(fault_master.stop)  # waits (off the loop) until it is stopped
    try:
        # The blocking call itself returns after MC_RPC_TIMEOUT_MS (not the 30 s default); we
        # measured 1x almost always, once 5x (the client retried on a fresh connection), so the
        # bound checked here is 6x: what matters is that it is bounded by the RPC timeout.
        calls = {"exists": storage.exists, "get_into": lambda k: storage.get_into(k, slots(dst_t))}
        for name, call in calls.items():
            t0 = loop.time()
            try:
                got = await asyncio.to_thread(call, keys)
            except StorageUnavailableError:
                pass
            else:
                pytest.fail(f"{name} answered {got} while the master was stopped")
            elapsed = loop.time() - t0
            assert RPC_TIMEOUT_MS / 1000 * 0.8 < elapsed < 6 * RPC_TIMEOUT_MS / 1000 + 1, elapsed
        # Through StorageIO the caller's own, shorter deadline wins.
        t0 = loop.time()
        with pytest.raises(StorageTimeoutError):
            await io.get_into(keys, slots(dst_t), timeout=0.3)
        assert loop.time() - t0 < 0.6
        assert io.holds(slots(dst_t))
        await asyncio.wait_for(io.wait_released(slots(dst_t)), 6 * RPC_TIMEOUT_MS / 1000 + 2)
    finally:
        fault_master.cont()
    dst_t.zero_()
    assert await io.get_into(keys, slots(dst_t)) == [True] * BATCH  # data intact after SIGCONT
    assert torch.equal(dst_t, src_t)
    assert io.io_statistics().late_results == 1
    await io.aclose(timeout=10)
