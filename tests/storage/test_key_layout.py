"""A stored page is read only by a cache laid out as the one that computed it.

Two deployments may share a namespace name (the default is ``"default"``) and a store while
their models differ. Before, a cache with another KV layout of the same page bytes (4 layers
x 1 head x 8 in fp16 against 2 x 2 x 4 in fp32) prefetched the other's pages and served
reinterpreted bytes, and an SWA pool's pages came back as the Mamba state of a component of
the same name. Each pool's key component now carries a digest of its layout.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import aiocache_kv as akv
from aiocache_kv.events import BlockRemoved
from aiocache_kv.storage import FileStorage
from aiocache_kv.storage.key_layout import key_component, key_components
from aiocache_kv.storage.keys import MAX_COMPONENT_LEN, parse_storage_key
from tests.conftest import small_config

PROMPT = list(range(100, 116))  # 8 pages of 2


def config(root: Path | None, **kw: object) -> akv.CacheConfig:
    opts: dict[str, object] = dict(
        device_pages=32,
        host_pages=64,
        storage=None if root is None else FileStorage(root),
        prefetch_threshold_tokens=0,
        prefetch_policy="wait_complete",
        storage_timeout=5.0,
    )
    opts.update(kw)
    return small_config(**opts)


async def store_prompt(cfg: akv.CacheConfig) -> None:
    async with akv.HiCache(cfg) as cache:
        slots = cache.alloc(len(PROMPT))
        for layer in range(cfg.num_layers):
            for buf in cache.device_kv(layer):
                buf[slots] = 7.0
        cache.release(cache.insert(PROMPT, slots))
        await cache.flush()
        assert cache.statistics().backup_pages_failed == 0


async def hit_tokens(cfg: akv.CacheConfig) -> int:
    """Tokens of PROMPT a fresh cache with ``cfg`` gets from storage and serves."""
    async with akv.HiCache(cfg) as cache:
        res = await cache.prefetch(PROMPT)
        m = cache.match_prefix(PROMPT)
        await cache.load_back(m)
        served = m.device_len
        cache.release(m)
        cache.check_invariants()
        assert served == res.hit_tokens
        return served


SAME_BYTES = [  # each: the writer's page bytes (2 x 2 x 2 x 4 x 4 = 128 a page), laid out otherwise
    dict(num_layers=4, num_kv_heads=1, head_dim=8, dtype=torch.float16),
    dict(num_layers=1, num_kv_heads=4),
    dict(num_kv_heads=1, head_dim=8),
    dict(head_dim=8, dtype=torch.bfloat16),
    dict(head_dim=8, dtype=torch.float16),
]


@pytest.mark.parametrize("layout", SAME_BYTES, ids=lambda d: ",".join(map(str, d)))
async def test_another_kv_layout_of_the_same_page_bytes_is_a_miss(
    tmp_path: Path, layout: dict[str, object]
) -> None:
    await store_prompt(config(tmp_path))
    other = config(tmp_path, **layout)
    assert other.page_bytes == config(None).page_bytes  # only the layout differs
    assert await hit_tokens(other) == 0
    assert await hit_tokens(config(tmp_path)) == len(PROMPT)  # the writer's layout still hits


async def test_a_sidecar_of_another_kind_under_the_same_name_is_a_miss(tmp_path: Path) -> None:
    swa = akv.SlidingWindow(4, num_layers=1, num_kv_heads=1, head_dim=4, page_size=2)
    swa = dataclasses.replace(swa, dtype=torch.float32)
    mamba = akv.MambaState((16,), dtype=torch.float32, page_size=2, name=swa.name)
    assert swa.page_bytes == mamba.page_bytes and swa.name == mamba.name
    await store_prompt(config(tmp_path, components=(swa,)))
    # the KV pages are the writer's, but the reader's "swa" pool is a Mamba state
    assert await hit_tokens(config(tmp_path, components=(mamba,))) == 0
    wider = dataclasses.replace(swa, window_tokens=6)  # a window is not a layout: still a hit
    assert await hit_tokens(config(tmp_path, components=(wider,))) == len(PROMPT)


def test_key_components_bind_each_layout_field_and_nothing_else() -> None:
    base = config(None)
    first = key_components(base)
    assert first == key_components(config(None))  # deterministic, across processes too
    assert first[0].startswith("kv-") and len(first[0]) == len("kv-") + 16
    for change in [*SAME_BYTES, dict(page_size=4), dict(num_layers=3)]:
        assert key_components(dataclasses.replace(base, **change))[0] != first[0], change
    for same in [dict(device_pages=64), dict(namespace="other"), dict(host_pages=128)]:
        assert key_components(dataclasses.replace(base, **same)) == first, same
    # each TP rank's shard: its own keys; the longest name and shard fit a key
    comp = akv.MambaState((4,), page_size=2, name="m" * 16)
    sharded = key_components(dataclasses.replace(base, components=(comp,)), 1023, 1024)
    assert sharded[0].startswith("kv-tp1023-1024-") and sharded[1].startswith("m" * 16)
    assert all(len(c) <= MAX_COMPONENT_LEN for c in sharded)
    key = f"{'t' * 64}/{'0' * 64}/{sharded[1]}"
    assert parse_storage_key(key).component == sharded[1]


async def test_stored_keys_carry_the_layout_digest(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    await store_prompt(cfg)
    store = FileStorage(tmp_path)
    kv = key_components(cfg)[0]
    tag = akv.Namespace(cfg.namespace).tag
    hashes = akv.page_hashes(PROMPT, model=cfg.namespace, page_size=2)
    want = [f"{tag}/{h.hex()}/{kv}" for h in hashes]
    assert store.exists(want) == [True] * len(want)
    assert store.exists([f"{tag}/{h.hex()}/kv" for h in hashes]) == [False] * len(want)
    store.close()


def page_file_sizes(root: Path) -> list[int]:
    return [p.stat().st_size for p in root.rglob("*") if p.is_file() and p.stat().st_size > 100]


async def test_the_store_evicting_another_layouts_page_is_not_this_caches_loss(
    tmp_path: Path,
) -> None:
    """The store evicts the other deployment's files of the same tag and page hashes: not
    this cache's pages, which stay claimed (no ``BlockRemoved``) and are not backed up again."""
    await store_prompt(config(tmp_path, **SAME_BYTES[0]))  # the other layout: 8 page files
    sizes = page_file_sizes(tmp_path)
    assert len(sizes) == len(PROMPT) // 2
    room = max(sizes) * (len(sizes) * 2 + 1)
    cfg = config(tmp_path, storage=FileStorage(tmp_path, capacity_bytes=room))
    async with akv.HiCache(cfg) as cache:
        cache.release(cache.insert(PROMPT, cache.alloc(len(PROMPT))))
        await cache.flush()
        cache.take_events()
        more = list(range(500, 508))  # 4 pages more than the store holds: it evicts
        cache.release(cache.insert(more, cache.alloc(len(more))))
        await cache.flush()
        mine = set(akv.page_hashes(PROMPT, page_size=2, model=cfg.namespace))
        gone = {
            h
            for e in cache.take_events()
            if isinstance(e, BlockRemoved) and e.medium == "STORAGE"
            for h in e.block_hashes
        }
        assert not gone & mine
        tag = akv.Namespace(cfg.namespace).tag
        kv = key_components(cfg)[0]
        keys = [f"{tag}/{h.hex()}/{kv}" for h in sorted(mine)]
        assert cfg.storage.exists(keys) == [True] * len(keys)
        cache.check_invariants()


def test_key_component_names_one_pool() -> None:
    swa = akv.SlidingWindow(4, num_layers=1, num_kv_heads=1, head_dim=4, page_size=2)
    cfg = config(None, components=(swa,))
    kv, side = key_components(cfg)
    assert key_component(cfg) == key_component(cfg, "kv") == kv
    assert key_component(cfg, swa.name) == side
    assert key_component(cfg, swa.name, 1, 2) == key_components(cfg, 1, 2)[1]
    with pytest.raises(akv.InvalidInputError, match="'mamba'"):
        key_component(cfg, "mamba")
