"""The storage tier through the cache: backup after acks, prefetch, tag-once keys, faults.

FileStorage is the real embedded backend; ``FlakyStorage`` wraps it to inject per-page failures
and stalls (a fake behind the same protocol, in addition to the real parts).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

import aiocache_kv as akv
from aiocache_kv.storage import FileStorage, PageBuffer, parse_storage_key
from aiocache_kv.storage.key_layout import key_components
from aiocache_kv.storage.keys import storage_key
from aiocache_kv.storage.tier import PrefetchStatus
from aiocache_kv.testing import ManualCopyEngine, MemoryStorage
from aiocache_kv.tree import TierState
from aiocache_kv.tree.hashing import chain_hashes
from tests.conftest import small_config
from tests.test_cache import read_kv
from tests.test_split_ack import insert, write_kv

PROMPT = list(range(10, 26))  # 16 tokens = 8 pages of 2


def cfg(path: Path, **kw: object) -> akv.CacheConfig:
    opts: dict[str, object] = dict(
        storage=FileStorage(path), prefetch_threshold_tokens=0, prefetch_policy="wait_complete"
    )
    opts.update(kw)
    return small_config(**opts)


class FlakyStorage(FileStorage):
    """FileStorage that fails chosen keys on put/get and can stall get_into."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.fail_put: set[int] = set()  # indices within a put batch
        self.fail_get_keys: set[str] = set()
        self.stall = threading.Event()
        self.stall.set()

    def put(
        self,
        keys: Sequence[str],
        buffers: Sequence[PageBuffer],
        identities: Sequence[bytes] | None = None,
    ) -> list[bool]:
        return self.put_chain(keys, buffers, [None] * len(keys), identities)

    def put_chain(
        self,
        keys: Sequence[str],
        buffers: Sequence[PageBuffer],
        parents: Sequence[str | None],
        identities: Sequence[bytes] | None = None,
    ) -> list[bool]:
        out = super().put_chain(keys, buffers, parents, identities)
        for i in self.fail_put:
            if i < len(out):
                self.remove([keys[i]])
                out[i] = False
        return out

    def get_into(
        self,
        keys: Sequence[str],
        buffers: Sequence[PageBuffer],
        identities: Sequence[bytes] | None = None,
    ) -> list[bool]:
        self.stall.wait(30)
        out = super().get_into(keys, buffers, identities)
        return [ok and k not in self.fail_get_keys for k, ok in zip(keys, out, strict=True)]


async def stored_prompt(path: Path, tokens: list[int] = PROMPT) -> list[torch.Tensor]:
    """Insert ``tokens`` in a first cache, persist it to ``path``, return the KV written."""
    async with akv.HiCache(cfg(path)) as cache:
        slots = cache.alloc(len(tokens))
        kv = write_kv(cache, slots, seed=11)
        cache.release(cache.insert(tokens, slots))
        await cache.flush()
        stats = cache.statistics()
        assert stats.backup_pages_ok == len(tokens) // 2 and stats.backup_pages_failed == 0
    return kv


async def test_backup_follows_ack_for_every_split_fragment(tmp_path: Path) -> None:
    engine = ManualCopyEngine()
    store = FileStorage(tmp_path)
    async with akv.HiCache(cfg(tmp_path, storage=store), copy_engine=engine) as cache:
        r1 = insert(cache, [1, 2, 3, 4])
        r2 = insert(cache, [1, 2, 5, 6])  # split before the ack
        engine.complete_all()
        await cache.flush()
        events = [e for e in cache.take_events() if isinstance(e, akv.BlockStored)]
        stored = [e.token_ids for e in events if e.medium == "STORAGE"]
        assert sorted(stored) == [[1, 2], [3, 4], [5, 6]]
        hashes = {h for e in events if e.medium == "STORAGE" for h in e.block_hashes}
        # L3 contents agree with the events: one file per page, keyed by that page's hash
        keys = await raw_keys(tmp_path)
        assert len(keys) == 3
        assert {parse_storage_key(k).page_hash for k in keys} == hashes
        for node in cache._tree.walk():
            assert node.storage is TierState.RESIDENT
        cache.release(r1)
        cache.release(r2)
        cache.check_invariants()


async def raw_keys(path: Path) -> list[str]:
    """Raw keys as stored on disk, read off the loop."""
    return await asyncio.to_thread(_all_keys, path)


def _all_keys(path: Path) -> list[str]:
    """Raw keys as stored on disk (FileStorage keeps the key in each file's header)."""
    out = []
    for f in sorted(path.rglob("*.kv")):
        data = f.read_bytes()
        klen = int.from_bytes(data[4:8], "little")  # then the 20-byte parent name
        out.append(data[28 : 28 + klen].decode())
    return out


async def test_prefetch_in_a_new_cache_is_bit_identical(tmp_path: Path) -> None:
    written = await stored_prompt(tmp_path)
    async with akv.HiCache(cfg(tmp_path)) as cache:
        m = cache.match_prefix(PROMPT)
        assert m.matched_len == 0
        cache.release(m)
        res = await cache.prefetch([*PROMPT, 99])
        assert res.status is PrefetchStatus.COMPLETE
        assert (res.cached_tokens, res.storage_hit_tokens, res.hit_tokens) == (0, 16, 16)
        m = cache.match_prefix(PROMPT)
        assert (m.device_len, m.host_len) == (0, 16)
        await cache.load_back(m)
        for a, b in zip(read_kv(cache, m.device_indices), written, strict=True):
            assert torch.equal(a, b)
        cache.release(m)
        cache.check_invariants()
        stats = cache.statistics()
        assert stats.prefetch_reserved_pages == 0 and stats.host.protected_pages == 0
        kinds = {(type(e).__name__, getattr(e, "medium", "")) for e in cache.take_events()}
        assert ("BlockStored", "CPU") in kinds and ("BlockStored", "GPU") in kinds


async def test_prefetch_extends_a_cached_prefix(tmp_path: Path) -> None:
    await stored_prompt(tmp_path)
    async with akv.HiCache(cfg(tmp_path)) as cache:
        cache.release(insert(cache, PROMPT[:6]))  # the first 3 pages are already cached
        await cache.flush()
        res = await cache.prefetch(PROMPT)
        assert (res.cached_tokens, res.hit_tokens) == (6, 10)
        m = cache.match_prefix(PROMPT)
        assert m.matched_len == 16
        cache.release(m)
        cache.check_invariants()


async def test_keys_carry_exactly_one_tag_and_tenants_are_isolated(tmp_path: Path) -> None:
    async with akv.HiCache(cfg(tmp_path)) as cache:
        for tenant in ("alice", "bob"):
            slots = cache.alloc(4)
            write_kv(cache, slots, seed=1)
            cache.release(cache.insert([1, 2, 3, 4], slots, tenant=tenant))
        await cache.flush()
        tags = {akv.Namespace(cache.config.namespace, t).tag for t in ("alice", "bob")}
    keys = await raw_keys(tmp_path)
    assert len(keys) == 4
    for key in keys:
        parsed = parse_storage_key(key)  # rejects a key tagged twice
        assert parsed.tag in tags and key.count(parsed.tag) == 1
        assert "alice" not in key and "bob" not in key  # the salt is not readable in keys
    async with akv.HiCache(cfg(tmp_path)) as cache:
        res = await cache.prefetch([1, 2, 3, 4], tenant="carol")
        assert res.status is PrefetchStatus.MISS and res.hit_tokens == 0
        res = await cache.prefetch([1, 2, 3, 4], tenant="bob")
        assert res.hit_tokens == 4


async def test_corrupt_page_is_a_miss_and_only_the_leading_run_commits(tmp_path: Path) -> None:
    await stored_prompt(tmp_path)
    store = FileStorage(tmp_path)
    keys = await raw_keys(tmp_path)
    # corrupt the 4th page of the prompt (find it by its position in the hash chain)
    async with akv.HiCache(cfg(tmp_path, storage=store)) as cache:
        from aiocache_kv.tree.hashing import chain_hashes

        ns = cache._ns(None, None)
        hashes = chain_hashes(cache._tree._seeds.get(ns) or _seed(ns.tag), PROMPT, 2)
        victim = next(k for k in keys if parse_storage_key(k).page_hash == hashes[3])
        path = store.path_of(victim)
        data = bytearray(await asyncio.to_thread(path.read_bytes))
        data[len(data) // 2] ^= 0xFF
        await asyncio.to_thread(path.write_bytes, bytes(data))
        cache.take_events()
        res = await cache.prefetch(PROMPT)
        assert res.status is PrefetchStatus.PARTIAL and res.hit_tokens == 6
        removed = [e for e in cache.take_events() if isinstance(e, akv.BlockRemoved)]
        assert removed == [akv.BlockRemoved([hashes[3]], "STORAGE")]  # the corrupt page
        stats = cache.statistics()
        assert stats.prefetch_pages_discarded == 5 and stats.prefetch_reserved_pages == 0
        assert cache.config.storage.statistics().corrupt == 1  # type: ignore[union-attr]
        cache.check_invariants()


def _seed(tag: str) -> int:
    from aiocache_kv.tree.hashing import namespace_seed

    return namespace_seed(tag)


async def test_partial_backup_failure_is_recorded_per_page(tmp_path: Path) -> None:
    store = FlakyStorage(tmp_path)
    store.fail_put = {1}  # the second page of the batch
    async with akv.HiCache(cfg(tmp_path, storage=store, storage_retry_seconds=0.0)) as cache:
        r = insert(cache, [1, 2, 3, 4, 5, 6])
        await cache.flush()
        stats = cache.statistics()
        assert (stats.backup_pages_ok, stats.backup_pages_failed) == (0, 3)
        storage_events = [e for e in cache.take_events() if getattr(e, "medium", "") == "STORAGE"]
        assert storage_events == []  # never reported as stored
        assert all(n.storage is TierState.ABSENT for n in cache._tree.walk())
        assert len(await raw_keys(tmp_path)) == 2  # statistics and L3 contents agree: 2 of 3 pages
        # a later hit retries; now the store works
        store.fail_put = set()
        cache.release(cache.match_prefix([1, 2, 3, 4, 5, 6]))
        await cache.flush()
        assert cache.statistics().backup_pages_ok == 3
        assert len(await raw_keys(tmp_path)) == 3
        cache.release(r)
        cache.check_invariants()


async def test_a_store_refusing_some_pages_is_no_reason_to_stop_backing_up(
    tmp_path: Path,
) -> None:
    """A full store refuses a page now and then while it evicts (Mooncake's -200): the tier
    backs off only when the store took nothing, so one refused page does not cost the next
    prompts their backups."""
    store = FlakyStorage(tmp_path)
    store.fail_put = {1}
    async with akv.HiCache(cfg(tmp_path, storage=store, storage_retry_seconds=60.0)) as cache:
        cache.release(insert(cache, [1, 2, 3, 4, 5, 6]))
        await cache.flush()
        st = cache.statistics()
        assert (st.backup_pages_ok, st.backup_pages_failed) == (0, 3)
        store.fail_put = set()
        cache.release(insert(cache, [7, 8, 9, 10]))
        await cache.flush()
        st = cache.statistics()
        assert (st.backup_pages_ok, st.backup_skipped_pages) == (2, 0)
        store.fail_put = set(range(16))  # now it takes nothing: rest
        cache.release(insert(cache, [11, 12, 13, 14]))
        await cache.flush()
        store.fail_put = set()
        cache.release(insert(cache, [15, 16, 17, 18]))
        await cache.flush()
        st = cache.statistics()
        assert (st.backup_pages_ok, st.backup_pages_failed, st.backup_skipped_pages) == (2, 5, 2)
        cache.check_invariants()


class StallSecondBatch(FlakyStorage):
    """Reads of the batch that holds ``stalled_key`` hang until ``stall`` is set."""

    stalled_key = ""

    def get_into(
        self,
        keys: Sequence[str],
        buffers: Sequence[PageBuffer],
        identities: Sequence[bytes] | None = None,
    ) -> list[bool]:
        if self.stalled_key in keys:
            return super().get_into(keys, buffers, identities)
        return FileStorage.get_into(self, keys, buffers, identities)


async def test_prefetch_timeout_commits_the_batches_that_landed(tmp_path: Path) -> None:
    """8 pages read 2 a batch by 2 workers taking batches in turn from one order; B's read
    of pages 2-3 hangs.  By the deadline A read every other batch and reported them: the
    leading run (pages 0-1) commits, pages 4-7 landed but are not reachable and are freed,
    and the hung batch's 2 pages stay the worker's until it returns."""
    await stored_prompt(tmp_path)
    store = StallSecondBatch(tmp_path)
    opts = dict(
        storage=store,
        prefetch_policy="timeout",
        prefetch_timeout_base=0.3,
        prefetch_timeout_per_1k=0.0,
        prefetch_batch_pages=2,
    )
    async with akv.HiCache(cfg(tmp_path, **opts)) as cache:
        ns = cache._ns(None, None)
        hashes = chain_hashes(_seed(ns.tag), PROMPT, 2)
        store.stalled_key = storage_key(ns.tag, hashes[2], key_components(cache.config)[0])
        store.stall.clear()
        res = await cache.prefetch(PROMPT)
        assert res.status is PrefetchStatus.PARTIAL and res.hit_tokens == 4
        m = cache.match_prefix(PROMPT)
        assert (m.device_len, m.host_len) == (0, 4)
        cache.release(m)
        stats = cache.statistics()
        assert stats.prefetch_reserved_pages == 0 and stats.host.quarantined_pages == 2
        store.stall.set()
        await cache.flush()
        assert cache.statistics().host.quarantined_pages == 0
        cache.check_invariants()


async def test_prefetch_timeout_returns_by_deadline_and_frees_pages(tmp_path: Path) -> None:
    await stored_prompt(tmp_path)
    store = FlakyStorage(tmp_path)
    opts = dict(
        storage=store,
        prefetch_policy="timeout",
        prefetch_timeout_base=0.2,
        prefetch_timeout_per_1k=0.0,
        prefetch_batch_pages=2,
    )
    async with akv.HiCache(cfg(tmp_path, **opts)) as cache:
        store.stall.clear()  # reads hang until released
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        res = await cache.prefetch(PROMPT)
        assert loop.time() - t0 < 2.0
        assert res.status is PrefetchStatus.PARTIAL and res.hit_tokens == 0
        # the two reads in flight (2 pages each) still hold theirs: freed, but quarantined
        # until they let go; the 4 pages no read started on are free at once
        stats = cache.statistics()
        assert stats.prefetch_reserved_pages == 0 and stats.host.quarantined_pages == 4
        assert stats.host.free_pages == 32 - 4
        m = cache.match_prefix(PROMPT)  # the cache keeps serving meanwhile
        cache.release(m)
        store.stall.set()
        await cache.flush()
        stats = cache.statistics()
        assert stats.prefetch_reserved_pages == 0 and stats.host.free_pages == 32
        cache.check_invariants()


async def test_cancelled_prefetch_frees_every_reserved_page(tmp_path: Path) -> None:
    await stored_prompt(tmp_path)
    store = FlakyStorage(tmp_path)
    async with akv.HiCache(cfg(tmp_path, storage=store)) as cache:
        store.stall.clear()
        task = asyncio.create_task(cache.prefetch(PROMPT))
        for _ in range(200):
            await asyncio.sleep(0.005)
            if cache.statistics().prefetch_reserved_pages:
                break
        assert cache.statistics().prefetch_reserved_pages == 8
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        stats = cache.statistics()
        assert stats.prefetch_reserved_pages == 0 and stats.host.quarantined_pages == 8
        store.stall.set()
        await cache.flush()
        stats = cache.statistics()
        assert stats.prefetch_reserved_pages == 0 and stats.host.free_pages == 32
        assert stats.host.quarantined_pages == 0
        assert stats.device.protected_pages == 0 and stats.host.protected_pages == 0
        cache.check_invariants()


async def test_best_effort_commits_in_background(tmp_path: Path) -> None:
    await stored_prompt(tmp_path)
    async with akv.HiCache(cfg(tmp_path, prefetch_policy="best_effort")) as cache:
        res = await cache.prefetch(PROMPT)
        assert res.status is PrefetchStatus.BACKGROUND and res.hit_tokens == 0
        await cache.flush()
        m = cache.match_prefix(PROMPT)
        assert m.host_len == 16
        cache.release(m)


async def test_prefetch_in_flight_is_capped_at_half_the_host_pool(tmp_path: Path) -> None:
    await stored_prompt(tmp_path)
    async with akv.HiCache(cfg(tmp_path, host_pages=8)) as cache:
        res = await cache.prefetch(PROMPT)
        assert res.storage_hit_tokens == 16 and res.hit_tokens == 8  # 4 of 8 host pages
        cache.check_invariants()


async def test_threshold_and_no_storage(tmp_path: Path) -> None:
    async with akv.HiCache(cfg(tmp_path, prefetch_threshold_tokens=64)) as cache:
        res = await cache.prefetch(PROMPT)
        assert res.status is PrefetchStatus.BELOW_THRESHOLD
        assert cache.statistics().device.protected_pages == 0
    async with akv.HiCache(small_config()) as cache:
        res = await cache.prefetch(PROMPT)
        assert res.status is PrefetchStatus.NO_STORAGE
        with pytest.raises(akv.InvalidInputError):
            await cache.prefetch(PROMPT, policy="eventually")


async def test_unwritable_storage_dir_fails_at_start(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    await asyncio.to_thread(blocker.write_bytes, b"x")
    with pytest.raises(akv.StorageError):
        async with akv.HiCache(cfg(blocker / "sub")):
            pass


class SlowToOpen(FileStorage):
    """A FileStorage whose ``open`` takes ``delay`` seconds (a big directory to index)."""

    def __init__(self, path: Path, delay: float) -> None:
        super().__init__(path)
        self.delay = delay

    def open(self) -> None:
        threading.Event().wait(self.delay)  # on the storage worker, never the loop
        super().open()


async def test_opening_storage_is_bounded_by_its_own_deadline(tmp_path: Path) -> None:
    """Opening can take far longer than one storage call (the index of a big directory is
    rebuilt; Mooncake connects): it is bounded by ``storage_open_timeout``, not by the
    per-call ``storage_timeout``.  A cache whose calls must answer in 0.2 s used to fail to
    start whenever the open took longer than that."""
    slow = SlowToOpen(tmp_path / "a", 0.6)
    async with akv.HiCache(cfg(tmp_path, storage=slow, storage_timeout=0.2)) as cache:
        slots = cache.alloc(len(PROMPT))
        write_kv(cache, slots, seed=1)
        cache.release(cache.insert(PROMPT, slots))
        await cache.flush()
        assert cache.statistics().backup_pages_ok == len(PROMPT) // cache.config.page_size
    stuck = SlowToOpen(tmp_path / "b", 5.0)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(akv.StorageTimeoutError, match="open"):
        async with akv.HiCache(cfg(tmp_path, storage=stuck, storage_open_timeout=0.3)):
            pass
    assert loop.time() - t0 < 3.0, "start waited past storage_open_timeout"


def test_storage_must_be_a_backend() -> None:
    with pytest.raises(akv.ConfigError, match="StorageBackend"):
        small_config(storage="/tmp/kv")


class CallLog(FileStorage):
    """FileStorage that records the size of every read and the threads that ran them."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.reads: list[int] = []
        self.threads: set[int] = set()
        self.both = threading.Barrier(2, timeout=10)

    def get_into(
        self,
        keys: Sequence[str],
        buffers: Sequence[PageBuffer],
        identities: Sequence[bytes] | None = None,
    ) -> list[bool]:
        self.reads.append(len(keys))
        self.threads.add(threading.get_ident())
        self.both.wait()  # returns only once two reads run at the same time
        return super().get_into(keys, buffers, identities)


@pytest.mark.parametrize("batch", [8, 100])
async def test_prefetch_spreads_one_batch_over_every_worker(tmp_path: Path, batch: int) -> None:
    """8 pages and a batch of 8 (or more): two reads of 4, on two workers at once, not one
    read of 8 while the other worker idles; each still at most ``prefetch_batch_pages``."""
    written = await stored_prompt(tmp_path)
    store = CallLog(tmp_path)
    async with akv.HiCache(
        cfg(tmp_path, storage=store, storage_workers=2, prefetch_batch_pages=batch)
    ) as cache:
        res = await cache.prefetch(PROMPT)
        assert res.status is PrefetchStatus.COMPLETE and res.hit_tokens == 16
        assert store.reads == [4, 4] and len(store.threads) == 2
        m = cache.match_prefix(PROMPT)
        await cache.load_back(m)
        for a, b in zip(read_kv(cache, m.device_indices), written, strict=True):
            assert torch.equal(a, b)
        cache.release(m)
        cache.check_invariants()


async def test_a_silently_evicted_page_is_retracted_when_a_prefetch_finds_it_gone() -> None:
    """A store that evicts without telling (Mooncake) after the node holding the pages left
    the tree: the prefetch that finds a claimed page missing publishes its
    ``BlockRemoved(STORAGE)``, once, for every claimed page it asked about, beyond the
    leading run too; a page never claimed is not retracted."""
    store = MemoryStorage()
    stored: set[int] = set()

    def feed(cache: akv.HiCache) -> list[int]:
        removed: list[int] = []
        for e in cache.take_events():
            if isinstance(e, akv.BlockStored) and e.medium == "STORAGE":
                stored.update(e.block_hashes)
            elif isinstance(e, akv.BlockRemoved) and e.medium == "STORAGE":
                stored.difference_update(e.block_hashes)
                removed += e.block_hashes
        return removed

    async with akv.HiCache(
        small_config(
            storage=store,
            enable_kv_events=True,
            prefetch_threshold_tokens=0,
            prefetch_policy="wait_complete",
        )
    ) as cache:
        slots = cache.alloc(len(PROMPT))
        kv = write_kv(cache, slots, seed=3)
        cache.release(cache.insert(PROMPT, slots))
        await cache.flush()
        feed(cache)
        (node,) = cache._tree.walk()
        hashes = list(cache._tree.block_hashes(node))
        del node
        assert stored == set(hashes)
        cache.evict(1 << 20)
        cache.evict(1 << 20, tier="host")  # the node leaves the tree: its claim is orphaned
        assert feed(cache) == []
        keys = {parse_storage_key(k).page_hash: k for k in store.contents()}
        assert store.drop(keys[hashes[2]]) and store.drop(keys[hashes[5]])
        res = await cache.prefetch(PROMPT)
        assert res.hit_tokens == 4  # pages 0 and 1
        assert feed(cache) == [hashes[2], hashes[5]]
        assert stored == set(hashes) - {hashes[2], hashes[5]}
        m = cache.match_prefix(PROMPT)
        await cache.load_back(m)
        got = read_kv(cache, m.device_indices[:4])
        assert all(torch.equal(g, w[:4]) for g, w in zip(got, kv, strict=True))
        cache.release(m)
        cache.evict(1 << 20)
        cache.evict(1 << 20, tier="host")
        feed(cache)
        await cache.prefetch(PROMPT)
        assert feed(cache) == []  # retracted once


class _ShortGet(MemoryStorage):
    """A backend whose reads answer one verdict fewer than they were given keys."""

    short = False

    def get_into(
        self,
        keys: Sequence[str],
        buffers: Sequence[PageBuffer],
        identities: Sequence[bytes] | None = None,
    ) -> list[bool]:
        out = super().get_into(keys, buffers, identities)
        return out[:-1] if self.short else out


async def test_a_read_answering_too_few_verdicts_loads_nothing_unverified() -> None:
    """A buggy backend's short answer to a read: the prefetch ends (no hang), commits only
    pages it has a verdict for, serves exactly what was computed, and leaks nothing."""
    store = _ShortGet()
    toks = list(range(100, 112))  # 6 pages of 2
    cfg = small_config(storage=store, prefetch_threshold_tokens=0, prefetch_policy="wait_complete")
    async with akv.HiCache(cfg) as cache:
        slots = cache.alloc(len(toks))
        written = write_kv(cache, slots, seed=4)
        cache.release(cache.insert(toks, slots))
        await cache.flush()
    store.short = True
    async with akv.HiCache(cfg) as cache:
        res = await asyncio.wait_for(cache.prefetch(toks), 10)
        assert res.status is PrefetchStatus.PARTIAL and res.hit_tokens < len(toks)
        m = cache.match_prefix(toks)
        assert m.matched_len == res.hit_tokens
        await cache.load_back(m)
        for a, b in zip(read_kv(cache, m.device_indices), written, strict=True):
            assert torch.equal(a, b[: m.matched_len])
        cache.release(m)
        assert cache.statistics().host.quarantined_pages == 0
        cache.check_invariants()
