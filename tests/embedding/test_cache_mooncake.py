"""EmbeddingCache over a real ``mooncake_master``: two processes, lost global copies, master
restart, allocation failure, many concurrent tasks."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

import pytest
import torch

from aiocache_kv.embedding import EmbeddingCache, InsertBatchStats, embedding_key
from aiocache_kv.storage import MooncakeStorage, parse_storage_key

from .conftest import MasterProc
from .emb_node import digest, store

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(120)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
DIM = 32


def emb(seed: int, tokens: int = 8) -> torch.Tensor:
    return torch.randn(tokens, DIM, generator=torch.Generator().manual_seed(seed))


def cache_on(master: MasterProc, ns: str, pool: int = 4 << 20) -> EmbeddingCache:
    return EmbeddingCache(
        pool_bytes=pool, store=store(master.rpc_addr, master.metadata_url, 32 << 20), namespace=ns
    )


async def node_b_read(master: MasterProc, ns: str, hashes: list[bytes]) -> dict[str, Any]:
    """Run node B (another process, another client) and return its JSON answer."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.embedding.emb_node",
        "read",
        "--master",
        master.rpc_addr,
        "--metadata",
        master.metadata_url,
        "--namespace",
        ns,
        "--hashes",
        ",".join(h.hex() for h in hashes),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        cwd=ROOT,
    )
    async with asyncio.timeout(60):
        out, _ = await proc.communicate()
    assert proc.returncode == 0, f"node B failed ({proc.returncode})"
    last = [line for line in out.decode().splitlines() if line.startswith("{")][-1]
    result: dict[str, Any] = json.loads(last)
    return result


async def test_node_b_reads_the_bytes_node_a_inserted(mooncake_master: MasterProc, ns: str) -> None:
    items = {b"cat.png": emb(1, 8), b"dog.png": emb(2, 3), b"\x00\xffraw": emb(3, 17)}
    async with cache_on(mooncake_master, ns) as a:
        st = await a.insert_batch(list(items), list(items.values()))
        assert st == InsertBatchStats(new=3, local_hit=0, skipped=0, push_failed=0)
        assert a._store is not None
        keys = [embedding_key(ns, h, torch.float32) for h in items]
        assert all(parse_storage_key(k).tag == ns for k in keys)  # exactly one tag
        assert await asyncio.to_thread(a._store.exists, keys) == [True] * 3
        answer = await node_b_read(mooncake_master, ns, [*items, b"never-inserted"])
        assert answer["digests"] == [*(digest(t) for t in items.values()), None]
        stats = answer["stats"]
        assert (stats["get_store_hits"], stats["get_misses"], stats["ready"]) == (3, 1, 3)
        # another namespace on the same store sees nothing
        other = [embedding_key(ns + "x", h, torch.float32) for h in items]
        assert await asyncio.to_thread(a._store.exists, other) == [False] * 3


async def test_lost_global_copy_is_repushed_by_a_local_hit(
    mooncake_master: MasterProc, ns: str
) -> None:
    x = emb(7)
    async with cache_on(mooncake_master, ns) as a:
        backend = a._store
        assert backend is not None
        key = embedding_key(ns, b"h", torch.float32)
        await a.insert_batch(["h"], [x])
        before = backend.statistics()
        assert await asyncio.to_thread(backend.remove, [key]) == [True]  # the store lost it
        st = await a.insert_batch(["h"], [x])
        assert st == InsertBatchStats(new=0, local_hit=1, skipped=0, push_failed=0)
        mid = backend.statistics()
        assert mid.put_ok == before.put_ok + 1 and mid.bytes_written > before.bytes_written
        answer = await node_b_read(mooncake_master, ns, [b"h"])
        assert answer["digests"] == [digest(x)]
        # the store has it again: the next local hit is pushed without its bytes
        st = await a.insert_batch(["h"], [x])
        assert st.local_hit == 1 and st.push_failed == 0
        after = backend.statistics()
        assert after.bytes_written == mid.bytes_written and after.put_skipped == mid.put_skipped + 1
        a.check_invariants()


async def test_master_restart_then_local_hit_repushes(fault_master: MasterProc, ns: str) -> None:
    x = emb(8)
    async with cache_on(fault_master, ns) as a:
        await a.insert_batch(["h"], [x])
        await asyncio.to_thread(fault_master.kill)
        await asyncio.to_thread(fault_master.start, same_ports=True)  # every object is gone
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while True:  # the client remounts its segment by itself within a few seconds
            st = await a.insert_batch(["h"], [x])
            assert st.local_hit == 1 and st.new == 0
            if st.push_failed == 0:
                break
            assert loop.time() < deadline, "the client never recovered"
            await asyncio.sleep(0.5)
        answer = await node_b_read(fault_master, ns, [b"h"])
        assert answer["digests"] == [digest(x)]
        a.check_invariants()


async def test_allocation_failure_skips_and_stores_the_rest(
    mooncake_master: MasterProc, ns: str
) -> None:
    small1, small2, big = emb(1, 4), emb(2, 4), emb(3, 4096)  # big: 512 KiB > the pool
    async with cache_on(mooncake_master, ns, pool=64 << 10) as a:
        st = await a.insert_batch(["s1", "big", "s2"], [small1, big, small2])
        assert st == InsertBatchStats(new=2, local_hit=0, skipped=1, push_failed=0)
        answer = await node_b_read(mooncake_master, ns, [b"s1", b"big", b"s2"])
        assert answer["digests"] == [digest(small1), None, digest(small2)]
        a.check_invariants()


async def test_many_tasks_on_overlapping_hashes_real_store(
    mooncake_master: MasterProc, ns: str
) -> None:
    hashes = [f"img{i}".encode() for i in range(10)]
    want = {h: emb(i, 2 + i) for i, h in enumerate(hashes)}
    # two caches, one per client: b fetches what a pushed while a keeps inserting
    async with (
        cache_on(mooncake_master, ns, pool=32 << 10) as a,
        cache_on(mooncake_master, ns, pool=24 << 10) as b,
    ):

        async def work(cache: EmbeddingCache, seed: int) -> None:
            g = torch.Generator().manual_seed(seed)
            for _ in range(8):
                idx = torch.randperm(len(hashes), generator=g)[:3].tolist()
                pick = [hashes[i] for i in idx]
                if cache is a:
                    st = await cache.insert_batch(pick, [want[h] for h in pick])
                    assert st.push_failed == 0 and st.new + st.local_hit + st.skipped == 3
                else:
                    for h, t in zip(pick, await cache.get_batch(pick), strict=True):
                        assert t is None or torch.equal(t, want[h])

        await asyncio.gather(*(work(a if i % 2 else b, i) for i in range(24)))
        for c in (a, b):
            c.check_invariants()
            s = c.statistics()
            assert (s.pinned, s.filling, s.lookup) == (0, 0, 0)
        final = await b.get_batch(hashes)
        inserted = [h for h in hashes if a.statistics().insert_new and h in a._entries]
        for h, t in zip(hashes, final, strict=True):
            if h in inserted:
                assert t is not None and torch.equal(t, want[h])


def test_mooncake_store_type_is_required() -> None:
    assert isinstance(store("127.0.0.1:1", "http://127.0.0.1:1/metadata", 0), MooncakeStorage)
