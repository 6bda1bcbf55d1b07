"""The key comparison of every tree walk: the C path against the Python reference."""

from __future__ import annotations

import random

import pytest

from aiocache_kv.tree import keycmp
from aiocache_kv.tree.keycmp import py_common_len

IMPLS = [py_common_len]
if keycmp.KEYCMP_IMPL == "c":
    IMPLS.append(keycmp.common_len)


def brute(key: list[int], tokens: list[int], pos: int, limit: int) -> int:
    i = 0
    while i < limit and i < len(key) and pos + i < len(tokens) and key[i] == tokens[pos + i]:
        i += 1
    return i


def test_the_c_path_is_built() -> None:
    """CI builds the extension (``pip install -e .`` with gcc): the fast path must be there,
    or every walk silently takes the slower reference."""
    assert keycmp.KEYCMP_IMPL == "c"


@pytest.mark.parametrize("fn", IMPLS)
def test_matches_a_brute_force_reference(fn: object) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    for _ in range(3000):
        shared = [rng.randrange(50) for _ in range(rng.randrange(0, 300))]
        key = shared + [rng.randrange(50) for _ in range(rng.randrange(0, 5))]
        pos = rng.randrange(0, 5)
        tokens = [rng.randrange(50) for _ in range(pos)] + [
            t if rng.random() < 0.5 else int(str(t))
            for t in shared  # equal, not identical
        ]
        tokens += [rng.randrange(50) for _ in range(rng.randrange(0, 5))]
        limit = rng.randrange(0, len(key) + 10)
        got = fn(key, tokens, pos, limit)  # type: ignore[operator]
        assert got == brute(key, tokens, pos, limit), f"seed {seed}: {key}, {tokens}, {pos}"


@pytest.mark.parametrize("fn", IMPLS)
def test_equal_ints_that_are_not_the_same_object(fn: object) -> None:
    """Token ids a tokenizer made afresh: equal values in distinct objects (small ones the C
    path compares inline, others through the comparison call), negative and huge ones too."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    values = [300, 32_000, 1 << 29, (1 << 30) - 1, 1 << 30, 1 << 62, -5, -(1 << 40), 0]
    for _ in range(2000):
        key = [rng.choice(values) + rng.randrange(3) for _ in range(rng.randrange(0, 40))]
        tokens = [int(str(t)) for t in key]  # equal, never identical (beyond the small cache)
        if tokens and rng.random() < 0.7:
            at = rng.randrange(len(tokens))
            tokens[at] = int(str(tokens[at] + rng.choice([1, -1, 1 << 30, -(1 << 30)])))
        limit = rng.randrange(0, len(key) + 3)
        got = fn(key, tokens, 0, limit)  # type: ignore[operator]
        assert got == brute(key, tokens, 0, limit), f"seed {seed}: {key}, {tokens}, {limit}"


@pytest.mark.parametrize("fn", IMPLS)
def test_edges(fn: object) -> None:
    f = fn
    assert f([], [], 0, 5) == 0  # type: ignore[operator]
    assert f([1, 2, 3], [1, 2, 3], 0, 2) == 2  # type: ignore[operator]
    assert f([1, 2, 3], [9, 1, 2], 1, 10) == 2  # type: ignore[operator]
    assert f([1, 2, 3], [1, 2, 3], 7, 3) == 0  # type: ignore[operator]  # pos past the end
    assert f([1, 2], [1.0, 2], 0, 2) == 2  # type: ignore[operator]  # equality, not identity
    with pytest.raises(ValueError):
        f([1], [1], -1, 1)  # type: ignore[operator]
    with pytest.raises(ValueError):
        f([1], [1], 0, -1)  # type: ignore[operator]


@pytest.mark.skipif(keycmp.KEYCMP_IMPL != "c", reason="the C path only")
def test_hostile_items_neither_crash_nor_hide_errors() -> None:
    class Boom:
        def __eq__(self, other: object) -> bool:
            raise RuntimeError("boom")

        __hash__ = object.__hash__

    with pytest.raises(RuntimeError, match="boom"):
        keycmp.common_len([1, Boom()], [1, 2], 0, 2)

    key = [1, 2, 3, 4]
    tokens: list[object] = [1]

    class Shrink:
        def __eq__(self, other: object) -> bool:
            key.clear()  # the lists change under the comparison: no read past their ends
            tokens.clear()
            return True

        __hash__ = object.__hash__

    tokens.append(Shrink())
    tokens += [3, 4]
    assert keycmp.common_len(key, tokens, 0, 4) == 2  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        keycmp.common_len((1, 2), [1, 2], 0, 2)  # type: ignore[arg-type]
