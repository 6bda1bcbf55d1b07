"""EmbeddingCache without a store: round trips, exact LRU order, bad input, stats, repr, logs."""

from __future__ import annotations

import asyncio

import pytest
import torch

from aiocache_kv.embedding import (
    DuplicateHashError,
    EmbeddingCache,
    EmbeddingMismatchError,
    EntryState,
    InsertBatchStats,
    embedding_key,
    slot_nbytes,
)
from aiocache_kv.embedding.entries import Entry
from aiocache_kv.errors import (
    CacheClosedError,
    ConfigError,
    InvalidInputError,
    InvalidTypeError,
    KVCacheError,
    OwnershipError,
)
from aiocache_kv.storage.keys import parse_storage_key
from aiocache_kv.testing import capture_logs

DIM = 8


def emb(seed: int, tokens: int = 4, dim: int = DIM) -> torch.Tensor:
    return torch.randn(tokens, dim, generator=torch.Generator().manual_seed(seed))


def entry_bytes(tokens: int = 4, dim: int = DIM) -> int:
    """Aligned pool bytes of one float32 entry."""
    n = slot_nbytes(tokens, dim, torch.float32)
    return (n + 63) // 64 * 64


async def test_round_trip_str_and_bytes_hashes_and_dtypes() -> None:
    async with EmbeddingCache(pool_bytes=1 << 16) as cache:
        a, b = emb(1), emb(2, tokens=7, dim=3)
        st = await cache.insert_batch(["img-a", b"\x00img-b"], [a, b])
        assert st == InsertBatchStats(new=2, local_hit=0, skipped=0, push_failed=0)
        got = await cache.get_batch([b"img-a", "\x00img-b", "nope", "img-a"])
        assert got[0] is not None and torch.equal(got[0], a)
        assert got[1] is not None and torch.equal(got[1], b) and got[1].shape == (7, 3)
        assert got[2] is None
        assert got[3] is not None and torch.equal(got[3], a) and got[3] is not got[0]
        got[0].zero_()  # the caller owns the returned tensors
        again = await cache.get_batch(["img-a"])
        assert again[0] is not None and torch.equal(again[0], a)
        cache.check_invariants()
    async with EmbeddingCache(pool_bytes=1 << 16, dtype=torch.bfloat16) as cache:
        x = emb(3).to(torch.bfloat16)
        await cache.insert_batch(["x"], [x])
        (y,) = await cache.get_batch(["x"])
        assert y is not None and y.dtype == torch.bfloat16 and torch.equal(x, y)


async def test_non_contiguous_and_grad_tensors_are_copied() -> None:
    async with EmbeddingCache(pool_bytes=1 << 16) as cache:
        base = emb(4, tokens=8, dim=16)
        t = base[::2, ::2]  # non-contiguous view
        g = emb(5).requires_grad_()
        await cache.insert_batch(["t", "g"], [t, g])
        got = await cache.get_batch(["t", "g"])
        assert got[0] is not None and torch.equal(got[0], t)
        assert got[1] is not None and torch.equal(got[1], g.detach())
        assert not got[1].requires_grad


async def test_lru_eviction_exact_order() -> None:
    per = entry_bytes()
    async with EmbeddingCache(pool_bytes=3 * per) as cache:
        for h in ("a", "b", "c"):
            await cache.insert_batch([h], [emb(ord(h))])
        assert cache.lru_order() == [b"a", b"b", b"c"]
        await cache.get_batch(["a"])  # a becomes most recent
        assert cache.lru_order() == [b"b", b"c", b"a"]
        await cache.insert_batch(["c"], [emb(ord("c"))])  # a local hit also counts as a use
        assert cache.lru_order() == [b"b", b"a", b"c"]
        st = await cache.insert_batch(["d"], [emb(ord("d"))])
        assert st.new == 1 and cache.lru_order() == [b"a", b"c", b"d"]  # b evicted
        # two adjacent slots wanted: victims in LRU order (a, c) until a hole fits - here only
        # after d goes too, because d sits between a's and c's slots
        st = await cache.insert_batch(["big"], [emb(9, tokens=12)])
        assert st.new == 1 and cache.lru_order() == [b"big"]
        assert cache.statistics().evictions == 4
        assert (await cache.get_batch(["b", "a", "c", "d"])) == [None] * 4
        cache.check_invariants()


async def test_lru_victims_follow_use_order() -> None:
    per = entry_bytes()
    async with EmbeddingCache(pool_bytes=4 * per) as cache:
        await cache.insert_batch(["a", "b", "c", "d"], [emb(1), emb(2), emb(3), emb(4)])
        await cache.get_batch(["b"])
        await cache.get_batch(["a", "c"])  # order now d, b, a, c
        await cache.insert_batch(["e"], [emb(5)])
        assert cache.lru_order() == [b"b", b"a", b"c", b"e"]  # d was the victim
        await cache.insert_batch(["f", "g"], [emb(6), emb(7)])
        assert cache.lru_order() == [b"c", b"e", b"f", b"g"]  # then b, then a
        cache.check_invariants()


async def test_evict_frees_in_lru_order() -> None:
    per = entry_bytes()
    async with EmbeddingCache(pool_bytes=4 * per) as cache:
        await cache.insert_batch(["a", "b", "c"], [emb(1), emb(2), emb(3)])
        assert cache.evict(1) == per and cache.lru_order() == [b"b", b"c"]
        assert cache.evict() == 2 * per and cache.statistics().used_bytes == 0
        with pytest.raises(InvalidInputError):
            cache.evict(-1)
        cache.check_invariants()


async def test_batch_never_evicts_its_own_entries_and_skips_what_cannot_fit() -> None:
    per = entry_bytes()
    async with EmbeddingCache(pool_bytes=2 * per) as cache:
        await cache.insert_batch(["old"], [emb(0)])
        big = emb(1, tokens=200)  # larger than the whole pool
        st = await cache.insert_batch(["x", "y", "z", "big"], [emb(1), emb(2), emb(3), big])
        # x evicts old, y fits, z would need x or y (pinned by this batch), big never fits
        assert st == InsertBatchStats(new=2, local_hit=0, skipped=2)
        got = await cache.get_batch(["old", "x", "y", "z", "big"])
        assert [g is not None for g in got] == [False, True, True, False, False]
        assert cache.statistics().insert_skipped == 2
        cache.check_invariants()


async def test_a_pool_too_small_for_one_entry_skips_everything() -> None:
    async with EmbeddingCache(pool_bytes=64) as cache:
        st = await cache.insert_batch(["a", "b"], [emb(1), emb(2)])
        assert st == InsertBatchStats(new=0, local_hit=0, skipped=2)
        assert cache.statistics().entries == 0
        cache.check_invariants()


async def test_bad_input_raises_typed_errors_and_changes_nothing() -> None:
    async with EmbeddingCache(pool_bytes=1 << 16) as cache:
        await cache.insert_batch(["a"], [emb(1)])
        before = cache.statistics()
        cases: list[tuple[object, object, type[Exception], str]] = [
            (["b"], [torch.zeros(4)], InvalidInputError, "2-D"),
            (["b"], [torch.zeros(2, 3, 4)], InvalidInputError, "2-D"),
            (["b"], [torch.zeros(0, 4)], InvalidInputError, "empty dimension"),
            (["b"], [torch.zeros(2, 4, dtype=torch.float16)], InvalidInputError, "dtype"),
            (["b"], [[1.0, 2.0]], InvalidTypeError, "torch.Tensor"),
            (["b", "c"], [emb(1)], InvalidInputError, "2 hashes but 1 tensors"),
            ([3], [emb(1)], InvalidTypeError, "str or bytes"),
            ([""], [emb(1)], InvalidInputError, "empty"),
            ("ab", [emb(1), emb(2)], InvalidTypeError, "sequence"),
            (["b"], emb(1), InvalidTypeError, "single Tensor"),
            (["b", "c", "b"], [emb(1), emb(2), emb(3)], DuplicateHashError, "duplicate"),
            ([b"b", "b"], [emb(1), emb(2)], DuplicateHashError, "duplicate"),
            (["b", "a"], [emb(1), emb(2, dim=DIM + 1)], EmbeddingMismatchError, "4x8"),
            (["a"], [emb(2, tokens=5)], EmbeddingMismatchError, "given 5x8"),
        ]
        for hashes, tensors, err, msg in cases:
            with pytest.raises(err, match=msg):
                await cache.insert_batch(hashes, tensors)  # type: ignore[arg-type]
            assert issubclass(err, KVCacheError)
        after = cache.statistics()
        assert after.entries == before.entries == 1 and after.used_bytes == before.used_bytes
        assert after.insert_calls == before.insert_calls
        assert await cache.get_batch(["b", "c"]) == [None, None]
        with pytest.raises(InvalidTypeError):
            await cache.get_batch([None])  # type: ignore[list-item]
        with pytest.raises(InvalidInputError, match="max"):
            await cache.get_batch([b"x" * 2000])
        cache.check_invariants()


async def test_empty_batches_are_no_ops_with_one_log_event() -> None:
    async with EmbeddingCache(pool_bytes=1 << 12) as cache:
        with capture_logs() as logs:
            assert await cache.insert_batch([], []) == InsertBatchStats(0, 0, 0)
            assert await cache.get_batch([]) == []
        events = [e for e in logs if e["event"] == "embedding.insert_batch"]
        assert len(events) == 1 and events[0]["new"] == 0


async def test_one_log_event_per_insert_with_the_counts() -> None:
    per = entry_bytes()
    async with EmbeddingCache(pool_bytes=2 * per) as cache:
        await cache.insert_batch(["a"], [emb(1)])
        with capture_logs() as logs:
            await cache.insert_batch(
                ["a", "b", "c", "d"], [emb(1), emb(2), emb(3), emb(4, tokens=100)]
            )
        events = [e for e in logs if e["event"] == "embedding.insert_batch"]
        assert len(events) == 1
        assert (events[0]["new"], events[0]["local_hit"], events[0]["skipped"]) == (1, 1, 2)


def test_config_errors() -> None:
    with pytest.raises(ConfigError):
        EmbeddingCache(pool_bytes=0)
    with pytest.raises(ConfigError):
        EmbeddingCache(pool_bytes=True)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="dtype"):
        EmbeddingCache(pool_bytes=1024, dtype=torch.complex64)
    with pytest.raises(ConfigError, match="namespace"):
        EmbeddingCache(pool_bytes=1024, namespace="a/b")
    with pytest.raises(ConfigError, match="store"):
        EmbeddingCache(pool_bytes=1024, store=object())  # type: ignore[arg-type]


async def test_closed_cache_and_other_threads_are_refused() -> None:
    cache = EmbeddingCache(pool_bytes=1 << 12)
    await cache.insert_batch(["a"], [emb(1)])  # the first call starts it
    with pytest.raises(OwnershipError):
        await asyncio.to_thread(cache._check)
    await cache.aclose()
    await cache.aclose()  # idempotent
    with pytest.raises(CacheClosedError):
        await cache.insert_batch(["a"], [emb(1)])
    with pytest.raises(CacheClosedError):
        await cache.get_batch(["a"])
    assert "state=closed" in repr(cache)


async def test_statistics_and_repr_show_state_counts() -> None:
    async with EmbeddingCache(pool_bytes=1 << 14, namespace="clip") as cache:
        await cache.insert_batch(["a", "b"], [emb(1), emb(2)])
        s = cache.statistics()
        assert (s.entries, s.ready, s.filling, s.lookup, s.pinned, s.evictable) == (
            2,
            2,
            0,
            0,
            0,
            2,
        )
        assert s.used_bytes == 2 * entry_bytes() and s.free_bytes == s.pool_bytes - s.used_bytes
        r = repr(cache)
        assert "entries=2 (ready=2, filling=0, lookup=0)" in r and "store=None" in r
        with pytest.raises(AttributeError):
            s.entries = 3  # type: ignore[misc]


def test_keys_one_tag_one_component_and_content_addressed() -> None:
    k1 = embedding_key("clip", b"image-1")
    assert k1 == embedding_key("clip", b"image-1")  # deterministic (no hash())
    parsed = parse_storage_key(k1)
    assert (parsed.tag, parsed.component) == ("clip", "emb")
    keys = {embedding_key("clip", f"image-{i}".encode()) for i in range(1000)}
    assert len(keys) == 1000  # different items never share a key (LMCache #690)
    assert embedding_key("clip", b"\x01") != embedding_key("clip", b"\x00\x01")
    assert embedding_key("siglip", b"image-1") != k1  # namespaces are disjoint
    f16 = embedding_key("clip", b"image-1", torch.float16)  # so are dtypes
    assert parse_storage_key(f16).component == "emb-2" and f16 != k1
    assert f16 != embedding_key("clip", b"image-1", torch.bfloat16)
    with pytest.raises(InvalidInputError, match="complex64"):
        embedding_key("clip", b"image-1", torch.complex64)


def test_entry_transitions_are_checked() -> None:
    e = Entry(b"h", "k", EntryState.LOOKUP)
    with pytest.raises(AssertionError, match="illegal"):
        e.transition(EntryState.READY)  # LOOKUP -> READY skips FILLING
    e.transition(EntryState.GONE)
    with pytest.raises(AssertionError, match="illegal"):
        e.transition(EntryState.FILLING)
