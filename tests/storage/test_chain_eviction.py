"""Storage at capacity: chain-aware eviction, and STORAGE events that match the store.

``PageIndex`` is checked against a plain model with a seeded random walk; ``FileStorage`` for
the exact survivors of a small capacity, for chains rebuilt at start-up and for the ``"auto"``
bound; the cache for what it publishes and marks after the store evicts, corrupts or restarts:
the consumer's STORAGE view (BlockStored minus BlockRemoved) must equal the files on disk.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import threading
from collections import namedtuple
from pathlib import Path

import pytest

import aiocache_kv as akv
from aiocache_kv.storage import FileStorage, PageBuffer, parse_storage_key
from aiocache_kv.storage.page_file import file_name
from aiocache_kv.storage.page_index import PageIndex
from aiocache_kv.storage.tier import PrefetchStatus
from aiocache_kv.tree import TierState
from tests.conftest import small_config
from tests.test_split_ack import insert

SLOT = 256


def slots(n: int) -> list[PageBuffer]:
    out = [PageBuffer.allocate(SLOT) for _ in range(n)]
    for i, b in enumerate(out):
        b.view[:8] = i.to_bytes(8, "little")
    return out


def chain(prefix: str, n: int) -> tuple[list[str], list[str | None]]:
    keys = [f"{prefix}{i}" for i in range(n)]
    return keys, [None, *keys[:-1]]


# ------------------------------------------------------------------ PageIndex


def test_index_evicts_chain_ends_least_recent_first() -> None:
    idx = PageIndex()
    for i in range(4):
        idx.add(f"a{i}", 10, f"a{i - 1}" if i else None)
    for i in range(2):
        idx.add(f"b{i}", 10, f"b{i - 1}" if i else None)
    idx.check()
    assert idx.pick_victims(50) == ["a3"]  # the older chain's end, not its start
    # a2 became an end, then a1: both older than b's end
    assert idx.pick_victims(30) == ["a2", "a1"]
    assert sorted(idx.names()) == ["a0", "b0", "b1"]
    idx.touch_run(["a0"])  # a hit: a0 is now newer than b's end
    assert idx.pick_victims(20) == ["b1"]
    idx.check()


def test_index_orphans_wait_for_their_parent_and_cycles_still_evict() -> None:
    idx = PageIndex()
    idx.add("c1", 1, "c0")  # its parent arrives later
    idx.add("c0", 1, None)
    assert idx.children("c0") == 1
    idx.remove("c0")  # c1 waits again
    idx.check()
    idx.add("x", 1, "y")
    idx.add("y", 1, "x")  # hostile parents: a cycle has no chain end
    idx.check()
    assert len(idx.pick_victims(0)) == 3 and len(idx) == 0 and idx.total == 0
    idx.check()


def test_index_random_walk_keeps_counts_and_bound(request: pytest.FixtureRequest) -> None:
    seed = random.randrange(1 << 30) if os.environ.get("AKV_STRESS_SEEDS") else 1234
    rng = random.Random(seed)
    idx = PageIndex()
    names = [f"p{i}" for i in range(40)]
    try:
        for _ in range(3000):
            op = rng.random()
            name = rng.choice(names)
            if op < 0.5:
                idx.add(name, rng.randint(1, 5), rng.choice([None, *names]))
            elif op < 0.7:
                idx.remove(name)
            elif op < 0.85:
                idx.touch_run(rng.sample(names, 3))
            else:
                cap = rng.randint(0, 60)
                victims = idx.pick_victims(cap)
                assert idx.total <= cap
                assert len(set(victims)) == len(victims)
                assert not set(victims) & set(idx.names())
            idx.check()
    except AssertionError:
        print(f"PageIndex random walk failed with seed {seed}")
        raise


def test_add_many_is_add_one_by_one(request: pytest.FixtureRequest) -> None:
    """A put indexes a group with ``add_many``: the same index, page for page (order,
    sizes, parents, dependants, tags, totals), and the same victims afterwards, as adding
    the items one by one, for hostile batches too (a name twice, a page its own parent,
    parents later in the batch or never stored, cycles)."""
    seed = random.randrange(1 << 30) if os.environ.get("AKV_STRESS_SEEDS") else 4321
    rng = random.Random(seed)
    batch, one = PageIndex(), PageIndex()
    names = [f"p{i}" for i in range(30)]
    try:
        for _ in range(400):
            op = rng.random()
            if op < 0.5:
                items: list[tuple[str, int, str | None, str | None]] = []
                prev = rng.choice([None, *names])
                for _ in range(rng.randint(0, 8)):
                    name = rng.choice(names)
                    parent = rng.choice([prev, prev, name, None, rng.choice(names)])
                    items.append((name, rng.randint(1, 5), parent, rng.choice([None, "a", "b"])))
                    prev = name
                batch.add_many(items)
                for item in items:
                    one.add(*item)
            elif op < 0.65:
                name = rng.choice(names)
                assert batch.remove(name) == one.remove(name)
            elif op < 0.8:
                run = rng.sample(names, 3)
                batch.touch_run(run)
                one.touch_run(run)
            else:
                cap = rng.randint(0, 60)
                assert batch.pick_victims(cap) == one.pick_victims(cap)
            batch.check()
            assert batch.names() == one.names() and batch.total == one.total
            for name in batch.names():
                assert batch.size(name) == one.size(name)
                assert batch.parent(name) == one.parent(name)
                assert batch.children(name) == one.children(name)
            assert [batch.tag_pages(t) for t in "ab"] == [one.tag_pages(t) for t in "ab"]
        assert batch.pick_victims(0) == one.pick_victims(0)
    except AssertionError:
        print(f"add_many against add failed with seed {seed}")
        raise


class _EagerIndex:
    """The eviction policy spelled out slowly: a hit walks up and refreshes every stored
    ancestor at once; victims are the pages nothing stored depends on, oldest first."""

    def __init__(self) -> None:
        self.pages: dict[str, tuple[int, str | None, int]] = {}  # name -> size, parent, tick
        self.tick = 0

    def add(self, name: str, size: int, parent: str | None) -> None:
        self.tick += 1
        self.pages[name] = (size, parent, self.tick)

    def remove(self, name: str) -> None:
        self.pages.pop(name, None)

    def touch_run(self, names: list[str]) -> None:
        self.tick += 1
        for name in names:
            cur: str | None = name
            while cur is not None and cur in self.pages:
                size, parent, _ = self.pages[cur]
                self.pages[cur] = (size, parent, self.tick)
                cur = parent

    def ends(self) -> list[str]:
        parents = {p for _, p, _ in self.pages.values()}
        return [n for n in self.pages if n not in parents]

    def pick_victims(self, capacity: int) -> list[str]:
        out = []
        while sum(v[0] for v in self.pages.values()) > capacity:
            victim = min(self.ends(), key=lambda n: (self.pages[n][2], n))
            self.remove(victim)
            out.append(victim)
        return out


def test_lazy_chain_refresh_evicts_like_walking_every_hit_to_the_root() -> None:
    """The index's hits refresh ancestors lazily (when they become chain ends); the victims
    must be exactly those of refreshing every ancestor at every hit (acyclic chains, pages
    leave as chain ends - by eviction or removal - and new pages are new names)."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    for trial in range(40):
        idx, ref = PageIndex(), _EagerIndex()
        fresh = 0
        for step in range(300):
            op = rng.random()
            names = list(ref.pages)
            where = f"seed {seed} trial {trial} step {step}"
            if op < 0.45 or not names:
                parent = rng.choice([None, *names]) if names else None
                name, fresh = f"p{fresh}", fresh + 1
                size = rng.randint(1, 4)
                idx.add(name, size, parent)
                ref.add(name, size, parent)
            elif op < 0.7:
                run = rng.sample(names, min(len(names), rng.randint(1, 4)))
                idx.touch_run(run)
                ref.touch_run(run)
            elif op < 0.8:
                end = rng.choice(ref.ends())
                assert idx.remove(end) is not None, where
                ref.remove(end)
            else:
                cap = rng.randint(0, 40)
                assert idx.pick_victims(cap) == ref.pick_victims(cap), where
            idx.check()


# ------------------------------------------------------------------ FileStorage


def page_bytes(tmp_path: Path, key: str) -> int:
    probe = FileStorage(tmp_path / "probe", capacity_bytes=None)
    probe.put([key], slots(1))
    size = probe.total_bytes()
    probe.close()
    return size


def test_small_capacity_keeps_the_prefix_reachable(tmp_path: Path) -> None:
    keys, parents = chain("k", 8)
    size = page_bytes(tmp_path, keys[0])
    fs = FileStorage(tmp_path / "kv", capacity_bytes=4 * size)
    ok = fs.put_chain(keys, slots(8), parents)
    # the first four fit; the fifth would be its own victim, and the rest hang below it
    assert ok == [True] * 4 + [False] * 4
    assert fs.exists(keys) == [True] * 4 + [False] * 4
    assert fs.leading_hits(keys) == 4
    assert fs.take_evicted() == []  # never reported stored, so nothing to take back
    fs.check_index()
    fs.close()
    # without parents every page is a chain end: plain LRU keeps the unreachable suffix (what
    # the cache used to do), and the put says the prefix it wrote did not stay
    lru = FileStorage(tmp_path / "lru", capacity_bytes=4 * size)
    assert lru.put(keys, slots(8)) == [False] * 4 + [True] * 4
    assert lru.leading_hits(keys) == 0
    assert lru.take_evicted() == []
    lru.close()


def test_shared_prefix_and_hits_refresh_the_chain(tmp_path: Path) -> None:
    a, pa = chain("a", 4)
    size = page_bytes(tmp_path, a[0])
    fs = FileStorage(tmp_path / "kv", capacity_bytes=6 * size)
    assert all(fs.put_chain(a, slots(4), pa))
    b = ["b2", "b3"]  # b shares a0, a1
    assert all(fs.put_chain(b, slots(2), ["a1", "b2"]))
    assert fs.get_into(a[:1], slots(1)) == [True]  # a hit on a0: a0 is recent, ends are not
    c, pc = chain("c", 2)
    assert all(fs.put_chain(c, slots(2), pc))  # two pages must go: a3, then a2 (chain ends)
    assert fs.take_evicted() == ["a3", "a2"]
    assert fs.exists([*a, *b, *c]) == [True, True, False, False, True, True, True, True]
    fs.check_index()
    fs.close()


def test_index_rebuilt_at_start_up_keeps_chains(tmp_path: Path) -> None:
    keys, parents = chain("r", 6)
    fs = FileStorage(tmp_path / "kv", capacity_bytes=None)
    assert all(fs.put_chain(keys, slots(6), parents))
    size = fs.total_bytes() // 6
    fs.close()
    again = FileStorage(tmp_path / "kv", capacity_bytes=3 * size)
    again.open()  # three must go to fit: the chain's end, not its start
    assert again.exists(keys) == [True] * 3 + [False] * 3
    assert again.take_evicted() == keys[:2:-1]
    again.check_index()
    again.close()


def test_auto_capacity_is_bounded_by_the_filesystem(tmp_path: Path) -> None:
    fs = FileStorage(tmp_path / "kv")  # "auto" is the default
    assert fs.capacity_bytes is None  # resolved at open
    fs.open()
    usage = shutil.disk_usage(tmp_path)
    assert fs.capacity_bytes is not None
    assert 0 < fs.capacity_bytes <= usage.total * 0.5
    fs.close()
    with pytest.raises(akv.ConfigError, match="'auto' or None"):
        FileStorage(tmp_path / "kv", capacity_bytes="unbounded")  # type: ignore[arg-type]


def test_start_up_on_a_full_disk_keeps_and_serves_what_is_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys, parents = chain("f", 5)
    fs = FileStorage(tmp_path / "kv", capacity_bytes=None)
    assert all(fs.put_chain(keys, slots(5), parents))
    fs.close()
    usage = namedtuple("usage", "total used free")
    full = usage(total=10 << 30, used=10 << 30, free=0)
    monkeypatch.setattr(shutil, "disk_usage", lambda _path: full)
    again = FileStorage(tmp_path / "kv")  # auto: no room left, but nothing is evicted
    assert again.exists(keys) == [True] * 5
    assert again.capacity_bytes == again.total_bytes()
    dst = slots(5)
    assert again.get_into(keys, dst) == [True] * 5
    assert again.take_evicted() == []
    again.close()


# ------------------------------------------------------------------ through the cache


def cfg(store: FileStorage, **kw: object) -> akv.CacheConfig:
    opts: dict[str, object] = dict(
        storage=store,
        prefetch_threshold_tokens=0,
        prefetch_policy="wait_complete",
        storage_retry_seconds=0.0,
    )
    opts.update(kw)
    return small_config(**opts)


class View:
    """A consumer's STORAGE view, built from the events alone."""

    def __init__(self) -> None:
        self.stored: set[int] = set()

    def feed(self, events: list[akv.KVEvent]) -> None:
        for e in events:
            if isinstance(e, akv.BlockStored) and e.medium == "STORAGE":
                self.stored |= set(e.block_hashes)
            elif isinstance(e, akv.BlockRemoved) and e.medium == "STORAGE":
                self.stored -= set(e.block_hashes)


async def on_disk(store: FileStorage, root: Path) -> set[int]:
    """Page hashes of the files in ``root`` (keys read back from the files)."""

    def scan() -> set[int]:
        out = set()
        for f in root.rglob("*.kv"):
            data = f.read_bytes()
            klen = int.from_bytes(data[4:8], "little")
            out.add(parse_storage_key(data[28 : 28 + klen].decode()).page_hash)
        return out

    return await asyncio.to_thread(scan)


async def file_size(tmp_path: Path) -> int:
    """The size of one page file of the test config (a cache writes one page, unbounded)."""
    store = FileStorage(tmp_path / "size", capacity_bytes=None)
    async with akv.HiCache(cfg(store)) as cache:
        cache.release(insert(cache, [1, 2]))
        await cache.flush()
        return store.total_bytes()


async def test_storage_events_match_the_store_after_eviction(tmp_path: Path) -> None:
    size = await file_size(tmp_path)
    root = tmp_path / "kv"
    store = FileStorage(root, capacity_bytes=6 * size)
    view = View()
    a = list(range(100, 108))  # 4 pages of 2
    b = list(range(200, 208))
    async with akv.HiCache(cfg(store)) as cache:
        cache.release(insert(cache, a))
        await cache.flush()
        view.feed(cache.take_events())
        assert view.stored == await on_disk(store, root) and len(view.stored) == 4
        cache.release(insert(cache, b))  # two of a's pages must go: its last two
        await cache.flush()
        view.feed(cache.take_events())
        assert view.stored == await on_disk(store, root) and len(view.stored) == 6
        st = cache.statistics()
        assert st.evicted_pages_storage == 2
        (node_a,) = [n for n in cache._tree.walk() if n.key[:2] == a[:2]]
        assert node_a.storage is TierState.ABSENT  # so a hit backs it up again
        m = cache.match_prefix(a)  # the hit: a is put again, evicting b's end
        cache.release(m)
        await cache.flush()
        view.feed(cache.take_events())
        assert view.stored == await on_disk(store, root)
        assert node_a.storage is TierState.RESIDENT
        cache.check_invariants()
    # a fresh node prefetches exactly what the view says is there
    async with akv.HiCache(cfg(FileStorage(root, capacity_bytes=6 * size))) as fresh:
        res = await fresh.prefetch(a)
        assert res.hit_tokens == 8


class GatedFileStorage(FileStorage):
    """``FileStorage`` whose puts wait for ``gate`` (a worker that starts late)."""

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.gate = threading.Event()
        self.gate.set()

    def put_chain(self, *args: object, **kw: object) -> list[bool]:
        assert self.gate.wait(30), "gate never opened"
        return super().put_chain(*args, **kw)  # type: ignore[arg-type]


async def test_a_late_put_that_evicts_retracts_the_claim_when_it_returns(
    tmp_path: Path,
) -> None:
    """A put past its deadline still runs in its worker (``storage_calls_running``); the
    pages it evicts to fit were announced stored: once it returns the cache says they are
    gone, and the STORAGE view matches the disk again."""
    size = await file_size(tmp_path)
    root = tmp_path / "kv"
    store = GatedFileStorage(root, capacity_bytes=4 * size)
    view = View()
    a = list(range(100, 108))  # 4 pages of 2: fills the store
    b = list(range(200, 204))  # 2 more: two of a's go
    async with akv.HiCache(cfg(store, storage_timeout=0.1)) as cache:
        cache.release(insert(cache, a))
        await cache.flush()
        view.feed(cache.take_events())
        assert len(view.stored) == 4 and view.stored == await on_disk(store, root)
        store.gate.clear()
        cache.release(insert(cache, b))
        await cache.flush()  # the put missed its deadline: b failed, nothing evicted yet
        assert cache.statistics().storage_calls_running == 1
        view.feed(cache.take_events())
        assert len(view.stored) == 4
        store.gate.set()  # the late put writes b, evicting two of a's pages
        for _ in range(500):
            if not cache.statistics().storage_calls_running:
                break
            await asyncio.sleep(0.01)
        await cache.flush()
        st = cache.statistics()
        assert st.storage_calls_running == 0 and st.evicted_pages_storage == 2
        view.feed(cache.take_events())
        disk = await on_disk(store, root)
        # a's first two pages, still claimed; b's pages landed late: on disk, never claimed
        assert len(view.stored) == 2 and view.stored < disk and len(disk) == 4
        cache.check_invariants()


async def test_a_prompt_larger_than_the_store_keeps_its_prefix(tmp_path: Path) -> None:
    size = await file_size(tmp_path)
    root = tmp_path / "kv"
    store = FileStorage(root, capacity_bytes=4 * size)
    prompt = list(range(300, 316))  # 8 pages
    async with akv.HiCache(cfg(store)) as cache:
        cache.release(insert(cache, prompt))
        await cache.flush()
        storage = [e for e in cache.take_events() if getattr(e, "medium", "") == "STORAGE"]
        assert storage == []  # the node is not all in storage: never announced
        assert len(await on_disk(store, root)) == 4  # the first four pages
    async with akv.HiCache(cfg(FileStorage(root, capacity_bytes=4 * size))) as fresh:
        res = await fresh.prefetch(prompt)
        assert res.status is PrefetchStatus.COMPLETE and res.hit_tokens == 8  # 4 pages of 2


async def test_restart_with_a_smaller_store_publishes_what_it_evicted(tmp_path: Path) -> None:
    size = await file_size(tmp_path)
    root = tmp_path / "kv"
    prompt = list(range(400, 412))  # 6 pages
    view = View()
    async with akv.HiCache(cfg(FileStorage(root, capacity_bytes=None))) as cache:
        cache.release(insert(cache, prompt))
        await cache.flush()
        view.feed(cache.take_events())
    assert len(view.stored) == 6
    small = FileStorage(root, capacity_bytes=4 * size)
    async with akv.HiCache(cfg(small)) as cache:
        view.feed(cache.take_events())  # the restart evicted two pages to fit: it says so
        assert view.stored == await on_disk(small, root) and len(view.stored) == 4
        assert cache.statistics().evicted_pages_storage == 2
        res = await cache.prefetch(prompt)
        assert res.hit_tokens == 8  # the chain's prefix survived


async def test_corrupt_page_is_removed_and_backed_up_again(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    prompt = list(range(500, 508))  # 4 pages
    view = View()
    store = FileStorage(root, capacity_bytes=None)
    async with akv.HiCache(cfg(store)) as cache:
        cache.release(insert(cache, prompt))
        await cache.flush()
        view.feed(cache.take_events())
        hashes = cache._tree.block_hashes(next(iter(cache._tree.walk())))
    keys = await asyncio.to_thread(_keys, root)
    victim = store.path_of(next(k for k in keys if parse_storage_key(k).page_hash == hashes[2]))
    await asyncio.to_thread(_flip, victim)
    store = FileStorage(root, capacity_bytes=None)
    async with akv.HiCache(cfg(store)) as cache:
        res = await cache.prefetch(prompt)
        assert res.hit_tokens == 4  # two pages, then the corrupt one
        view.feed(cache.take_events())
        assert view.stored == await on_disk(store, root) and hashes[2] not in view.stored
        slots_ = cache.alloc(8)
        cache.release(cache.insert(prompt, slots_))  # the rest computed again: backed up
        await cache.flush()
        view.feed(cache.take_events())
        assert view.stored == await on_disk(store, root) == set(hashes)
        cache.check_invariants()


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-40] ^= 0xFF  # inside the page: the checksum fails
    path.write_bytes(bytes(data))


def _keys(root: Path) -> list[str]:
    out = []
    for f in root.rglob("*.kv"):
        data = f.read_bytes()
        klen = int.from_bytes(data[4:8], "little")
        out.append(data[28 : 28 + klen].decode())
    return out


def test_file_names_are_what_lru_order_lists(tmp_path: Path) -> None:
    fs = FileStorage(tmp_path, capacity_bytes=None)
    fs.put(["x", "y"], slots(2))
    assert fs.lru_order() == [file_name("x"), file_name("y")]
    fs.close()
