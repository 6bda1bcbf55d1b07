"""Mooncake prefetches verified at load-back, in the host->device copy (``storage/deferred.py``).

A prefetch from Mooncake checks only each page's trailer; the payload's checksum is compared
by the load-back's copy.  A page that fails there is a miss from that page on: the match
shrinks, the node goes (``BlockRemoved`` for host and storage), the key is removed, and the
model never sees the bytes.  A page that verifies is served as before.
"""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
import torch

import aiocache_kv as akv
from aiocache_kv.namespace import namespace_of
from aiocache_kv.pools.kv_pool import HostKVPool
from aiocache_kv.storage import MooncakeStorage, PageBuffer, deferred, presum
from aiocache_kv.storage.deferred import first_bad, verify_trailers
from aiocache_kv.storage.integrity import FRAME_OVERHEAD, Verdict, seal_many
from aiocache_kv.storage.key_layout import key_components
from aiocache_kv.storage.keys import storage_key
from aiocache_kv.storage.tier import PrefetchStatus
from aiocache_kv.testing import ManualCopyEngine
from aiocache_kv.transfer.engine import CopyJob, Direction
from aiocache_kv.tree.hashing import chain_hashes, namespace_seed
from tests.conftest import small_config
from tests.test_cache import read_kv
from tests.test_split_ack import write_kv

from .conftest import MasterProc, loopback_client

PROMPT = list(range(10, 26))  # 16 tokens = 8 pages of 2
PAGES = len(PROMPT) // 2


def _keys(config: akv.CacheConfig) -> list[str]:
    """The KV pages' keys of PROMPT in ``config``'s namespace (their layout digest too)."""
    ns = namespace_of(config.namespace, "", "")
    kv = key_components(config)[0]
    return [storage_key(ns.tag, h, kv) for h in chain_hashes(namespace_seed(ns.tag), PROMPT, 2)]


# ------------------------------------------------------------------ the pieces, no master


def _pool(pages: int, seed: int) -> HostKVPool:
    host = HostKVPool(pages, 2, 64, torch.float32, extra_bytes=FRAME_OVERHEAD)
    gen = torch.Generator().manual_seed(seed)
    host.pages.copy_(torch.randn(host.pages.shape, generator=gen))
    return host


@pytest.mark.parametrize("impl", ["c", "python"])
def test_trailer_check_records_the_trailers_sum_and_leaves_the_payload_unread(
    impl: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if impl == "python":
        monkeypatch.setattr(deferred, "_EXT", None)
    elif deferred._EXT is None:
        pytest.skip("the _blocksum C extension is not built")
    host = _pool(4, 1)
    bufs = [
        PageBuffer.from_tensor(host.raw[i, : host.page_bytes + FRAME_OVERHEAD], host.sums[i])
        for i in range(4)
    ]
    keys = [f"ns/{i:064x}/kv" for i in range(4)]
    idents = [bytes([i]) * 32 for i in range(4)]
    seal_many(bufs, keys, idents)
    want = np.zeros_like(host.sums)
    presum.sum_slots(host.raw, host.page_bytes, np.arange(4), want)
    host.raw[2, 7] ^= 0x10  # the payload changed: only the load-back can tell
    sizes: list[int | None] = [b.nbytes for b in bufs]
    wrong = [*idents[:3], bytes(32)]  # page 3 was computed from other tokens
    assert verify_trailers(bufs, keys, sizes, wrong) == [Verdict.OK] * 3 + [Verdict.BAD_IDENTITY]
    assert (host.sums[:3] == want[:3]).all() and host.sums[3, 2] == 0
    # a short object and another key's page: misses, no row
    short: list[int | None] = [sizes[0], int(bufs[1].nbytes) - 1, sizes[2], sizes[3]]
    other = [keys[0], keys[1], "ns/other/kv", keys[3]]
    assert verify_trailers(bufs, other, short, idents) == [
        Verdict.OK,
        Verdict.BAD_LENGTH,
        Verdict.BAD_KEY,
        Verdict.OK,
    ]
    assert host.sums[1, 2] == 0 and host.sums[2, 2] == 0
    assert (host.sums[[0, 3]] == want[[0, 3]]).all()
    verify_trailers(bufs, keys, sizes, wrong)
    assert first_bad(host.raw, host.page_bytes, np.arange(3), host.sums[:3]) == 2
    host.raw[2, 7] ^= 0x10
    assert first_bad(host.raw, host.page_bytes, np.arange(3), host.sums[:3]) == -1
    # rows with bytes 0 are not checked
    host.raw[0, 0] ^= 1
    rows = host.sums[:3].copy()
    rows[0, 2] = 0
    assert first_bad(host.raw, host.page_bytes, np.arange(3), rows) == -1


@pytest.mark.parametrize("impl", ["fused", "separate"])
@pytest.mark.parametrize("bad_at", [0, 3, 5])
def test_h2d_job_serves_only_the_pages_before_the_first_failure(
    bad_at: int, impl: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CPU the check runs in the copy itself (C, block by block: the failed page was copied,
    nothing after it) or, without the extension, before a copy of the pages before it."""
    if impl == "separate":
        monkeypatch.setattr(deferred, "_EXT", None)
    elif deferred._EXT is None:
        pytest.skip("the _blocksum C extension is not built")
    seed = random.randrange(1 << 30)
    host = _pool(8, seed)
    src = torch.tensor([6, 1, 2, 3, 7, 0], dtype=torch.int64)
    rows = np.zeros((len(src), 3), dtype=np.uint64)
    table = np.zeros_like(host.sums)
    presum.sum_slots(host.raw, host.page_bytes, src, table)
    rows[:] = table[src.numpy()]
    rows[1, 2] = 0  # a page verified already: copied without a check
    host.raw[int(src[bad_at]), 3] ^= 0x01  # a flipped byte in the host copy
    device = torch.zeros(2, 2, 8, 64)
    dst = torch.arange(6, dtype=torch.int64)
    job = CopyJob(Direction.H2D, device, host.pages, src, dst, host_raw=host.raw, expect=rows)
    job.run()
    want = [] if bad_at == 1 else [bad_at]
    assert job.bad == want, f"seed {seed}"
    for k in range(6):
        copied = torch.equal(device[:, :, k], host.pages[int(src[k])])
        if k < bad_at or not want:
            assert copied, f"seed {seed} page {k}"
        elif k > bad_at or impl == "separate":
            assert not device[:, :, k].any(), f"seed {seed}: page {k} reached the device"


@pytest.mark.skipif(deferred._EXT is None, reason="the _blocksum C extension is not built")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fused_h2d_check_matches_the_torch_copy_over_threads(dtype: torch.dtype) -> None:
    """Pages of several 16 KiB blocks and a partial one, over several threads: a clean copy
    equals torch's; a failure in a later thread's range is found, the first one wins."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    elems = 8192 + 5  # 2 layers x 2 x elems: blocks and a tail
    n = 96  # 80 pages of 64-128 KiB: 2-4 threads of at least 2 MiB each
    host = HostKVPool(n, 2, elems, dtype, extra_bytes=FRAME_OVERHEAD)
    host.pages.copy_(torch.randn(host.pages.shape).to(dtype))
    src = torch.tensor(rng.sample(range(n), 80), dtype=torch.int64)
    dst = torch.tensor(rng.sample(range(n), 80), dtype=torch.int64)
    table = np.zeros_like(host.sums)
    presum.sum_slots(host.raw, host.page_bytes, src, table)
    rows = table[src.numpy()].copy()
    device = torch.zeros(2, 2, n, elems, dtype=dtype)
    ref = torch.zeros_like(device)
    ref[:, :, dst] = host.pages[src].permute(1, 2, 0, 3)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)  # the copy worker's setting decides how many threads it uses
    try:
        bad = deferred.copy_to_device(host.raw, host.page_bytes, device, src, dst, rows)
        assert bad == -1 and torch.equal(device, ref), f"seed {seed}"
        late, early = 70, 30  # in the last thread's range, then in the first's
        host.raw[int(src[late]), 100] ^= 4
        assert deferred.copy_to_device(host.raw, host.page_bytes, device, src, dst, rows) == late
        host.raw[int(src[early]), host.page_bytes - 1] ^= 4  # in the tail
        assert deferred.copy_to_device(host.raw, host.page_bytes, device, src, dst, rows) == early
    finally:
        torch.set_num_threads(threads)


def test_a_deferred_mooncake_get_is_one_call() -> None:
    """Checking trailers only leaves nothing to overlap with the next chunk's get: one call
    for the batch, as the raw client makes (pages without a row: chunk by chunk, in full)."""
    from aiocache_kv.storage.mooncake_pipeline import pipelined_get

    host = _pool(6, 3)
    bufs = [
        PageBuffer.from_tensor(host.raw[i, : host.page_bytes + FRAME_OVERHEAD], host.sums[i])
        for i in range(6)
    ]
    keys = [f"t/{i}" for i in range(6)]
    idents = [bytes([i]) * 32 for i in range(6)]
    seal_many(bufs, keys, idents)
    calls: list[list[int]] = []

    def get(idx: list[int]) -> list[int]:
        calls.append(idx)
        return [bufs[i].nbytes for i in idx]

    chunks = [[0, 1], [2, 3], [4, 5]]
    _, read, verdicts = pipelined_get(chunks, keys, bufs, idents, get, lambda fn, *a: None, True)
    assert calls == [[0, 1, 2, 3, 4, 5]] and read == list(range(6))
    assert verdicts == [Verdict.OK] * 6
    calls.clear()
    pipelined_get(chunks, keys, bufs, idents, get, lambda fn, *a: None)
    assert calls == chunks


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_cuda_h2d_job_verifies_what_reached_the_device() -> None:
    from aiocache_kv.transfer.engine import CudaCopyEngine

    host = HostKVPool(8, 2, 64, torch.float32, extra_bytes=FRAME_OVERHEAD, pin_memory=True)
    host.pages.copy_(torch.randn(host.pages.shape))
    src = torch.tensor([5, 6, 7, 1], dtype=torch.int64)
    table = np.zeros_like(host.sums)
    presum.sum_slots(host.raw, host.page_bytes, src, table)
    rows = table[src.numpy()].copy()
    host.raw[7, 11] ^= 0x02  # the third source page
    device = torch.zeros(2, 2, 8, 64, device="cuda")
    engine = CudaCopyEngine(torch.device("cuda"))
    loop = asyncio.get_running_loop()
    engine.start(loop)
    try:
        for expect, want in ((rows, [2]), (None, [])):
            job = CopyJob(
                Direction.H2D,
                device,
                host.pages,
                src,
                torch.arange(4, dtype=torch.int64),
                host_raw=host.raw,
                expect=expect,
            )
            done: asyncio.Future[BaseException | None] = loop.create_future()
            engine.submit(job, done.set_result)
            assert await done is None
            assert job.bad == want
    finally:
        await engine.aclose()


# ------------------------------------------------------------------ over a real master


def _cfg(model: str, master: MasterProc) -> akv.CacheConfig:
    return small_config(
        namespace=model,
        storage=loopback_client(master, 32 << 20),
        storage_timeout=5.0,
        prefetch_threshold_tokens=0,
        prefetch_policy="wait_complete",
    )


async def _write(
    cache: akv.HiCache, engine: ManualCopyEngine, flip: int | None
) -> list[torch.Tensor]:
    """Insert PROMPT and back it up; with ``flip``, a byte of that page changes after the copy
    took its sum, so the stored page's payload no longer matches its trailer."""
    slots = cache.alloc(len(PROMPT))
    written = write_kv(cache, slots, seed=5)
    cache.release(cache.insert(PROMPT, slots))
    job, done = engine.pending.pop(0)
    job.run()
    if flip is not None:
        assert job.host_raw is not None
        job.host_raw[int(job.dst[flip]), 5] ^= 0x40
    done(None)
    await cache.flush()
    assert cache.statistics().backup_pages_ok == PAGES
    return written


@pytest.mark.mooncake
@pytest.mark.timeout(120)
@pytest.mark.parametrize("flip", [0, 3, 5])
async def test_a_flipped_byte_in_mooncake_is_found_at_load_back(
    mooncake_master: MasterProc, mc_storage: MooncakeStorage, tag: str, flip: int
) -> None:
    """Page ``flip`` of 8 was stored with a byte that does not match its checksum.  The load
    covers two nodes (pages 0-3 and 4-7): the failure cuts the first or the second."""
    engine = ManualCopyEngine()
    keep = 2 * flip  # tokens before the failed page
    async with akv.HiCache(_cfg(tag, mooncake_master), copy_engine=engine) as writer:
        written = await _write(writer, engine, flip=flip)
        assert mc_storage.exists(_keys(_cfg(tag, mooncake_master))) == [True] * PAGES
        async with akv.HiCache(_cfg(tag, mooncake_master)) as cache:
            cache.take_events()
            res = await cache.prefetch(PROMPT)
            # only the trailers were checked: every page comes, unverified
            assert res.status is PrefetchStatus.COMPLETE and res.hit_tokens == 16
            cache.release(cache.match_prefix(PROMPT[:8]))  # splits the node: two nodes
            m = cache.match_prefix(PROMPT)
            assert m.host_len == 16
            await cache.load_back(m)
            assert (m.device_len, m.host_len, m.matched_len) == (keep, 0, keep)
            got = read_kv(cache, m.device_indices)
            for a, b in zip(got, written, strict=True):
                assert torch.equal(a, b[:keep])  # what is served is exactly what was computed
            await cache.flush()  # the drop of the failed pages ran
            stats = cache.statistics()
            assert stats.load_back_corrupt_pages == 1
            events = cache.take_events()
            removed = [e for e in events if isinstance(e, akv.BlockRemoved)]
            hashes = chain_hashes(namespace_seed(namespace_of(tag, "", "").tag), PROMPT, 2)
            media = {e.medium for e in removed}
            assert media == {"CPU", "STORAGE"}, media
            for e in removed:
                assert hashes[flip] in e.block_hashes, e
                assert not set(hashes[:flip]) & set(e.block_hashes), e
            # the key and those after it are gone from the store, the verified ones stay
            assert mc_storage.exists(_keys(_cfg(tag, mooncake_master))) == [True] * flip + [
                False
            ] * (PAGES - flip)
            cache.check_invariants()
            cache.release(m)
            again = cache.match_prefix(PROMPT)
            assert (again.device_len, again.host_len) == (keep, 0)
            cache.release(again)
            cache.check_invariants()


@pytest.mark.mooncake
@pytest.mark.timeout(120)
async def test_a_page_that_verifies_at_load_back_is_served(
    mooncake_master: MasterProc, mc_storage: MooncakeStorage, tag: str
) -> None:
    engine = ManualCopyEngine()
    async with akv.HiCache(_cfg(tag, mooncake_master), copy_engine=engine) as writer:
        written = await _write(writer, engine, flip=None)
        async with akv.HiCache(_cfg(tag, mooncake_master)) as cache:
            res = await cache.prefetch(PROMPT)
            assert res.status is PrefetchStatus.COMPLETE and res.hit_tokens == 16
            host = cache._core.host_pool
            assert host is not None and host.unverified.sum() == PAGES
            m = cache.match_prefix(PROMPT)
            await cache.load_back(m)
            assert (m.device_len, m.host_len) == (16, 0)
            got = read_kv(cache, m.device_indices)
            for a, b in zip(got, written, strict=True):
                assert torch.equal(a, b)
            assert host.unverified.sum() == 0  # verified once, by the copy
            assert cache.statistics().load_back_corrupt_pages == 0
            cache.release(m)
            await cache.flush()
            assert mc_storage.exists(_keys(_cfg(tag, mooncake_master))) == [True] * PAGES
            cache.check_invariants()
