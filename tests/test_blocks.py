"""``page_hashes`` (a router's view of block hashes) and ``snapshot`` (a late consumer's resync)
agree with the KV events a real cache publishes."""

from __future__ import annotations

from pathlib import Path

import pytest

import aiocache_kv as akv
from aiocache_kv.events import BlockRemoved, BlockStored
from aiocache_kv.storage import FileStorage
from aiocache_kv.testing import ManualCopyEngine
from tests.conftest import small_config


def stored(events: list[akv.KVEvent], medium: str) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored) and e.medium == medium]


@pytest.mark.parametrize(("tenant", "lora"), [(None, None), ("alice", None), (None, "ad-1")])
async def test_page_hashes_match_published_hashes(
    engine: ManualCopyEngine, tenant: str | None, lora: str | None
) -> None:
    tokens = list(range(40, 53))  # 13 tokens: 6 pages of 2 and an unaligned tail
    async with akv.HiCache(small_config(namespace="m-1"), copy_engine=engine) as cache:
        slots = cache.alloc(len(tokens))
        cache.release(cache.insert(tokens, slots[: len(tokens)], tenant=tenant, lora=lora))
        (ev,) = stored(cache.take_events(), "GPU")
    want = akv.page_hashes(tokens, model="m-1", page_size=2, tenant=tenant, lora=lora)
    assert want == ev.block_hashes and len(want) == 6
    other = akv.page_hashes(tokens, model="m-1", page_size=2, tenant="bob")
    assert other[0] != want[0]  # another tenant's blocks hash apart
    assert akv.page_hashes([1], model="m-1", page_size=2) == []


def test_page_hashes_rejects_bad_input() -> None:
    with pytest.raises(akv.InvalidInputError):
        akv.page_hashes([1, 2], model="m", page_size=0)
    with pytest.raises(akv.InvalidTypeError):
        akv.page_hashes([1, 2], model="m", page_size=2, tenant=7)  # type: ignore[arg-type]
    with pytest.raises(akv.InvalidInputError):
        akv.page_hashes([1, -2], model="m", page_size=2)


async def test_snapshot_equals_the_view_built_from_events(tmp_path: Path) -> None:
    """A consumer that replays every event holds exactly what ``snapshot`` reports."""
    cfg = small_config(storage=FileStorage(tmp_path), prefetch_threshold_tokens=0)
    async with akv.HiCache(cfg) as cache:
        for toks, lora in (([1, 2, 3, 4], None), ([1, 2, 5, 6, 7, 8], None), ([1, 2], "a")):
            slots = cache.alloc(len(toks))
            r = cache.insert(toks, slots, lora=lora)
            await r.write_through
            cache.release(r)
        await cache.flush()
        cache.evict(2, "device")  # some pages leave the device tier
        view: dict[tuple[bytes, str], BlockStored] = {}
        for ev in cache.take_events():
            if isinstance(ev, BlockStored):
                for h in ev.block_hashes:
                    view[(h, ev.medium)] = ev
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    view.pop((h, ev.medium), None)
        snap = cache.snapshot()
        got = {(b.block_hash, medium) for b in snap for medium in b.tiers}
        assert got == set(view)
        by_hash = {b.block_hash: b for b in snap}
        for b in snap:  # parents come first and chain up to the namespace's first page
            assert b.parent_block_hash is None or b.parent_block_hash in by_hash
        lora_blocks = [b for b in snap if b.lora_name == "a"]
        assert [b.token_ids for b in lora_blocks] == [(1, 2)]
        assert all("alice" not in b.namespace_tag for b in snap)


def spec_hashes(prev: bytes, tokens: list[int], page_size: int) -> list[bytes]:
    """The documented hash function, written plainly (32 bytes per page, no batching)."""
    import hashlib
    import struct

    out = []
    for i in range(0, len(tokens), page_size):
        page = struct.pack(f"<{page_size}q", *tokens[i : i + page_size])
        prev = hashlib.blake2b(prev + page, digest_size=32).digest()
        out.append(prev)
    return out


@pytest.mark.parametrize("page_size", [1, 2, 16])
def test_chain_hashes_follow_the_documented_function(page_size: int) -> None:
    import random

    from aiocache_kv.tree.hashing import MAX_TOKEN_ID, chain_hashes

    rng = random.Random(page_size)
    tokens = [rng.randrange(MAX_TOKEN_ID + 1) for _ in range(page_size * 300)]
    seed = rng.randbytes(32)
    assert chain_hashes(seed, tokens, page_size) == spec_hashes(seed, tokens, page_size)
