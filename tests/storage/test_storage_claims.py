"""What the cache claims in STORAGE is in the store, and a snapshot carries all of it.

A bounded ``FileStorage`` evicts while several workers put: a page evicted before the backup
that wrote it landed (by another put, or by another slice of the same spread backup) must
never be claimed.  A consumer that joins late must get every page the stream still claims in
storage, those of prompts that left the device and the host too, and after ``aclose`` only
those.  Hashes are compared as the cache reports them (events, ``parse_storage_key``), never
as ints.
"""

from __future__ import annotations

import asyncio
import gc
import random
import threading
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import pytest

import aiocache_kv as akv
from aiocache_kv.storage import FileStorage, PageBuffer, parse_storage_key, tier
from aiocache_kv.storage.stored_pages import StoredPages
from aiocache_kv.tree import Node, TierState
from tests.conftest import small_config
from tests.test_split_ack import insert

MEDIA = ("GPU", "CPU", "STORAGE")


class RecordingStore(FileStorage):
    """A ``FileStorage`` that remembers every key it was asked to put and holds each put for
    a seeded random moment first, so that puts on several workers interleave per seed."""

    def __init__(self, path: Path, capacity_bytes: int | None, seed: int = 0) -> None:
        super().__init__(path, capacity_bytes=capacity_bytes)
        self.keys: set[str] = set()
        self._rng = random.Random(seed)
        self._mutex = threading.Lock()

    def put_chain(
        self,
        keys: Sequence[str],
        buffers: Sequence[PageBuffer],
        parents: Sequence[str | None],
        **kw: Any,
    ) -> list[bool]:
        with self._mutex:
            self.keys.update(keys)
            pause = self._rng.random() * 0.004
        threading.Event().wait(pause)
        return super().put_chain(keys, buffers, parents, **kw)

    async def present(self) -> set[Hashable]:
        """The page hashes of every key ever put that the store holds now (once closed: the
        directory as a fresh store opened on it finds it)."""
        keys = sorted(self.keys)

        def exists() -> list[bool]:
            try:
                return self.exists(keys)
            except akv.StorageUnavailableError:  # closed with its cache
                again = FileStorage(self.root, capacity_bytes=None)
                try:
                    return again.exists(keys)
                finally:
                    again.close()

        there = await asyncio.to_thread(exists)
        return {parse_storage_key(k).page_hash for k, ok in zip(keys, there, strict=True) if ok}


class View:
    """A consumer's index, medium by medium, built from events alone."""

    def __init__(self, events: Sequence[akv.KVEvent] = ()) -> None:
        self.media: dict[str, set[Hashable]] = {m: set() for m in MEDIA}
        #: STORAGE: (hash, stored?) in stream order
        self.history: list[tuple[Hashable, bool]] = []
        self.feed(events)

    def feed(self, events: Sequence[akv.KVEvent]) -> None:
        for e in events:
            if isinstance(e, akv.BlockStored):
                self.media[e.medium] |= set(e.block_hashes)
                if e.medium == "STORAGE":
                    self.history += [(h, True) for h in e.block_hashes]
            elif isinstance(e, akv.BlockRemoved):
                self.media[e.medium] -= set(e.block_hashes)
                if e.medium == "STORAGE":
                    self.history += [(h, False) for h in e.block_hashes]
            elif isinstance(e, akv.AllBlocksCleared):
                for held in self.media.values():
                    held.clear()

    def restored_after_removal(self, absent: set[Hashable]) -> list[Hashable]:
        """Pages of ``absent`` that the stream announced stored after it said they left."""
        removed: set[Hashable] = set()
        out = []
        for h, stored in self.history:
            if not stored:
                removed.add(h)
            elif h in removed and h in absent:
                out.append(h)
        return out


def test_claims_are_every_page_still_claimed_once_with_what_announced_it() -> None:
    root = Node([], None, "ns")
    a, b = Node([1, 2, 3, 4, 5, 6], root, "ns"), Node([7, 8], root, "ns")
    root.children.update({1: a, 7: b})
    table = StoredPages(orphan_limit=8)
    table.remember(a, ["a0", "a1", "a2"], "p", 4)
    table.remember(b, ["a2", "b0"])  # a2 is b's now
    assert table.pop("a1") is a  # evicted
    got = {run.tokens[0]: (held, run.parent, run.start) for run, held in table.claims()}
    assert got == {1: ([0], "p", 4), 7: ([0, 1], None, 0)}
    del root.children[7], b
    gc.collect()  # b left the tree: its claims are orphaned, announced as it announced them
    (_, held_a), (run_b, held_b) = table.claims()
    assert (held_a, held_b) == ([0], [0, 1])
    assert run_b.hashes == ["a2", "b0"] and run_b.tokens == [7, 8]


def tree_view(cache: akv.HiCache) -> dict[str, set[Hashable]]:
    """What the tree holds, medium by medium (CPU: only what was announced on CPU)."""
    tree = cache._tree
    out: dict[str, set[Hashable]] = {m: set() for m in MEDIA}
    for node in tree.walk():
        hashes = tree.block_hashes(node)
        if node.device is TierState.RESIDENT:
            out["GPU"].update(hashes)
        if node.host is TierState.RESIDENT and not node.cpu_hidden:
            out["CPU"].update(hashes)
        if node.storage is TierState.RESIDENT:
            out["STORAGE"].update(hashes)
    return out


def cfg(store: FileStorage, **kw: object) -> akv.CacheConfig:
    opts: dict[str, object] = dict(
        storage=store,
        storage_retry_seconds=0.0,
        prefetch_threshold_tokens=0,
        prefetch_policy="wait_complete",
    )
    opts.update(kw)
    return small_config(**opts)


async def page_file_bytes(tmp_path: Path) -> int:
    """The size of one page file of the test config."""
    store = FileStorage(tmp_path / "size", capacity_bytes=None)
    async with akv.HiCache(cfg(store)) as cache:
        cache.release(insert(cache, [1, 2]))
        await cache.flush()
        return store.total_bytes()


def prompt(rng: random.Random) -> list[int]:
    base = rng.randrange(1, 1 << 40)
    return [base + i for i in range(2 * rng.randint(2, 6))]  # 2-6 pages of 2


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
async def test_a_bounded_store_under_concurrent_backups_is_claimed_only_where_it_holds(
    seed: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four workers, every backup spread over the idle ones (slices evict each other's
    pages), puts held for seeded random moments; the store holds 12 pages of ~80 put."""
    monkeypatch.setattr(tier, "BACKUP_PART_BYTES", 1)
    size = await page_file_bytes(tmp_path)
    store = RecordingStore(tmp_path / "kv", 12 * size, seed)
    rng = random.Random(seed)
    view = View()
    config = cfg(store, storage_workers=4, device_pages=64, host_pages=128)
    async with akv.HiCache(config) as cache:
        for _ in range(6):
            handles = [insert(cache, prompt(rng), seed=k) for k in range(3)]
            await asyncio.sleep(rng.random() * 0.01)
            for h in handles:
                cache.release(h)
            view.feed(cache.take_events())
        await cache.flush()
        view.feed(cache.take_events())
        there = await store.present()
        claimed = view.media["STORAGE"]
        assert claimed, f"seed {seed}: nothing was stored"
        assert claimed <= there, f"seed {seed}: {len(claimed - there)} claimed pages absent"
        in_tree = tree_view(cache)["STORAGE"]
        assert in_tree <= there, f"seed {seed}: {len(in_tree - there)} RESIDENT pages absent"
        assert view.restored_after_removal({h for h, _ in view.history} - there) == []
        assert cache.statistics().evicted_pages_storage > 0
        cache.check_invariants()


def _per_page(events: Sequence[akv.KVEvent], medium: str) -> dict[Hashable, tuple[Any, ...]]:
    """hash -> (parent hash, its tokens, block size, lora, salt) of every page ``medium``'s
    ``BlockStored`` events announced (the last announcement wins)."""
    out: dict[Hashable, tuple[Any, ...]] = {}
    for e in events:
        if isinstance(e, akv.BlockStored) and e.medium == medium:
            p = e.block_size
            parent = e.parent_block_hash
            for i, h in enumerate(e.block_hashes):
                tokens = tuple(e.token_ids[i * p : (i + 1) * p])
                out[h] = (parent, tokens, p, e.lora_name, e.cache_salt)
                parent = h
    return out


async def _leave_device_and_host(cache: akv.HiCache) -> None:
    cfg_ = cache.config
    cache.evict(cfg_.device_pages, tier="device")
    await cache.flush()
    cache.evict(cfg_.host_pages, tier="host")


async def test_a_snapshot_carries_the_storage_pages_of_prompts_that_left_the_tree(
    tmp_path: Path,
) -> None:
    store = RecordingStore(tmp_path / "kv", None)
    stream: list[akv.KVEvent] = []
    async with akv.HiCache(cfg(store)) as cache:
        for k in range(6):  # 24 pages, two namespaces
            tokens = [1000 * k + i for i in range(8)]
            if k % 2:
                slots = cache.alloc(8)
                cache.release(cache.insert(tokens, slots, lora="adapter-a"))
            else:
                cache.release(insert(cache, tokens, seed=k))
            await cache.flush()
        stream += cache.take_events()
        await _leave_device_and_host(cache)
        stream += cache.take_events()
        assert not list(cache._tree.walk())  # every prompt left the device and the host
        want = View(stream)
        assert len(want.media["STORAGE"]) == 24 and not want.media["GPU"] | want.media["CPU"]
        assert want.media["STORAGE"] <= await store.present()  # the store still serves them
        snap = cache.snapshot_events()
        assert View(snap).media == want.media
        # each page as the stream announced it: parent, tokens, namespace
        assert _per_page(snap, "STORAGE") == _per_page(stream, "STORAGE")
        # parents before children
        seen: set[Hashable] = set()
        for e in snap:
            assert e.parent_block_hash is None or e.parent_block_hash in seen
            seen.update(e.block_hashes)
        # the store still serves them: a prompt prefetched back is announced again on CPU
        res = await cache.prefetch(list(range(8)))
        assert res.hit_tokens == 8
        assert View(cache.snapshot_events()).media["STORAGE"] == want.media["STORAGE"]


async def test_a_snapshot_after_close_is_what_the_stream_left_claimed(tmp_path: Path) -> None:
    store = RecordingStore(tmp_path / "kv", None)
    cache = akv.HiCache(cfg(store))
    await cache.start()
    view = View()
    for k in range(3):  # on GPU, CPU and in storage
        cache.release(insert(cache, [100 * k + i for i in range(6)], seed=k))
        await cache.flush()
    view.feed(cache.take_events())
    before = View(cache.snapshot_events())
    assert before.media == view.media and all(len(v) == 9 for v in view.media.values())
    await cache.aclose()
    view.feed(cache.take_events())  # the close: every GPU and CPU block removed
    assert not view.media["GPU"] and not view.media["CPU"]
    assert view.media["STORAGE"] == before.media["STORAGE"]
    assert View(cache.snapshot_events()).media == view.media
    assert view.media["STORAGE"] <= await store.present()


async def workload(
    cache: akv.HiCache, rng: random.Random, steps: int, prompts: list[list[int]]
) -> None:
    """Seeded serving: prompts (added to ``prompts``; half of them extend an earlier one's
    prefix, so nodes split), hits, evictions from the device and the host, prefetches and
    flushes."""
    for _ in range(steps):
        op = rng.random()
        if op < 0.45:
            if prompts and rng.random() < 0.5:
                base = rng.choice(prompts)
                cut = 2 * rng.randint(1, len(base) // 2)
                toks = base[:cut] + prompt(rng)[: 2 * rng.randint(1, 3)]
            else:
                toks = prompt(rng)
            m = cache.match_prefix(toks)
            try:
                await cache.load_back(m)
                slots = cache.alloc(len(toks) - m.device_len)
            except akv.CapacityError:
                cache.release(m)
                continue
            cache.release(cache.insert(toks, slots, prefix=m))
            cache.release(m)
            prompts.append(toks)
        elif op < 0.6 and prompts:
            cache.release(cache.match_prefix(rng.choice(prompts)))  # a hit backs it up again
        elif op < 0.7:
            cache.evict(rng.randint(1, 10), tier="device")
        elif op < 0.8:
            cache.evict(rng.randint(1, 10), tier="host")
        elif op < 0.9 and prompts:
            await cache.prefetch(rng.choice(prompts))
        else:
            await cache.flush()
        await asyncio.sleep(rng.random() * 0.003)


def claims_config(store: FileStorage) -> akv.CacheConfig:
    return cfg(store, storage_workers=3, device_pages=24, host_pages=40)


@pytest.mark.parametrize("seed", [4, 5, 6])
async def test_a_snapshot_then_the_stream_is_the_stream_in_every_medium(
    seed: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A consumer that applies a snapshot taken midway, then every later event, holds what
    one that read the stream from the start holds, medium by medium: on GPU and CPU what
    the tree holds, in STORAGE at least the tree's storage-resident pages and nothing the
    store lacks; before the close and after it (then storage only).  Prompts share
    prefixes (nodes split), leave the device and the host, come back by prefetch; the
    store is bounded and several workers put at once."""
    monkeypatch.setattr(tier, "BACKUP_PART_BYTES", 1)
    size = await page_file_bytes(tmp_path)
    store = RecordingStore(tmp_path / "kv", 20 * size, seed)
    rng = random.Random(seed)
    full = View()
    prompts: list[list[int]] = []
    cache = akv.HiCache(claims_config(store))
    await cache.start()
    try:
        await workload(cache, rng, 30, prompts)
        full.feed(cache.take_events())
        late = View(cache.snapshot_events())
        assert late.media == full.media, f"seed {seed}: the snapshot is not the stream"
        await workload(cache, rng, 30, prompts)
        await cache.flush()
        events = cache.take_events()
        full.feed(events)
        late.feed(events)
        where = f"seed {seed}"
        assert late.media == full.media, where
        in_tree, there = tree_view(cache), await store.present()
        assert full.media["GPU"] == in_tree["GPU"] and full.media["CPU"] == in_tree["CPU"], where
        assert in_tree["STORAGE"] <= full.media["STORAGE"] <= there, where
        assert View(cache.snapshot_events()).media == full.media, where
        assert cache.statistics().evicted_pages_storage > 0, where
        cache.check_invariants()
    finally:
        await cache.aclose()
    events = cache.take_events()
    full.feed(events)
    late.feed(events)
    assert late.media == full.media and not full.media["GPU"] | full.media["CPU"]
    assert View(cache.snapshot_events()).media == full.media
    assert full.media["STORAGE"] <= await store.present()
