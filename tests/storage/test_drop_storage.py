"""Removal by namespace tag (``remove_tag``, for ``HiCache.drop`` of a tenant) in every
backend, and a drop over a real Mooncake master: the tenant is gone for every client."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import aiocache_kv as akv
from aiocache_kv.errors import StorageKeyError
from aiocache_kv.namespace import namespace_of
from aiocache_kv.storage import MooncakeStorage, PageBuffer
from aiocache_kv.storage.base import TagRemovableStorage
from aiocache_kv.storage.file import FileStorage
from aiocache_kv.storage.key_layout import key_components
from aiocache_kv.storage.keys import storage_key
from aiocache_kv.storage.mooncake_tags import tag_regex
from aiocache_kv.testing import MemoryStorage
from aiocache_kv.testing.fake_mooncake import FakeMooncakeStorage
from aiocache_kv.tree.hashing import chain_hashes, namespace_seed
from tests.conftest import small_config

from .conftest import MasterProc, loopback_client
from .test_mooncake_storage import SESSION_REGISTERED, HostPool, keys_for


def pages(n: int, seed: int) -> list[PageBuffer]:
    return HostPool(n, seed=seed).slots


@pytest.mark.parametrize("kind", ["file", "memory", "fake_mooncake"])
def test_remove_tag_removes_that_tag_only(kind: str, tmp_path: Path) -> None:
    store: TagRemovableStorage
    if kind == "file":
        store = FileStorage(tmp_path)
    elif kind == "memory":
        store = MemoryStorage()
    else:
        store = FakeMooncakeStorage()
    assert isinstance(store, TagRemovableStorage)
    mine, other, prefix = keys_for("ten.a-1", 4), keys_for("ten.a-10", 3), keys_for("ten", 2)
    backend = store  # the full interface
    for keys, seed in ((mine, 1), (other, 2), (prefix, 3)):
        assert backend.put(keys, pages(len(keys), seed)) == [True] * len(keys)  # type: ignore[attr-defined]
    assert store.remove_tag("ten.a-1") == 4
    assert backend.exists(mine + other + prefix) == [False] * 4 + [True] * 5  # type: ignore[attr-defined]
    assert store.remove_tag("ten.a-1") == 0
    for bad in ("", "a/b", "../x", "x" * 65, 5):
        with pytest.raises(StorageKeyError):
            store.remove_tag(bad)  # type: ignore[arg-type]
    backend.close()  # type: ignore[attr-defined]


def test_file_remove_tag_survives_a_reopen_and_never_follows_links(tmp_path: Path) -> None:
    store = FileStorage(tmp_path)
    keys = keys_for("t1", 3)
    assert store.put(keys, pages(3, 4)) == [True] * 3
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    victim = outside / "precious"
    victim.write_bytes(b"keep")
    path = store.path_of(keys[0])
    path.unlink()
    path.symlink_to(victim)  # a link planted in place of a page is never followed
    store.close()
    again = FileStorage(tmp_path)
    assert again.remove_tag("t1") == 2
    assert victim.read_bytes() == b"keep"
    assert again.exists(keys) == [False] * 3
    again.close()


def test_tag_regex_matches_the_tag_alone() -> None:
    rx = re.compile(tag_regex("m.x-1"))
    assert rx.search(storage_key("m.x-1", bytes(32)))
    assert not rx.search(storage_key("m.x-12", bytes(32)))
    assert not rx.search(storage_key("mAx-1", bytes(32)))  # '.' is literal
    assert not rx.search("zm.x-1/" + "0" * 64 + "/kv")


@pytest.mark.mooncake
@pytest.mark.timeout(120)
def test_remove_tag_on_a_real_master(mc_storage: MooncakeStorage, tag: str) -> None:
    src = HostPool(4, seed=5)
    mc_storage.register_buffer(src.tensor)
    SESSION_REGISTERED.append(src)
    mine, other = keys_for(tag, 3), keys_for(tag + "x", 1)
    assert mc_storage.put(mine + other, src.slots) == [True] * 4
    assert mc_storage.remove_tag(tag) == 3
    assert mc_storage.exists(mine + other) == [False] * 3 + [True]
    assert mc_storage.remove_tag(tag + "x") == 1


@pytest.mark.mooncake
@pytest.mark.timeout(120)
async def test_drop_tenant_over_a_real_master(
    mooncake_master: MasterProc, mc_storage: MooncakeStorage, tag: str
) -> None:
    """A cache drops tenant ``a`` (its own pages) and tenant ``c``, whose pages only another
    client wrote: both are gone from the store for every client; tenant ``b`` stays."""
    model = tag  # a model name unique to the test: its namespaces' tags are too
    prompt = list(range(10, 26))
    cfg = small_config(
        namespace=model,
        storage=loopback_client(mooncake_master, 32 << 20),
        storage_timeout=5.0,
        prefetch_threshold_tokens=0,
        prefetch_policy="wait_complete",
    )

    def keys(tenant: str) -> list[str]:
        ns = namespace_of(model, tenant, "")
        kv = key_components(cfg)[0]
        return [storage_key(ns.tag, h, kv) for h in chain_hashes(namespace_seed(ns.tag), prompt, 2)]

    other = HostPool(8, seed=6)  # "another node" writes tenant c's pages
    mc_storage.register_buffer(other.tensor)
    SESSION_REGISTERED.append(other)
    assert mc_storage.put(keys("c"), other.slots) == [True] * 8
    async with akv.HiCache(cfg) as cache:
        for tenant in ("a", "b"):
            r = cache.insert(prompt, cache.alloc(16), tenant=tenant)
            await cache.flush()
            cache.release(r)
        assert mc_storage.exists(keys("a") + keys("b")) == [True] * 16
        res = await cache.drop(tenant="a")
        assert res.storage_pages == 8 and cache.cached_len(prompt, tenant="a") == 0
        res = await cache.drop(tenant="c")
        assert res.storage_pages == 8 and res.nodes == 0
        cache.check_invariants()
        # (checked while the cache runs: its client's segment holds what it put)
        assert mc_storage.exists(keys("a") + keys("c")) == [False] * 16
        assert mc_storage.exists(keys("b")) == [True] * 8
