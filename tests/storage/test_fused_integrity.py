"""The integrity pass folded into copies the data makes anyway (issue #27, storage part).

* backup: the device->host copy records each host page's checksum (``storage/presum.py``), and
  the backup's seal writes only the trailer with it;
* file prefetch: ``_pageio`` sums each page as its bytes arrive, and the verify compares the
  trailer with that sum instead of reading the payload again.

The guarantee must not weaken: bytes that changed after the copy took their sum are stored
with the sum of what the copy wrote, so they never verify; a recycled host page never carries
an old sum; a read's sum is only used for the payload it covers.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import numpy as np
import pytest
import torch

import aiocache_kv as akv
from aiocache_kv.pools.kv_pool import HostKVPool
from aiocache_kv.storage import FileStorage, PageBuffer, integrity, page_file, presum
from aiocache_kv.storage.integrity import FRAME_OVERHEAD, Verdict, py_checksum
from aiocache_kv.storage.tier import PrefetchStatus
from aiocache_kv.testing import ManualCopyEngine, MemoryStorage
from aiocache_kv.transfer.engine import CopyJob, Direction
from tests.conftest import small_config
from tests.test_cache import read_kv
from tests.test_split_ack import write_kv

needs_c = pytest.mark.skipif(not presum.FUSED, reason="the _blocksum C extension is not built")
PROMPT = list(range(10, 26))  # 16 tokens = 8 pages of 2


def _sum_row(raw: torch.Tensor, page: int, nbytes: int) -> tuple[int, int, int]:
    return (*py_checksum(raw[page, :nbytes]), nbytes)


# ------------------------------------------------------------------ the fused copy itself


@needs_c
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_fused_copy_matches_the_reference_copy_and_checksum(dtype: torch.dtype) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    for _ in range(6):
        layers = rng.choice([1, 2, 3, 4])
        # elems per segment: odd ones make segments that end inside a 64-bit word, large ones
        # make pages of several 16 KiB blocks with a partial last block
        elems = rng.choice([1, 3, 5, 16, 1000, 4096, 8192 + 3])
        pages = rng.randint(2, 12)
        device = torch.randn(layers, 2, pages, elems).to(dtype)
        host = HostKVPool(2 * pages, layers, elems, dtype, extra_bytes=FRAME_OVERHEAD)
        ref = HostKVPool(2 * pages, layers, elems, dtype, extra_bytes=FRAME_OVERHEAD)
        k = rng.randint(1, pages)
        src = torch.tensor(rng.sample(range(pages), k), dtype=torch.int64)
        dst = torch.tensor(rng.sample(range(2 * pages), k), dtype=torch.int64)
        assert presum.copy_to_host(device, host.raw, host.page_bytes, src, dst, host.sums), seed
        presum.py_copy_to_host(device, ref.raw, ref.page_bytes, src, dst, ref.sums)
        for s, d in zip(src.tolist(), dst.tolist(), strict=True):
            assert torch.equal(host.pages[d], device[:, :, s]), f"seed {seed}"
            assert tuple(int(x) for x in host.sums[d]) == tuple(int(x) for x in ref.sums[d])
            assert tuple(int(x) for x in host.sums[d]) == _sum_row(host.raw, d, host.page_bytes)
        table = np.zeros_like(host.sums)
        presum.sum_slots(host.raw, host.page_bytes, dst, table)  # the CUDA waiter's pass
        assert (table[dst.numpy()] == host.sums[dst.numpy()]).all(), f"seed {seed}"


@needs_c
def test_fused_copy_refuses_out_of_range_pages_before_copying() -> None:
    device = torch.randn(2, 2, 4, 8)
    host = HostKVPool(4, 2, 8, torch.float32, extra_bytes=FRAME_OVERHEAD)
    before = host.raw.clone()
    with pytest.raises(IndexError):
        presum.copy_to_host(
            device, host.raw, host.page_bytes, torch.tensor([0, 1]), torch.tensor([0, 4]), host.sums
        )
    assert torch.equal(host.raw, before) and not host.sums.any()


def test_cpu_copy_job_records_sums_only_when_given_a_table() -> None:
    device = torch.randn(2, 2, 4, 8)
    host = HostKVPool(4, 2, 8, torch.float32, extra_bytes=FRAME_OVERHEAD)
    src, dst = torch.tensor([0, 2]), torch.tensor([3, 1])
    CopyJob(Direction.D2H, device, host.pages, src, dst).run()
    assert not host.sums.any()
    CopyJob(Direction.D2H, device, host.pages, src, dst, host_raw=host.raw, sums=host.sums).run()
    for s, d in zip(src.tolist(), dst.tolist(), strict=True):
        assert torch.equal(host.pages[d], device[:, :, s])
        if presum.FUSED:
            assert tuple(int(x) for x in host.sums[d]) == _sum_row(host.raw, d, host.page_bytes)


# ------------------------------------------------------------------ seal and verify with sums


@pytest.mark.parametrize("impl", ["c", "python"])
def test_seal_uses_a_presum_only_when_it_covers_the_payload(impl: str) -> None:
    if impl == "c" and integrity.CHECKSUM_IMPL != "c":
        pytest.skip("C extension not built")
    n = 40_000
    table = np.zeros(3, dtype=np.uint64)
    buf = PageBuffer.from_tensor(
        torch.randint(0, 256, (n + FRAME_OVERHEAD,), dtype=torch.uint8), table
    )
    key = "t/0"

    def seal() -> None:
        if impl == "c":
            integrity.seal_many([buf], [key])
        else:
            integrity.py_seal_many([buf], [key], [integrity.key_identity(key)])

    table[:] = (*py_checksum(buf.tensor[:n]), n)
    buf.tensor[7] ^= 0x10  # the bytes change after the copy took their sum
    seal()
    assert integrity.verify_many([buf], [key]) == [Verdict.BAD_CHECKSUM]
    table[2] = n - 8  # a sum of another length is not this payload's: a full seal
    seal()
    assert integrity.verify_many([buf], [key]) == [Verdict.OK]
    table[2] = 0  # no sum: a full seal
    buf.tensor[9] ^= 0x01
    seal()
    assert integrity.verify_many([buf], [key]) == [Verdict.OK]


def test_page_buffer_refuses_a_malformed_presum() -> None:
    t = torch.zeros(200, dtype=torch.uint8)
    for bad in (np.zeros(3, dtype=np.int64), np.zeros(4, dtype=np.uint64), [0, 0, 0]):
        with pytest.raises(akv.InvalidInputError):
            PageBuffer.from_tensor(t, bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("impl", ["c", "python"])
def test_verify_with_the_reads_sums(impl: str) -> None:
    if impl == "c" and integrity.CHECKSUM_IMPL != "c":
        pytest.skip("C extension not built")
    n = 70_000
    bufs = [PageBuffer.allocate(n + FRAME_OVERHEAD) for _ in range(3)]
    for b in bufs:
        b.tensor[:n] = torch.randint(0, 256, (n,), dtype=torch.uint8)
    keys = [f"t/{i}" for i in range(3)]
    integrity.seal_many(bufs, keys)
    good = py_checksum(bufs[0].tensor[:n])
    sums = [(*good, n), (1, 2, n), (1, 2, n - 1)]  # right; wrong; not this payload's: recomputed

    def verify() -> list[Verdict]:
        if impl == "c":
            return integrity.verify_many(bufs, keys, sums=sums)
        idents = [integrity.key_identity(k) for k in keys]
        return integrity.py_verify_many(bufs, keys, [None] * 3, idents, sums)

    assert verify() == [Verdict.OK, Verdict.BAD_CHECKSUM, Verdict.OK]
    with pytest.raises(akv.InvalidInputError):
        integrity.verify_many(bufs, keys, sums=sums[:2])


# ------------------------------------------------------------------ the fused file read


@pytest.mark.skipif(page_file.PAGEIO is None, reason="the _pageio C extension is not built")
def test_fused_read_sums_what_it_read(tmp_path: Path) -> None:
    import os

    dfd = os.open(tmp_path, os.O_RDONLY)
    try:
        for size in (100, 16_384, 70_001, 256 * 1024, 1 << 20, (4 << 20) + 5):
            slot = size + FRAME_OVERHEAD
            src = PageBuffer.allocate(slot)
            src.tensor[:size] = torch.randint(0, 256, (size,), dtype=torch.uint8)
            header = page_file.header_for(b"k")
            (tmp_path / f"p{size}").write_bytes(header + bytes(src.view))
            (tmp_path / f"short{size}").write_bytes(header + bytes(src.view)[:-1])
            dst = PageBuffer.allocate(slot)
            reads = [
                (dfd, f"p{size}".encode(), bytearray(len(header)), dst.view),
                (
                    dfd,
                    f"short{size}".encode(),
                    bytearray(len(header)),
                    PageBuffer.allocate(slot).view,
                ),
            ]
            (ok, short) = page_file.PAGEIO.read_pages(reads, True)
            assert ok[:2] == (0, len(header) + slot) and bytes(dst.view) == bytes(src.view)
            assert tuple(ok[2:]) == (*py_checksum(src.tensor[:size]), size)
            assert short[1] == len(header) + slot - 1 and short[4] == 0  # no sum: not whole
    finally:
        os.close(dfd)


def test_a_flipped_stored_byte_is_caught_by_the_fused_read(tmp_path: Path) -> None:
    store = FileStorage(tmp_path)
    store.open()
    n = 300_000  # a few 256 KiB pieces: the flip lands in the second
    bufs = [PageBuffer.allocate(n + FRAME_OVERHEAD) for _ in range(4)]
    for b in bufs:
        b.tensor[:n] = torch.randint(0, 256, (n,), dtype=torch.uint8)
    keys = [f"t/{i}" for i in range(4)]
    assert store.put(keys, bufs) == [True] * 4
    path = store.path_of(keys[2])
    data = bytearray(path.read_bytes())
    data[-FRAME_OVERHEAD - 1000] ^= 0x04
    path.write_bytes(bytes(data))
    out = [PageBuffer.allocate(n + FRAME_OVERHEAD) for _ in range(4)]
    assert store.get_into(keys, out) == [True, True, False, True]
    assert store.statistics().corrupt == 1
    store.close()


# ------------------------------------------------------------------ through the cache


def _cfg(storage: object, **kw: object) -> akv.CacheConfig:
    return small_config(
        storage=storage, prefetch_threshold_tokens=0, prefetch_policy="wait_complete", **kw
    )


async def test_write_through_records_each_host_pages_sum(tmp_path: Path) -> None:
    async with akv.HiCache(_cfg(FileStorage(tmp_path))) as cache:
        slots = cache.alloc(len(PROMPT))
        write_kv(cache, slots, seed=3)
        cache.release(cache.insert(PROMPT, slots))
        await cache.flush()
        host = cache._core.host_pool
        assert host is not None
        pages = torch.cat([n.host_pages for n in cache._tree.walk() if n.host_pages is not None])
        assert pages.numel() == len(PROMPT) // 2
        for p in pages.tolist():
            want = _sum_row(host.raw, p, host.page_bytes) if presum.FUSED else (0, 0, 0)
            assert tuple(int(x) for x in host.sums[p]) == want
        assert cache.statistics().backup_pages_ok == len(PROMPT) // 2


@pytest.mark.parametrize("backend", ["file", "memory"])
async def test_bytes_changed_between_the_fused_sum_and_the_put_never_verify(
    tmp_path: Path, backend: str
) -> None:
    """The decision: a host page whose bytes change after its copy took the sum is stored
    with the sum of what the copy wrote, so it fails every read (a miss, published as
    removed); a full seal at put time would have sealed the changed bytes as valid."""
    if not presum.FUSED:
        pytest.skip("no fused copy without the C extension")
    memory = MemoryStorage()

    def store() -> akv.StorageBackend:
        return FileStorage(tmp_path) if backend == "file" else memory

    engine = ManualCopyEngine()
    async with akv.HiCache(_cfg(store()), copy_engine=engine) as cache:
        slots = cache.alloc(len(PROMPT))
        written = write_kv(cache, slots, seed=5)
        cache.release(cache.insert(PROMPT, slots))
        job, done = engine.pending.pop(0)
        job.run()  # the copy lands in host memory and takes each page's sum
        assert job.host_raw is not None
        job.host_raw[int(job.dst[3]), 5] ^= 0x40  # then a byte of the 4th page changes
        done(None)  # the write ack: the backup starts from here
        await cache.flush()
        assert cache.statistics().backup_pages_ok == 8
    reader = store()
    async with akv.HiCache(_cfg(reader)) as cache:
        cache.take_events()
        res = await cache.prefetch(PROMPT)
        assert res.status is PrefetchStatus.PARTIAL and res.hit_tokens == 6  # pages 0-2 only
        removed = [e for e in cache.take_events() if isinstance(e, akv.BlockRemoved)]
        assert len(removed) == 1 and removed[0].medium == "STORAGE"
        assert reader.statistics().corrupt == 1
        m = cache.match_prefix(PROMPT)
        assert m.matched_len == 6
        await cache.load_back(m)
        got = read_kv(cache, m.device_indices)
        for a, b in zip(got, written, strict=True):
            assert torch.equal(a, b[:6])  # what is served is exactly what was computed
        cache.release(m)
        cache.check_invariants()


async def test_a_recycled_host_page_never_carries_an_old_sum(tmp_path: Path) -> None:
    store = FileStorage(tmp_path)
    async with akv.HiCache(_cfg(store, host_pages=8)) as cache:
        slots = cache.alloc(len(PROMPT))
        write_kv(cache, slots, seed=7)
        cache.release(cache.insert(PROMPT, slots))
        await cache.flush()
        host = cache._core.host_pool
        assert host is not None
        used = {
            p for n in cache._tree.walk() if n.host_pages is not None for p in n.host_pages.tolist()
        }
        assert used == set(range(8))  # the whole host pool
        if presum.FUSED:
            assert (host.sums[:, 2] == host.page_bytes).all()
        cache._core.evict_device(8)
        cache._core.evict_host(8)  # every host page back on the free list, sums still there
        m = cache.match_prefix(PROMPT)
        assert m.matched_len == 0
        cache.release(m)
        # storage reads into recycled pages (a prefetch takes at most half the host pool)
        res = await cache.prefetch(PROMPT[:8])
        assert res.status is PrefetchStatus.COMPLETE
        reused = [
            p for n in cache._tree.walk() if n.host_pages is not None for p in n.host_pages.tolist()
        ]
        assert len(reused) == 4
        # the pages the prefetch reused carry no sum: a later backup seals them in full
        assert not host.sums[reused, 2].any()
        cache.check_invariants()


async def test_the_core_forgets_sums_when_it_hands_host_pages_out() -> None:
    async with akv.HiCache(small_config(storage=MemoryStorage())) as cache:
        core = cache._core
        host = core.host_pool
        assert host is not None
        host.sums[:] = 1
        pages = core.alloc_host(5)
        assert pages is not None
        assert (host.sums[pages.numpy(), 2] == 0).all()
        others = np.setdiff1d(np.arange(host.num_pages), pages.numpy())
        assert (host.sums[others, 2] == 1).all()
        core.free_host([pages])
        await asyncio.sleep(0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_cuda_waiter_records_sums_after_the_event(tmp_path: Path) -> None:
    async with akv.HiCache(_cfg(FileStorage(tmp_path), device="cuda")) as cache:
        slots = cache.alloc(len(PROMPT))
        write_kv(cache, slots, seed=9)
        cache.release(cache.insert(PROMPT, slots))
        await cache.flush()
        host = cache._core.host_pool
        assert host is not None
        for n in cache._tree.walk():
            for p in [] if n.host_pages is None else n.host_pages.tolist():
                assert tuple(int(x) for x in host.sums[p]) == _sum_row(host.raw, p, host.page_bytes)
    async with akv.HiCache(_cfg(FileStorage(tmp_path), device="cuda")) as cache:
        res = await cache.prefetch(PROMPT)
        assert res.status is PrefetchStatus.COMPLETE


def test_a_mooncake_put_of_presummed_pages_is_one_call() -> None:
    """Pages whose copy took their sum have no seal to overlap with a send: one call."""
    from aiocache_kv.storage.mooncake_pipeline import pipelined_put, put_chunks

    n, size = 6, 1000
    table = np.zeros((n, 3), dtype=np.uint64)
    bufs = [
        PageBuffer.from_tensor(torch.zeros(size + FRAME_OVERHEAD, dtype=torch.uint8), table[i])
        for i in range(n)
    ]
    keys = [f"t/{i}" for i in range(n)]
    idents = [integrity.key_identity(k) for k in keys]
    calls: list[list[int]] = []

    def send(idx: list[int]) -> list[int]:
        calls.append(idx)
        return [0] * len(idx)

    target = 2 * bufs[0].nbytes  # two pages a chunk

    def put() -> None:
        chunks = put_chunks(list(range(n)), bufs, target)
        pipelined_put(chunks, keys, bufs, idents, send, lambda fn, *a: None)

    put()
    assert calls == [[0, 1], [2, 3], [4, 5]]  # no sums: chunk by chunk, sealed in full
    calls.clear()
    table[:] = (*py_checksum(bufs[0].tensor[:size]), size)
    table[3, 2] = 0  # one page without: the pipeline as before
    put()
    assert calls == [[0, 1], [2, 3], [4, 5]]
    calls.clear()
    table[3, 2] = size
    put()
    assert calls == [[0, 1, 2, 3, 4, 5]]
    assert integrity.verify_many(bufs, keys) == [Verdict.OK] * n
