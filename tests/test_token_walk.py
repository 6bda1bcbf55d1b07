"""Token checks folded into the tree walks: ``match_prefix`` and ``insert`` check only the
tokens their walk did not match against cached keys, and still refuse every bad token with a
typed error before anything changes.

The walk counts a token as matched only when it is an int equal to a cached key item
(``int_common_len``), so what it skips checking is exactly what a check would have passed.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

import aiocache_kv as akv
from aiocache_kv import fastcheck
from aiocache_kv.tree import keycmp
from tests.conftest import small_config

CMP_IMPLS = [keycmp.py_int_common_len]
KEY_IMPLS = [keycmp.py_page_key]
if keycmp.KEYCMP_IMPL == "c":
    CMP_IMPLS.append(keycmp.int_common_len)
    KEY_IMPLS.append(keycmp.page_key)


class Spy:
    """A token whose hash and equality are recorded (and would run any code)."""

    calls = 0

    def __hash__(self) -> int:
        Spy.calls += 1
        return hash(5)

    def __eq__(self, other: object) -> bool:
        Spy.calls += 1
        return True


@pytest.mark.parametrize("fn", CMP_IMPLS)
def test_int_common_len_counts_only_ints(fn: Any) -> None:
    assert fn([1, 2, 3], [1, 2, 3], 0, 3) == 3
    assert fn([1, 2, 3], [1, 2.0, 3], 0, 3) == 1  # equal, but not an int
    assert fn([1, 2, 3], [1, np.int64(2), 3], 0, 3) == 1
    assert fn([1, 2, 3], [True, 2, 3], 0, 3) == 3  # a bool is an int, as the checks say
    assert fn([1, 2, 3], [9, 1, int("2"), 3], 1, 3) == 3  # equal ints, distinct objects
    with pytest.raises(ValueError):
        fn([1], [1], -1, 1)


@pytest.mark.parametrize("fn", CMP_IMPLS)
def test_int_common_len_agrees_with_common_len_on_ints(fn: Any) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    for _ in range(2000):
        key = [rng.randrange(40) for _ in range(rng.randrange(0, 200))]
        tokens = [t if rng.random() < 0.97 else rng.randrange(40) for t in key]
        tokens = [int(str(t)) if rng.random() < 0.3 else t for t in tokens]
        limit = rng.randrange(0, len(key) + 3)
        want = keycmp.py_common_len(key, tokens, 0, limit)
        assert fn(key, tokens, 0, limit) == want, f"seed {seed}"


@pytest.mark.parametrize("fn", KEY_IMPLS)
def test_page_key(fn: Any) -> None:
    assert fn([1, 2, 3, 4, 5], 1, 2) == (2, 3)
    assert fn([1, 2, 3], 2, 2) is None  # a short page
    assert fn([1, 2.0, 3], 0, 2) is None
    assert fn([1, True, 3], 0, 2) is None  # not an exact int: checked before hashing
    assert fn([1, Spy(), 3], 0, 3) is None
    with pytest.raises(ValueError):
        fn([1], 0, 0)


def test_first_bad_token_from_a_start() -> None:
    toks: list[Any] = [1, 2.5, 3, -1, 5]
    for f in {fastcheck.first_bad_token, fastcheck.py_first_bad_token}:
        assert f(toks) == 1
        assert f(toks, 2) == 3
        assert f(toks, 4) == -1
        assert f(toks, 9) == -1
        assert f([], 0) == -1
        with pytest.raises(ValueError):
            f(toks, -1)


BAD: list[tuple[Any, type[Exception]]] = [
    (2.0, akv.InvalidTypeError),
    (np.int64(2), akv.InvalidTypeError),
    (-3, akv.InvalidInputError),
    (2**64, akv.InvalidInputError),
    ([2], akv.InvalidTypeError),  # unhashable: refused before any lookup
    ("2", akv.InvalidTypeError),
]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("where", ["inside", "after", "tail"])
@pytest.mark.parametrize(("bad", "error"), BAD)
async def test_a_bad_token_anywhere_changes_nothing(
    page_size: int, where: str, bad: Any, error: type[Exception]
) -> None:
    """A bad token inside the cached prefix (equal by value to the cached one), right after
    it, or in the unaligned tail: the typed error, naming it, and no split, pin, stamp, hit
    or page anywhere; the slots stay the caller's."""
    p = page_size
    async with akv.HiCache(small_config(page_size=p, device_pages=64, host_pages=0)) as cache:
        cached = list(range(100, 100 + 6 * p))
        r = cache.insert(cached, cache.alloc(len(cached)))
        cache.release(r)
        toks: list[Any] = [*cached[: 4 * p], *range(500, 500 + 4 * p), 7]
        at = {"inside": 2 * p + 1, "after": 4 * p, "tail": len(toks) - 1}[where]
        if where == "inside" and not isinstance(bad, (list, str)) and bad == bad:
            bad = type(bad)(toks[at]) if not isinstance(bad, int) else bad
        toks[at] = bad
        before = (cache.statistics(), cache.snapshot())
        with pytest.raises(error, match=f"at {at}"):
            cache.match_prefix(toks)
        assert (cache.statistics(), cache.snapshot()) == before
        if where != "tail":  # an insert's slots cover whole pages: no unaligned tail here
            ins = toks[: 8 * p]
            slots = cache.alloc(len(ins))
            mid = (cache.statistics(), cache.snapshot())
            with pytest.raises(error, match=f"at {at}"):
                cache.insert(ins, slots)
            assert (cache.statistics(), cache.snapshot()) == mid
            m = cache.match_prefix(cached[: 4 * p])
            with pytest.raises(error, match=f"at {at}"):
                cache.insert(ins, slots[4 * p :], prefix=m)
            cache.release(m)
            cache.free(slots)  # still the caller's
            assert cache.statistics().device == before[0].device
        assert cache.snapshot() == before[1]
        cache.check_invariants()


@pytest.mark.parametrize("page_size", [1, 4])
async def test_no_code_of_a_token_runs_in_a_walk(page_size: int) -> None:
    """A token of a user class is refused before the walk hashes or compares it."""
    p = page_size
    async with akv.HiCache(small_config(page_size=p, device_pages=64, host_pages=0)) as cache:
        cached = list(range(100, 100 + 4 * p))
        cache.release(cache.insert(cached, cache.alloc(len(cached))))
        for at in (0, 2 * p, 4 * p):
            toks: list[Any] = [*cached, *range(9, 9 + 2 * p)]
            toks[at] = Spy()
            Spy.calls = 0
            with pytest.raises(akv.InvalidTypeError):
                cache.match_prefix(toks)
            slots = cache.alloc(len(toks))
            with pytest.raises(akv.InvalidTypeError):
                cache.insert(toks, slots)
            cache.free(slots)
            assert Spy.calls == 0, f"a Spy at {at} was hashed or compared"
        cache.check_invariants()


async def test_bools_are_tokens_as_before() -> None:
    """``check_tokens`` accepts a bool (an int); the walk matches it as its int."""
    async with akv.HiCache(small_config(page_size=1, device_pages=64, host_pages=0)) as cache:
        cache.release(cache.insert([1, 0, 1, 5], cache.alloc(4)))
        m = cache.match_prefix([True, False, True, 5])
        assert m.device_len == 4
        cache.release(m)
        r = cache.insert([True, False, 3], cache.alloc(3))
        assert r.prefix_len == 2 and r.inserted_len == 3
        cache.release(r)
        cache.check_invariants()


@pytest.mark.parametrize("seed", range(6))
async def test_random_bad_tokens_are_named_where_a_full_check_would(seed: int) -> None:
    """Seeded: random prompts over a random tree, a bad token at a random place in some.
    Every call raises exactly when a full check of the list finds a bad token, with its
    error type and index, and leaves the tree as it was; the others match and insert."""
    rng = random.Random(seed)
    p = rng.choice((1, 2, 4))
    bads: list[Any] = [2.0, -1, 2**63, None, "x", np.int64(3), [1], Spy()]
    async with akv.HiCache(small_config(page_size=p, device_pages=512, host_pages=0)) as cache:
        stems = [[rng.randrange(50) for _ in range(rng.randrange(1, 6) * p)] for _ in range(4)]
        for _ in range(60):
            toks: list[Any] = [
                *rng.choice(stems),
                *(rng.randrange(50) for _ in range(rng.randrange(0, 3 * p + 2))),
            ]
            if rng.random() < 0.5:
                at = rng.randrange(len(toks))
                bad = rng.choice(bads)
                toks[at] = bad if bad is not None else toks[at] + 0.0
            first = fastcheck.py_first_bad_token(toks)
            where = f"seed {seed}: tokens {toks!r}"
            n = len(toks) // p * p
            if first < 0:
                m = cache.match_prefix(toks)
                own = cache.alloc(n - m.device_len)
                cache.release(cache.insert(toks[:n], own, prefix=m))
                cache.release(m)
                continue
            before = cache.snapshot()
            Spy.calls = 0
            with pytest.raises((akv.InvalidTypeError, akv.InvalidInputError), match=f"at {first}$"):
                cache.match_prefix(toks)
            if n:
                slots = cache.alloc(n)
                with pytest.raises(
                    (akv.InvalidTypeError, akv.InvalidInputError), match=f"at {first}$"
                ):
                    cache.insert(toks[:n] if first < n else toks, slots)
                cache.free(slots)
            assert cache.snapshot() == before, where
            assert Spy.calls == 0, where
        cache.check_invariants()


async def test_bad_tokens_are_reported_before_a_bad_tenant() -> None:
    """The names are checked before the walk that checks the tokens: a call with both wrong
    reports the tokens, as when every token was checked first, in match and insert alike."""
    async with akv.HiCache(small_config(page_size=1, device_pages=64, host_pages=0)) as cache:
        slots = cache.alloc(3)
        with pytest.raises(akv.InvalidTypeError, match="tokens must be ints"):
            cache.match_prefix([1, 2.5, 3], tenant=7)  # type: ignore[arg-type]
        with pytest.raises(akv.InvalidTypeError, match="tokens must be ints"):
            cache.insert([1, 2.5, 3], slots, tenant=7)  # type: ignore[arg-type]
        with pytest.raises(akv.InvalidTypeError, match="tenant"):
            cache.insert([1, 2, 3], slots, tenant=7)  # type: ignore[arg-type]
        cache.free(slots)
        cache.check_invariants()
