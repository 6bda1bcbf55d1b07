"""HiCache over a real Mooncake master: two processes, faults, recovery.

Every await is bounded; the cache keeps serving from L1/L2 while the store is down or hung.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import uuid

import pytest
import torch

import aiocache_kv as akv
from aiocache_kv.storage.tier import PrefetchStatus

from .conftest import MasterProc
from .mc_node import digest, fill, node_config, prompt

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(120)]


async def start_writer(
    master: MasterProc, namespace: str
) -> tuple[asyncio.subprocess.Process, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.storage.mc_node",
        "writer",
        "--master",
        master.rpc_addr,
        "--metadata",
        master.metadata_url,
        "--namespace",
        namespace,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )
    assert proc.stdout is not None
    line: list[str] = []
    async with asyncio.timeout(60):
        while not (line and line[0] == "READY"):
            raw = await proc.stdout.readline()
            assert raw, "writer exited before READY"
            line = raw.decode().split()
    assert int(line[2]) == 16  # every page backed up
    return proc, line[1]


async def test_node_b_reads_node_a_prefix_bit_identical(mooncake_master: MasterProc) -> None:
    ns = f"m{uuid.uuid4().hex[:8]}"
    writer, want = await start_writer(mooncake_master, ns)
    try:
        async with akv.HiCache(
            node_config(mooncake_master.rpc_addr, mooncake_master.metadata_url, ns)
        ) as cache:
            tokens = prompt()
            res = await cache.prefetch(tokens)
            assert res.status is PrefetchStatus.COMPLETE and res.hit_tokens == 64
            m = cache.match_prefix(tokens)
            await cache.load_back(m)
            assert m.device_len == 64
            assert digest(cache, m.device_indices) == want
            # another namespace on the same store sees nothing of it
            other = await cache.prefetch(tokens, tenant="someone-else")
            assert other.status is PrefetchStatus.MISS
            rows = m.device_indices
            kept = [buf[rows].clone() for layer in range(2) for buf in cache.device_kv(layer)]
            cache.release(m)
            # the process holding the segment dies: a miss, never an error.  (The master
            # places each object on any mounted segment, so pages that landed on another
            # live client's - one an earlier test of the session left mounted - survive.)
            writer.kill()
            await writer.wait()
            cache.evict(10_000)
            cache.evict(10_000, tier="host")
            res = await cache.prefetch(tokens)
            assert res.status in (
                PrefetchStatus.FAILED,
                PrefetchStatus.PARTIAL,
                PrefetchStatus.MISS,
            )
            m = cache.match_prefix(tokens)
            await cache.load_back(m)
            n = m.device_len
            assert n == res.hit_tokens
            rows = m.device_indices[:n]
            got = [buf[rows] for layer in range(2) for buf in cache.device_kv(layer)]
            assert all(torch.equal(g, k[:n]) for g, k in zip(got, kept, strict=True))
            cache.release(m)
            cache.check_invariants()
            stats = cache.statistics()
            assert stats.prefetch_reserved_pages == 0 and stats.host.protected_pages == 0
    finally:
        if writer.returncode is None:
            writer.kill()
            await writer.wait()


async def test_master_killed_then_restarted(fault_master: MasterProc) -> None:
    ns = f"k{uuid.uuid4().hex[:8]}"
    cfg = node_config(fault_master.rpc_addr, fault_master.metadata_url, ns)
    async with akv.HiCache(cfg) as cache:
        tokens = prompt()
        slots = cache.alloc(len(tokens))
        fill(cache, slots, seed=1)
        r = cache.insert(tokens, slots)
        await cache.flush()
        assert cache.statistics().backup_pages_ok == 16
        await asyncio.to_thread(fault_master.kill)
        # backup while the master is dead: bounded, recorded, never reported as stored
        slots2 = cache.alloc(12)
        fill(cache, slots2, seed=2)
        r2 = cache.insert([*tokens[:4], 9, 9, 9, 9, 8, 8, 8, 8], slots2)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await cache.flush()
        assert loop.time() - t0 < 3 * cfg.storage_timeout
        stats = cache.statistics()
        assert stats.backup_pages_failed >= 1 and stats.backup_pages_ok == 16
        # prefetch while dead: resolves by its deadline with nothing, serving goes on
        t0 = loop.time()
        res = await cache.prefetch([7] * 64)
        assert loop.time() - t0 < 3 * cfg.storage_timeout
        assert res.hit_tokens == 0
        m = cache.match_prefix(tokens)
        assert m.device_len == 64  # L1 still serves
        cache.release(m)
        # master back on the same ports: the client remounts; new backups land again
        await asyncio.to_thread(fault_master.start, same_ports=True)
        ok = False
        for _ in range(40):
            await asyncio.sleep(0.25)
            cache.release(cache.match_prefix([*tokens[:4], 9, 9, 9, 9, 8, 8, 8, 8]))
            await cache.flush()
            if all(n.storage is akv.TierState.RESIDENT for n in cache._tree.path(r2.node)):
                ok = True
                break
        assert ok, f"no recovery: {cache.statistics()}"
        cache.release(r)
        cache.release(r2)
        cache.check_invariants()
        stats = cache.statistics()
        assert stats.prefetch_reserved_pages == 0 and stats.storage_in_flight == 0


async def test_master_hung_is_bounded_and_loop_stays_live(fault_master: MasterProc) -> None:
    ns = f"h{uuid.uuid4().hex[:8]}"
    cfg = node_config(fault_master.rpc_addr, fault_master.metadata_url, ns)
    async with akv.HiCache(cfg) as cache:
        await asyncio.to_thread(fault_master.stop)  # SIGSTOP
        try:
            lags: list[float] = []

            async def ticker() -> None:
                while True:
                    t = time.perf_counter()
                    await asyncio.sleep(0.01)
                    lags.append(time.perf_counter() - t - 0.01)

            tick = asyncio.create_task(ticker())
            t0 = time.perf_counter()
            res = await cache.prefetch(prompt())
            waited = time.perf_counter() - t0
            tick.cancel()
            # a stalled master answers nothing in time (FAILED) or "absent" (MISS): no hits
            assert res.status in (PrefetchStatus.FAILED, PrefetchStatus.MISS)
            assert res.hit_tokens == 0
            assert waited < cfg.prefetch_timeout_max + 1.0
            assert lags and max(lags) < 0.5, f"loop blocked: max lag {max(lags):.3f}s"
        finally:
            await asyncio.to_thread(os.kill, fault_master.pid, signal.SIGCONT)
        await cache.flush()
