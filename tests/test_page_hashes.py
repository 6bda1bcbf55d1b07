"""``aiocache_kv.page_hashes``: a router computes the hashes a real cache publishes."""

from __future__ import annotations

import pytest
import torch

import aiocache_kv as akv
from aiocache_kv.testing import ManualCopyEngine
from aiocache_kv.tree.hashing import chain_hashes, namespace_seed
from tests.conftest import small_config

P = 4
MODEL = "model-a"
NAMES: list[tuple[str | None, str | None]] = [
    (None, None),
    ("t1", None),
    (None, "l1"),
    ("t1", "l1"),
]
# 11 and 13 tokens: unaligned tails; the second shares one page, so it splits the first's node
PROMPTS = [list(range(100, 111)), [100, 101, 102, 103, *range(7, 16)]]


def _insert(cache: akv.HiCache, tokens: list[int], tenant: str | None, lora: str | None) -> None:
    slots = cache.alloc(len(tokens))
    r = cache.insert(tokens, slots[: len(tokens)], tenant=tenant, lora=lora)
    n = len(tokens) // P * P
    cache.free(slots[n:])  # the unaligned tail's slots stay the caller's
    cache.release(r)


async def test_page_hashes_match_block_stored_events(engine: ManualCopyEngine) -> None:
    config = small_config(page_size=P, namespace=MODEL, device_pages=64, host_pages=64)
    seen: set[int] = set()
    async with akv.HiCache(config, copy_engine=engine) as cache:
        for tenant, lora in NAMES:
            for tokens in PROMPTS:
                _insert(cache, tokens, tenant, lora)
            engine.complete_all()
            await cache.flush()
            events = [e for e in cache.take_events() if isinstance(e, akv.BlockStored)]
            assert {e.medium for e in events} == {"GPU", "CPU"}
            want = [
                akv.page_hashes(tokens, page_size=P, model=MODEL, tenant=tenant, lora=lora)
                for tokens in PROMPTS
            ]
            assert [len(w) for w in want] == [2, 3]  # whole pages only
            assert want[0][0] == want[1][0] and want[0][1] != want[1][1]
            published = {h for e in events for h in e.block_hashes}
            assert published == {h for w in want for h in w}
            for e in events:  # every event is a run of one prompt's chain, after its parent
                w = next(w for w in want if e.block_hashes[0] in w)
                i = w.index(e.block_hashes[0])
                assert w[i : i + len(e.block_hashes)] == e.block_hashes
                assert e.parent_block_hash == (w[i - 1] if i else None)
                n = len(e.block_hashes)
                assert e.token_ids == PROMPTS[want.index(w)][i * P : (i + n) * P]
            assert not published & seen  # namespaces never share a page hash
            seen |= published
        cache.check_invariants()


def test_page_hashes_forms_agree() -> None:
    tokens = list(range(1, 10))
    ns = akv.Namespace(MODEL, "t1", "l1")
    want = chain_hashes(namespace_seed(ns.tag), tokens[:8], P)
    assert akv.page_hashes(tokens, page_size=P, model=MODEL, tenant="t1", lora="l1") == want
    assert akv.page_hashes(tokens, page_size=P, namespace=ns) == want
    assert akv.page_hashes(tuple(tokens), page_size=P, namespace=ns) == want
    assert akv.page_hashes(torch.tensor(tokens), page_size=P, namespace=ns) == want
    assert akv.page_hashes(tokens[:3], page_size=P, model=MODEL) == []
    assert akv.page_hashes([], page_size=P, model=MODEL) == []
    assert akv.page_hashes(torch.tensor([], dtype=torch.long), page_size=P, model=MODEL) == []
    # the default tenant/lora are the empty strings
    assert akv.page_hashes(tokens, page_size=P, model=MODEL, tenant="", lora="") == (
        akv.page_hashes(tokens, page_size=P, namespace=akv.Namespace(MODEL))
    )


@pytest.mark.parametrize(
    ("tokens", "kwargs", "error"),
    [
        ([1, 2], {"page_size": 0, "model": MODEL}, akv.InvalidInputError),
        ([1, 2], {"page_size": 1}, akv.InvalidInputError),
        ([1, 2], {"page_size": 1, "model": ""}, akv.InvalidInputError),
        (
            [1, 2],
            {"page_size": 1, "model": MODEL, "namespace": akv.Namespace(MODEL)},
            akv.InvalidInputError,
        ),
        (
            [1, 2],
            {"page_size": 1, "namespace": akv.Namespace(MODEL), "tenant": "t"},
            akv.InvalidInputError,
        ),
        ([1, 2], {"page_size": 1, "model": MODEL, "tenant": 3}, akv.InvalidTypeError),
        ([1, -2], {"page_size": 1, "model": MODEL}, akv.InvalidInputError),
        ([1, 1 << 63], {"page_size": 1, "model": MODEL}, akv.InvalidInputError),
        ([1, 2.0], {"page_size": 1, "model": MODEL}, akv.InvalidTypeError),
        ("ab", {"page_size": 1, "model": MODEL}, akv.InvalidTypeError),
    ],
)
def test_page_hashes_rejects_bad_input(
    tokens: object, kwargs: dict[str, object], error: type[Exception]
) -> None:
    with pytest.raises(error):
        akv.page_hashes(tokens, **kwargs)  # type: ignore[arg-type]
