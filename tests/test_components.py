"""Hybrid models: sidecar components through every tier, usable prefixes, partial windows."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aiocache_kv as akv
from aiocache_kv.components import feasible_ends, usable_end
from aiocache_kv.storage import FileStorage, storage_key
from aiocache_kv.storage.key_layout import key_component
from aiocache_kv.storage.tier import PrefetchStatus
from aiocache_kv.tree.hashing import chain_hashes, namespace_seed
from tests.conftest import small_config
from tests.test_split_ack import write_kv

P = 2
PROMPT = list(range(40, 56))  # 8 pages


def components() -> tuple[akv.Component, ...]:
    return (
        akv.SlidingWindow(
            4, num_layers=1, num_kv_heads=1, head_dim=4, page_size=P, dtype=torch.float32
        ),
        akv.MambaState((3, 5), page_size=P),
        akv.Indexer(num_layers=1, head_dim=4, page_size=P, dtype=torch.float32),
    )


def cfg(path: Path | None = None, **kw: object) -> akv.CacheConfig:
    opts: dict[str, object] = dict(components=components(), device_pages=24, host_pages=32)
    if path is not None:
        opts.update(
            storage=FileStorage(path),
            prefetch_threshold_tokens=0,
            prefetch_policy="wait_complete",
        )
    opts.update(kw)
    return small_config(**opts)


def write_sidecars(cache: akv.HiCache, slots: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
    pages = slots[::P] // P
    g = torch.Generator().manual_seed(seed)
    out = {}
    for comp in cache.config.components:
        buf = cache.sidecar(comp.name)
        vals = torch.randn((pages.numel(), *buf.shape[1:]), generator=g).to(buf.dtype)
        buf[pages] = vals
        out[comp.name] = vals
    return out


async def insert_prompt(cache: akv.HiCache, tokens: list[int], seed: int = 3):
    slots = cache.alloc(len(tokens))
    kv = write_kv(cache, slots, seed)
    side = write_sidecars(cache, slots, seed)
    cache.release(cache.insert(tokens, slots))
    return kv, side


def read_sidecars(cache: akv.HiCache, m: akv.MatchResult) -> dict[str, torch.Tensor]:
    return {c.name: cache.sidecar(c.name)[m.device_pages].clone() for c in cache.config.components}


def test_component_validation() -> None:
    with pytest.raises(akv.ConfigError):
        akv.Component("kv", (1,), torch.float32, akv.HitPolicy.ALL_PAGES)
    with pytest.raises(akv.ConfigError):
        akv.Component("swa", (1,), torch.float32, akv.HitPolicy.TRAILING_PAGES, 0)
    with pytest.raises(akv.ConfigError, match="unique"):
        small_config(components=(components()[0], components()[0]))
    with pytest.raises(akv.ConfigError):
        small_config(components=("swa",))
    assert components()[0].window_pages(P) == 2 and components()[2].window_pages(P) == 0


def test_usable_end() -> None:
    assert usable_end(5, [], 5) == 5
    # window of 2: pages 0-1 missing, 2-4 present -> ends 4 and 5 are usable
    assert feasible_ends(5, [(2, [False, False, True, True, True], 0)], 5) == [
        False,
        False,
        False,
        True,
        True,
    ]
    # one page before the region is cached and valid: end 1 needs it and page 0
    assert feasible_ends(3, [(2, [True, True, False, True], 1)], 3) == [True, False, False]
    assert usable_end(2, [(1, [True] * 5, 0)], 5) == 2  # the all-pages run bounds it


async def test_sidecars_round_trip_device_host_device() -> None:
    async with akv.HiCache(cfg()) as cache:
        _kv, side = await insert_prompt(cache, PROMPT)
        await cache.flush()
        assert cache.evict(100) == 8
        for c in cache.config.components:
            cache.sidecar(c.name).zero_()
        m = cache.match_prefix(PROMPT)
        assert m.host_len == 16  # the Mamba state stays reachable from host after demotion
        await cache.load_back(m)
        got = read_sidecars(cache, m)
        for name, vals in side.items():
            assert torch.equal(got[name], vals), name
        cache.release(m)
        cache.check_invariants()
        with pytest.raises(akv.InvalidInputError, match="no sidecar"):
            cache.sidecar("nope")


async def test_admission_counts_every_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    import aiocache_kv.pools.build as build_mod

    monkeypatch.setattr(build_mod, "available_host_bytes", lambda: 10 << 20)  # a fixed machine
    # KV host slots: 1000 x 256 B; the three sidecars add 1000 x 3 x 64 B
    reserve = (10 << 20) - 350_000
    async with akv.HiCache(small_config(host_pages=1000, host_memory_reserve_bytes=reserve)):
        pass
    with pytest.raises(akv.HostMemoryError, match=r"need 448000 bytes"):
        async with akv.HiCache(cfg(host_pages=1000, host_memory_reserve_bytes=reserve)):
            pass


async def stored(path: Path) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    async with akv.HiCache(cfg(path)) as cache:
        kv, side = await insert_prompt(cache, PROMPT)
        await cache.flush()
        assert cache.statistics().backup_pages_ok == 8
    return kv, side


async def drop(path: Path, component: str, pages: list[int]) -> None:
    tag = akv.Namespace("default").tag
    hashes = chain_hashes(namespace_seed(tag), PROMPT, P)
    keys = [storage_key(tag, hashes[i], key_component(cfg(path), component)) for i in pages]
    store = FileStorage(path)
    assert all(await asyncio.to_thread(store.remove, keys))
    await asyncio.to_thread(store.close)


async def test_prefetch_brings_every_component(tmp_path: Path) -> None:
    _kv, side = await stored(tmp_path)
    async with akv.HiCache(cfg(tmp_path)) as cache:
        res = await cache.prefetch(PROMPT)
        assert res.status is PrefetchStatus.COMPLETE and res.hit_tokens == 16
        m = cache.match_prefix(PROMPT)
        await cache.load_back(m)
        got = read_sidecars(cache, m)
        for name, vals in side.items():
            assert torch.equal(got[name], vals), name
        cache.release(m)
        cache.check_invariants()


@pytest.mark.parametrize(
    ("component", "missing", "usable_pages"),
    [
        ("swa", [0, 1, 2, 3], 8),  # early SWA pages do not matter for the full prompt
        ("swa", [5, 6, 7], 5),  # window of 2 must be whole: the prefix ends at page 5
        ("swa", [6], 6),  # a hole inside the last window
        ("mamba", [7], 7),  # the state at the end is missing: end one page earlier
        ("indexer", [3], 3),  # every indexer page is needed
    ],
)
async def test_partial_windows_are_never_committed(
    tmp_path: Path, component: str, missing: list[int], usable_pages: int
) -> None:
    await stored(tmp_path)
    await drop(tmp_path, component, missing)
    async with akv.HiCache(cfg(tmp_path)) as cache:
        res = await cache.prefetch(PROMPT)
        m = cache.match_prefix(PROMPT)
        assert m.matched_len == usable_pages * P, (res, m)
        cache.release(m)
        stats = cache.statistics()
        assert stats.prefetch_reserved_pages == 0  # everything not committed was released
        cache.check_invariants()
        cache.evict(1000)
        cache.evict(1000, tier="host")
        assert cache.statistics().host.free_pages == 32  # no sidecar page leaked


async def test_holes_limit_shorter_matches(tmp_path: Path) -> None:
    await stored(tmp_path)
    await drop(tmp_path, "swa", [0, 1, 2, 3])
    async with akv.HiCache(cfg(tmp_path)) as cache:
        await cache.prefetch(PROMPT)
        m = cache.match_prefix(PROMPT[:8])  # 4 pages: its window falls in the hole
        assert m.matched_len == 0
        cache.release(m)
        m = cache.match_prefix(PROMPT[:12])  # 6 pages: window pages 4-5 are whole
        assert m.matched_len == 12
        cache.release(m)
        cache.check_invariants()


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    swa=st.sets(st.integers(0, 7)),
    mamba=st.sets(st.integers(0, 7)),
    indexer=st.sets(st.integers(0, 7)),
)
def test_prefetch_commits_only_whole_windows(
    tmp_path_factory: pytest.TempPathFactory, swa: set[int], mamba: set[int], indexer: set[int]
) -> None:
    path = tmp_path_factory.mktemp("pf")

    async def run() -> None:
        await stored(path)
        for name, pages in (("swa", swa), ("mamba", mamba), ("indexer", indexer)):
            if pages:
                await drop(path, name, sorted(pages))
        async with akv.HiCache(cfg(path)) as cache:
            await cache.prefetch(PROMPT)
            m = cache.match_prefix(PROMPT)
            end = m.matched_len // P
            cache.release(m)
            # reference: the largest end whose every requirement holds
            want = 0
            for e in range(8, 0, -1):
                if any(i in indexer for i in range(e)):
                    continue
                if any(i in swa for i in range(max(0, e - 2), e)) or (e - 1) in mamba:
                    continue
                want = e
                break
            assert end == want, (end, want)
            cache.check_invariants()
            cache.evict(1000)
            cache.evict(1000, tier="host")
            stats = cache.statistics()
            assert stats.host.free_pages == 32 and stats.prefetch_reserved_pages == 0

    asyncio.run(run())


async def test_device_run_ending_on_a_window_hole_is_not_served(tmp_path: Path) -> None:
    """A node whose Mamba state never arrived from storage (page 5) sits between nodes that
    have theirs.  Loaded back whole, then the tail's device copy evicted, the match's path is
    device pages 0-5 and host pages 6-7: the whole path may end at page 8, but the device run
    alone ends on page 5, whose state is missing.  The device part used to be the whole
    device run (12 tokens, serving garbage as the Mamba state of page 5: wrong output on a
    hybrid model); it must end where every window is whole (10 tokens), and a load-back must
    make all 16 usable, with every sidecar the prompt's own."""
    _kv, side = await stored(tmp_path)
    await drop(tmp_path, "mamba", [5])
    async with akv.HiCache(cfg(tmp_path)) as cache:
        res = await cache.prefetch(PROMPT)
        assert res.hit_tokens == 16, res
        m = cache.match_prefix(PROMPT)
        await cache.load_back(m)
        assert (m.device_len, m.host_len) == (16, 0)
        cache.release(m)
        assert cache.evict(2) == 2  # the leaf: pages 6-7 (their host copy stays)
        m = cache.match_prefix(PROMPT)
        assert (m.device_len, m.host_len) == (10, 6), (m.device_len, m.host_len)
        got = read_sidecars(cache, m)
        for name, vals in side.items():
            assert torch.equal(got[name], vals[:5]), name
        await cache.load_back(m)
        assert (m.device_len, m.host_len) == (16, 0)
        got = read_sidecars(cache, m)
        assert torch.equal(got["mamba"][7], side["mamba"][7])  # the state at the end
        assert torch.equal(got["indexer"], side["indexer"])
        cache.release(m)
        cache.check_invariants()


async def test_a_recomputed_window_hole_is_served_from_device(tmp_path: Path) -> None:
    """A node that came from storage without its Mamba state (page 5) used to stay unusable
    as a match end even after a request recomputed it: the insert gave the node the model's
    pages, but ``invalid`` still described the host copy, so every later request cut its
    match before page 5 and computed it again.  Now the device copy the insert adopted counts
    as whole (its sidecars are the request's own) until it leaves the device; the host copy
    still lacks the state, so a demoted node is cut again."""
    await stored(tmp_path)
    await drop(tmp_path, "mamba", [5])
    async with akv.HiCache(cfg(tmp_path)) as cache:
        res = await cache.prefetch(PROMPT)
        assert res.hit_tokens == 16, res
        head = PROMPT[:12]  # 6 pages: its end needs the state of page 5
        m = cache.match_prefix(head)
        assert m.matched_len == 10, m  # cut one page short
        await cache.load_back(m)
        assert m.device_len == 10
        # the request computes page 5 (KV and every sidecar) and inserts it after m
        own = cache.alloc(2)
        write_kv(cache, torch.cat([m.device_indices, own]), 9)
        side = write_sidecars(cache, own, 9)
        cache.release(cache.insert(head, own, prefix=m))
        cache.release(m)
        cache.check_invariants()

        m = cache.match_prefix(head)
        assert (m.device_len, m.host_len) == (12, 0), m  # healed: page 5 ends a match
        got = read_sidecars(cache, m)
        for name, vals in side.items():
            assert torch.equal(got[name][5], vals[0]), name  # the request's own state
        cache.release(m)
        m = cache.match_prefix(PROMPT)  # the rest is still there, from host
        assert (m.device_len, m.host_len) == (12, 4), m
        cache.release(m)

        # the device copy goes (the host copy stays, still without the state): cut again
        assert cache.evict(100) == 6
        m = cache.match_prefix(head)
        assert (m.device_len, m.matched_len) == (0, 10), m
        cache.release(m)
        cache.check_invariants()


def needed_pages(end: int) -> dict[str, range]:
    """The pages each component of :func:`components` needs for a prefix of ``end`` pages."""
    return {"swa": range(max(0, end - 2), end), "mamba": range(end - 1, end), "indexer": range(end)}


def check_served(cache: akv.HiCache, m: akv.MatchResult, side: dict[str, torch.Tensor]) -> None:
    """Every sidecar page the match's device part needs holds the prompt's own state."""
    end = m.device_len // P
    if not end:
        return
    pages = m.device_pages
    for name, want in needed_pages(end).items():
        buf = cache.sidecar(name)
        for i in want:
            assert torch.equal(buf[pages[i]], side[name][i]), (name, i, end)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    swa=st.sets(st.integers(0, 7)),
    mamba=st.sets(st.integers(0, 7)),
    indexer=st.sets(st.integers(0, 7)),
    evict_first=st.booleans(),
    load=st.booleans(),
    with_prefix=st.booleans(),
)
def test_recomputed_holes_serve_only_whole_windows(
    tmp_path_factory: pytest.TempPathFactory,
    swa: set[int],
    mamba: set[int],
    indexer: set[int],
    evict_first: bool,
    load: bool,
    with_prefix: bool,
) -> None:
    """Holes from storage, then a request that recomputes everything after its match (the
    model's state is deterministic: the same values as stored).  Every prefix of the prompt
    must then serve from device only pages whose every needed sidecar is the prompt's own: a
    recomputed page heals, a hole loaded back from host does not.  After the device copies go,
    the host copies (still with their holes) decide again."""
    path = tmp_path_factory.mktemp("heal")

    async def run() -> None:
        _kv, side = await stored(path)
        for name, pages in (("swa", swa), ("mamba", mamba), ("indexer", indexer)):
            if pages:
                await drop(path, name, sorted(pages))
        async with akv.HiCache(cfg(path)) as cache:
            for c in cache.config.components:
                cache.sidecar(c.name).fill_(-1.0)  # whatever a hole's rows hold is wrong
            await cache.prefetch(PROMPT)
            m = cache.match_prefix(PROMPT)
            if load:
                await cache.load_back(m)
            check_served(cache, m, side)
            first = m.device_len // P
            own = cache.alloc(len(PROMPT) - m.device_len)
            if own.numel():
                new_pages = own[::P] // P
                for c in cache.config.components:
                    cache.sidecar(c.name)[new_pages] = side[c.name][first:]
            if with_prefix:
                cache.release(cache.insert(PROMPT, own, prefix=m))
            else:
                cache.release(cache.insert(PROMPT, torch.cat([m.device_indices, own])))
            cache.release(m)
            cache.check_invariants()
            if evict_first:  # the recomputed tail's device copy goes first
                cache.evict(1)
            for end in range(1, 9):
                m = cache.match_prefix(PROMPT[: end * P])
                check_served(cache, m, side)
                cache.release(m)
            cache.evict(100)  # only host copies now: holes cut matches again
            for end in range(1, 9):
                m = cache.match_prefix(PROMPT[: end * P])
                await cache.load_back(m)
                check_served(cache, m, side)
                cache.release(m)
            cache.check_invariants()

    asyncio.run(run())
