"""A stored page is served only for the tokens it was computed from (rule 3).

A 64-bit page hash used as the storage key fell to a birthday search in about a minute: a
client could send prompt B whose key equals prompt A's, and a node reading A got B's KV.
These tests do not need the search.  They make two prompts share keys on purpose (the tier's
key function is wrapped so that B's pages are written under A's keys, exactly what a
collision does), or plant B's sealed page under A's key, and check that the read path rejects
it on every backend: the trailer binds the page's full-width identity, and a page bound to
other tokens is a miss, counted as corrupt and removed, never data.  On the code before page
identities every one of these served B's rows for A.
"""

from __future__ import annotations

import contextlib
import struct
import sys
import uuid
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import aiocache_kv as akv
from aiocache_kv.storage import FileStorage, PageBuffer, integrity, tier_base
from aiocache_kv.storage.keys import storage_key, storage_keys
from aiocache_kv.testing import MemoryStorage
from tests.conftest import small_config
from tests.test_cache import read_kv
from tests.test_split_ack import write_kv

from .conftest import MasterProc, loopback_client

NS = "identity-model"  # made unique per test (a Mooncake master outlives a test)
A = list(range(100, 108))  # 4 pages of 2 tokens
B = list(range(200, 208))  # 4 other pages


@pytest.fixture(autouse=True)
def _namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules[__name__], "NS", f"identity-{uuid.uuid4().hex[:10]}")


def cfg(store: akv.StorageBackend) -> akv.CacheConfig:
    return small_config(
        namespace=NS,
        storage=store,
        prefetch_threshold_tokens=0,
        prefetch_policy="wait_complete",
        storage_timeout=5.0,
    )


def collide(monkeypatch: pytest.MonkeyPatch, victim: list[int], attacker: list[int]) -> None:
    """Make ``attacker``'s pages share ``victim``'s storage keys, as a hash collision would
    (the chain makes every continuation collide too)."""
    alias = dict(
        zip(
            akv.page_hashes(attacker, model=NS, page_size=2),
            akv.page_hashes(victim, model=NS, page_size=2),
            strict=True,
        )
    )
    real = tier_base.storage_keys

    def keys(tag: str, hashes: list[bytes], component: str = "kv") -> list[str]:
        return real(tag, [alias.get(h, h) for h in hashes], component)

    monkeypatch.setattr(tier_base, "storage_keys", keys)


async def node(stack: contextlib.AsyncExitStack, store: akv.StorageBackend) -> akv.HiCache:
    """A cache over ``store`` that stays open until ``stack`` closes (a Mooncake client's
    pages live in its own segment: the writer must outlive the reader's reads)."""
    return await stack.enter_async_context(akv.HiCache(cfg(store)))


async def write_prompt(cache: akv.HiCache, tokens: list[int], seed: int) -> list[torch.Tensor]:
    slots = cache.alloc(len(tokens))
    kv = write_kv(cache, slots, seed=seed)
    cache.release(cache.insert(tokens, slots))
    await cache.flush()
    return kv


async def served_for(cache: akv.HiCache, tokens: list[int]) -> tuple[int, list[torch.Tensor]]:
    """Prefetch, match and load ``tokens``: the prefix served and its rows."""
    await cache.prefetch(tokens)
    m = cache.match_prefix(tokens)
    await cache.load_back(m)
    rows = read_kv(cache, m.device_indices)
    n = m.device_len
    cache.release(m)
    return n, rows


Factory = Callable[[], akv.StorageBackend]


@pytest.fixture(params=["file", "mooncake", "memory"])
def stores(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[Factory, Callable[[], int]]]:
    """A factory of the nodes' views of one shared store, and its corrupt counter."""
    made: list[akv.StorageBackend] = []
    if request.param == "file":

        def make() -> akv.StorageBackend:
            made.append(FileStorage(tmp_path / "shared"))
            return made[-1]

    elif request.param == "mooncake":
        master: MasterProc = request.getfixturevalue("mooncake_master")

        def make() -> akv.StorageBackend:
            made.append(loopback_client(master, 32 << 20))
            return made[-1]

    else:
        mem = MemoryStorage()

        def make() -> akv.StorageBackend:
            made.append(mem)
            return mem

    yield make, lambda: sum(s.statistics().corrupt for s in {id(m): m for m in made}.values())


async def test_another_prompts_pages_under_the_victims_keys_are_never_served(
    stores: tuple[Factory, Callable[[], int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """B's pages stored under A's keys (a collision): a node reading A gets a miss."""
    make, corrupt = stores
    collide(monkeypatch, victim=A, attacker=B)
    async with contextlib.AsyncExitStack() as stack:
        writer = await node(stack, make())
        await write_prompt(writer, B, seed=1)
        assert writer.statistics().backup_pages_ok == len(B) // 2
        reader = await node(stack, make())
        n, rows = await served_for(reader, A)
        assert n == 0, f"{n} tokens of another prompt's KV served for A"
        assert all(r.numel() == 0 for r in rows)
        assert corrupt() >= 1  # counted like a corrupt page (the first one stops the run)
        # the victim's own pages work once written: nothing about A is poisoned for good (new
        # nodes: a FileStorage instance indexes the directory when it opens)
        monkeypatch.setattr(tier_base, "storage_keys", storage_keys)
        kv_a = await write_prompt(await node(stack, make()), A, seed=2)
        n, rows = await served_for(await node(stack, make()), A)
        assert n == len(A)
        assert all(torch.equal(r, w) for r, w in zip(rows, kv_a, strict=True))


async def test_a_collision_poisons_no_continuation(
    stores: tuple[Factory, Callable[[], int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chained collision makes A+S and B+S share keys for every suffix S: the continuation
    is rejected too, not only the first colliding page."""
    make, _ = stores
    suffix = [7, 8, 9, 10]
    collide(monkeypatch, victim=A + suffix, attacker=B + suffix)
    async with contextlib.AsyncExitStack() as stack:
        await write_prompt(await node(stack, make()), B + suffix, seed=3)
        n, _ = await served_for(await node(stack, make()), A + suffix)
        assert n == 0


def test_a_planted_page_with_a_valid_checksum_is_rejected(
    stores: tuple[Factory, Callable[[], int]],
) -> None:
    """The backend level: B's page sealed by a writer that believed the key was B's (valid
    checksum, valid key binding) is read for A's identity: a miss, counted, removed."""
    make, corrupt = stores
    store = make()
    store.open()
    try:
        tag = f"t{uuid.uuid4().hex[:10]}"
        ha = akv.page_hashes(A[:2], model=NS, page_size=2)[0]
        hb = akv.page_hashes(B[:2], model=NS, page_size=2)[0]
        key = storage_key(tag, ha)  # the victim's key
        buf = PageBuffer.allocate(256 + integrity.FRAME_OVERHEAD)
        buf.tensor[:256] = 7
        assert store.put([key], [buf], identities=[hb]) == [True]  # the attacker's identity
        out = PageBuffer.allocate(buf.nbytes)
        assert store.get_into([key], [out], identities=[ha]) == [False]
        assert corrupt() == 1
        assert store.exists([key]) == [False]  # removed: the victim's own put can replace it
        assert store.put([key], [buf], identities=[ha]) == [True]
        assert store.get_into([key], [out], identities=[ha]) == [True]
        assert bytes(out.view[:256]) == bytes([7]) * 256
    finally:
        store.close()


def test_pages_put_without_an_identity_are_bound_to_their_key(tmp_path: Path) -> None:
    """Direct backend use: no identity given binds the key's digest, so a reader that asks
    with an identity (the cache) never takes such a page for a computed one."""
    store = FileStorage(tmp_path)
    keys = storage_keys("t", [bytes(31) + bytes([i]) for i in range(2)])
    bufs = [PageBuffer.allocate(64 + integrity.FRAME_OVERHEAD) for _ in keys]
    assert store.put(keys, bufs) == [True, True]
    outs = [PageBuffer.allocate(b.nbytes) for b in bufs]
    assert store.get_into(keys, outs) == [True, True]
    assert store.get_into(keys[:1], outs[:1], identities=[bytes(32)]) == [False]
    assert integrity.key_identity(keys[1]) != integrity.key_identity(keys[0])
    assert store.get_into(keys[1:], outs[1:], identities=[integrity.key_identity(keys[1])]) == [
        True
    ]


def test_bad_identities_are_typed_errors_and_change_nothing(tmp_path: Path) -> None:
    store = FileStorage(tmp_path)
    keys = storage_keys("t", [bytes(32)])
    buf = PageBuffer.allocate(64 + integrity.FRAME_OVERHEAD)
    for bad in ([bytes(16)], [b"x" * 33], ["s" * 32], [bytes(32), bytes(32)], [None]):
        with pytest.raises(akv.InvalidInputError):
            store.put(keys, [buf], identities=bad)  # type: ignore[arg-type]
        with pytest.raises(akv.InvalidInputError):
            store.get_into(keys, [buf], identities=bad)  # type: ignore[arg-type]
    assert store.exists(keys) == [False]
    assert store.statistics().puts == 0


OLD_TRAILER = struct.Struct("<4sHHQQQII")  # format 1: 40 bytes, no identity


def test_pages_of_the_old_format_are_misses_and_cleaned_up(tmp_path: Path) -> None:
    """A format-1 page (64-bit key, 40-byte trailer without identity) is never data: in a
    slot of today's size it fails the length or version check, and FileStorage deletes it."""
    store = FileStorage(tmp_path)
    key = storage_keys("t", [bytes(32)])[0]
    buf = PageBuffer.allocate(64 + integrity.FRAME_OVERHEAD)
    assert store.put([key], [buf]) == [True]
    path = store.path_of(key)
    raw = bytearray(path.read_bytes())
    # rewrite the page as format 1 would have: the payload grows by the 32 bytes the old
    # trailer lacked, and the old trailer (valid crc, version 1) ends the file
    n = len(buf.view) - OLD_TRAILER.size
    head = OLD_TRAILER.pack(b"AKVP", 1, 1, n, 0, 0, zlib.crc32(key.encode()), 0)[:36]
    slot = bytes(n) + head + struct.pack("<I", zlib.crc32(head))
    start = len(raw) - len(buf.view)
    path.write_bytes(bytes(raw[:start]) + slot)
    out = PageBuffer.allocate(buf.nbytes)
    assert store.get_into([key], [out]) == [False]
    assert store.statistics().corrupt == 1
    assert not path.exists()
    # and the header of the earlier file format reads as another format (BAD_MAGIC)
    assert store.put([key], [buf]) == [True]
    raw = bytearray(path.read_bytes())
    raw[:4] = b"AKV2"
    path.write_bytes(bytes(raw))
    assert store.get_into([key], [out]) == [False]
    assert not path.exists()
