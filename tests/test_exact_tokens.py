"""Tokens of an ``int`` subclass run no caller code inside a tree walk.

Found by an adversarial round: ``match_prefix`` and ``insert`` walked the caller's own list,
so a token whose ``__hash__``, ``__eq__`` or ``__index__`` changed that list mid-walk made
``insert`` fail with a bare ``ValueError`` (the key slice's bounds no longer held), report a
negative ``uncached_len``, or match and insert fewer pages than the values name.  Such items
are now replaced by exact ints of their values (``fastcheck.exact_ints``, no code of theirs
runs) before any walk, so a hostile token acts as its value.
"""

from __future__ import annotations

import asyncio
import enum
from typing import Any

import numpy as np
import pytest

import aiocache_kv as akv
from aiocache_kv import fastcheck
from aiocache_kv.storage import integrity
from aiocache_kv.storage.base import PageBuffer
from tests.conftest import small_config

CFG = small_config(device_pages=32, host_pages=0)


class Color(enum.IntEnum):
    RED = 5


def evil_type(kind: str, victim: list[Any], calls: list[str]) -> type[int]:
    class Evil(int):
        def __eq__(self, other: object) -> bool:
            calls.append("eq")
            if kind == "eq":
                victim[:] = [object()] * 3
            return int(self) == other

        def __hash__(self) -> int:
            calls.append("hash")
            if kind == "hash":
                victim.clear()
            return int.__hash__(self)

        def __index__(self) -> int:
            calls.append("index")
            if kind == "index":
                victim.clear()
            return int(self)

    return Evil


@pytest.mark.parametrize("kind", ["eq", "hash", "index"])
def test_a_hostile_token_acts_as_its_value(kind: str) -> None:
    async def main() -> None:
        async with akv.HiCache(CFG) as cache:
            cache.release(cache.insert([1, 2, 3, 4, 5, 6, 7, 8], cache.alloc(8)))
            plain = [1, 2, 3, 4, 5, 9, 10, 11, 12, 13]
            calls: list[str] = []
            toks: list[Any] = []
            evil = evil_type(kind, toks, calls)
            toks[:] = [1, 2, 3, evil(4), evil(5), 9, evil(10), 11, 12, 13]
            m = cache.match_prefix(toks)
            assert m.device_len == 4, m  # as for the plain values: [1, 2], [3, 4]
            cache.release(m)
            r = cache.insert(toks, cache.alloc(10))
            assert (r.prefix_len, r.inserted_len, r.uncached_len) == (4, 10, 0), r
            cache.release(r)
            assert calls == [], f"the tokens' own code ran: {calls}"
            assert len(toks) == 10 and type(toks[3]) is evil, "the caller's list changed"
            m = cache.match_prefix(plain)
            assert m.device_len == 10, "the insert keyed other values than the tokens'"
            cache.release(m)
            cache.check_invariants()

    asyncio.run(main())


def test_bools_and_int_enums_match_as_their_values() -> None:
    async def main() -> None:
        async with akv.HiCache(CFG) as cache:
            cache.release(cache.insert([1, 0, 5, 7], cache.alloc(4)))
            m = cache.match_prefix([True, False, Color.RED, 7])
            assert m.device_len == 4
            cache.release(m)
            cache.check_invariants()

    asyncio.run(main())


@pytest.mark.parametrize("impl", ["c", "python"])
def test_exact_ints(impl: str) -> None:
    fn = fastcheck.py_exact_ints if impl == "python" else fastcheck.exact_ints
    if impl == "c":
        assert fastcheck.FASTCHECK_IMPL == "c", "the _fastcheck extension did not build"
    plain = [1, 2, 3, 4, 5]
    assert fn(plain) is plain, "a list of exact ints is used as it is"
    odd = [object(), "7", 2.0, None]
    assert fn(odd) is odd, "non-ints are left for the token check to name"
    big = type("Big", (int,), {})(2**70)
    mixed: list[Any] = [1, True, Color.RED, 3, 4, big, -(2**63), "x"]
    out = fn(mixed)
    assert out is not mixed and mixed[1] is True, "the caller's list is not changed"
    assert out[:5] == [1, 1, 5, 3, 4]
    assert [type(v) for v in out[:5]] == [int] * 5
    assert out[5] is big, "a value beyond a long long stays as it is (the check refuses it)"
    assert out[6] == -(2**63) and out[7] == "x"
    assert fn([*plain[:4], False]) == [1, 2, 3, 4, 0]


@pytest.mark.parametrize("impl", ["c", "python"])
@pytest.mark.parametrize("size", [np.int64(4096), np.uint32(4096), 4096.0, True])
def test_verify_many_refuses_a_size_that_is_not_an_int(
    impl: str, size: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The C read exact ints only (``TypeError``) while the reference compared any number
    (``OK``): one call, two answers."""
    if impl == "python":
        monkeypatch.setattr(integrity, "_EXT", None)
    bufs = [PageBuffer.allocate(4096)]
    integrity.seal_many(bufs, ["k"])
    with pytest.raises(akv.InvalidInputError, match=r"nbytes_read\[0\] must be an int"):
        integrity.verify_many(bufs, ["k"], [size])  # type: ignore[list-item]
    assert integrity.verify_many(bufs, ["k"], [4096]) == [integrity.Verdict.OK]
