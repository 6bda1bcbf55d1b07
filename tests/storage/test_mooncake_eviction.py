"""A real Mooncake master evicting the cache's pages behind its back.

The master evicts the oldest unleased objects once its segments fill up, and tells nobody.  The
cache must learn it when it looks (prefetch), publish ``BlockRemoved(STORAGE)`` for what it
learned is gone, serve only the leading run of pages that are really there - with exactly the
KV that was written - and back a page up again once it is computed again.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import pytest
import torch

import aiocache_kv as akv
from aiocache_kv.bench.storage_paths import storage_keys
from aiocache_kv.storage import MooncakeStorage
from aiocache_kv.tree.hashing import chain_hashes, namespace_seed

from .conftest import MasterProc, master_executable
from .test_chain_eviction import View

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(180)]

PAGE = 16
PAGES = 8  # per prompt
PROMPTS = 24  # 192 pages of 128 KiB: half again what the 16 MiB segment holds
SEGMENT = 16 << 20  # the smallest segment Mooncake accepts
RETRY = 0.2  # storage back-off after a failed put
ROOM_ATTEMPTS = 40  # hits (RETRY apart) that may find the full store still without room


@pytest.fixture
def evicting_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MasterProc]:
    """A master whose read leases end after 50 ms, so the test's own reads do not shield
    objects from eviction for the default 10 s."""
    master = MasterProc(master_executable(), tmp_path_factory.mktemp("mooncake-evict"))
    master.extra_args = ("--default_kv_lease_ttl=50",)
    master.start()
    yield master
    master.terminate()


def storage(master: MasterProc) -> MooncakeStorage:
    return MooncakeStorage(
        master=master.rpc_addr,
        metadata_server=master.metadata_url,
        local_hostname="127.0.0.1",
        protocol="tcp",
        device_name="",
        global_segment_size=SEGMENT,
        local_buffer_size=16 << 20,
        rpc_timeout_ms=1500,
    )


def config(store: MooncakeStorage, namespace: str) -> akv.CacheConfig:
    return akv.CacheConfig(
        page_size=PAGE,
        num_layers=2,
        num_kv_heads=8,
        head_dim=128,
        dtype=torch.float16,
        device_pages=3 * PAGES,
        host_pages=4 * PAGES,
        host_memory_reserve_bytes=0,
        namespace=namespace,
        prefetch_threshold_tokens=0,
        prefetch_policy="wait_complete",
        storage_timeout=5.0,
        storage_retry_seconds=RETRY,
        storage=store,
    )


def prompt(i: int) -> list[int]:
    return [1000 * (i + 1) + j for j in range(PAGES * PAGE)]


def kv_of(cache: akv.HiCache, seed: int, n: int) -> list[torch.Tensor]:
    """The KV prompt ``seed`` writes: one tensor per layer and buffer (K, V)."""
    g = torch.Generator().manual_seed(seed)
    shape = cache.device_kv(0)[0].shape[1:]
    return [
        torch.randn((n, *shape), generator=g).half()
        for _ in range(cache.config.num_layers)
        for _ in range(2)
    ]


def compute(cache: akv.HiCache, i: int) -> None:
    """Prefill prompt ``i`` from scratch: fresh slots, its KV written, inserted, released."""
    tokens = prompt(i)
    slots = cache.alloc(len(tokens))
    want = iter(kv_of(cache, i, len(tokens)))
    for layer in range(cache.config.num_layers):
        for buf in cache.device_kv(layer):
            buf[slots] = next(want)
    cache.release(cache.insert(tokens, slots))


def served_right(cache: akv.HiCache, i: int, m: akv.MatchResult) -> bool:
    n = m.device_len
    rows = m.device_indices[:n]
    want = iter(kv_of(cache, i, PAGES * PAGE))
    return all(
        torch.equal(buf[rows], next(want)[:n])
        for layer in range(cache.config.num_layers)
        for buf in cache.device_kv(layer)
    )


def empty(cache: akv.HiCache) -> None:
    cache.evict(1 << 30)
    cache.evict(1 << 30, tier="host")


async def test_pages_the_master_evicted_are_learned_and_never_served(
    evicting_master: MasterProc,
) -> None:
    ns = f"e{uuid.uuid4().hex[:8]}"
    tag = akv.Namespace(ns, "").tag
    hashes = [chain_hashes(namespace_seed(tag), prompt(i), PAGE) for i in range(PROMPTS)]
    store = storage(evicting_master)
    view = View()
    async with akv.HiCache(config(store, ns)) as cache:
        for i in range(PROMPTS):
            compute(cache, i)
            await cache.flush()
            view.feed(cache.take_events())
        await asyncio.sleep(0.5)  # leases end; the master's eviction thread settles
        empty(cache)
        view.feed(cache.take_events())

        lost: list[int] = []  # prompts with a page the master evicted
        for i in range(PROMPTS):
            keys = storage_keys(cache.config, "", prompt(i))
            there = await asyncio.to_thread(store.exists, keys)
            lead = there.index(False) if False in there else PAGES
            if not all(there):
                lost.append(i)
            res = await cache.prefetch(prompt(i))
            assert res.hit_tokens == lead * PAGE, (i, there, res)
            m = cache.match_prefix(prompt(i))
            await cache.load_back(m)
            assert m.device_len == lead * PAGE, (i, there, m.device_len)
            assert served_right(cache, i, m), f"prompt {i}: wrong KV served"
            cache.release(m)
            empty(cache)
            view.feed(cache.take_events())
            if lead < PAGES:  # what the prefetch found missing is no longer claimed
                assert hashes[i][lead] not in view.stored, (i, there)
            # never claims a page the store does not have
            claimed = [h in view.stored for h in hashes[i]]
            assert not any(c and not t for c, t in zip(claimed, there, strict=True)), (
                i,
                there,
                claimed,
            )
        assert lost, "the master evicted nothing: the test proves nothing"
        cache.check_invariants()
        st = cache.statistics()
        assert st.host.quarantined_pages == 0 and st.prefetch_reserved_pages == 0

        # a prompt that lost pages, computed again, is backed up again and announced.  The
        # store is full: a put may be refused (-200) until the master's next eviction pass
        # makes room, and a later hit then backs up what the store still lacks
        gone = lost[0]  # the oldest: evicted by the master
        await asyncio.sleep(RETRY)  # past the back-off of a put the full store refused
        compute(cache, gone)
        keys = storage_keys(cache.config, "", prompt(gone))
        there: list[bool] = []
        for _ in range(ROOM_ATTEMPTS):
            await cache.flush()
            view.feed(cache.take_events())
            there = await asyncio.to_thread(store.exists, keys)
            if all(there):
                break
            await asyncio.sleep(RETRY)  # past the back-off; the master evicts meanwhile
            cache.release(cache.match_prefix(prompt(gone)))  # the hit backs up what is missing
        assert all(there), f"never backed up again after {ROOM_ATTEMPTS} hits: {there}"
        assert set(hashes[gone]) <= view.stored

        # a second node reads it back whole, bit for bit
        async with akv.HiCache(config(storage(evicting_master), ns)) as other:
            res = await other.prefetch(prompt(gone))
            assert res.hit_tokens == PAGES * PAGE, res
            m = other.match_prefix(prompt(gone))
            await other.load_back(m)
            assert served_right(other, gone, m)
            other.release(m)
