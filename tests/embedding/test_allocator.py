"""ExtentAllocator: best fit, alignment, coalescing, double free, against a byte-map model."""

from __future__ import annotations

import random

import pytest

from aiocache_kv.embedding import ExtentAllocator
from aiocache_kv.errors import InvalidInputError


def test_alignment_and_best_fit() -> None:
    a = ExtentAllocator(1024, alignment=64)
    x = a.alloc(1)
    y = a.alloc(65)
    z = a.alloc(64)
    assert (x, y, z) == (0, 64, 192)
    assert a.size_of(y) == 128 and a.used_bytes == 256
    a.free(x)  # hole of 64 at 0; big free tail at 256
    assert a.alloc(60) == 0  # best fit takes the small hole, not the tail
    a.check_invariants()


def test_coalescing_restores_one_extent() -> None:
    a = ExtentAllocator(640, alignment=64)
    offs = [a.alloc(64) for _ in range(10)]
    assert a.alloc(1) is None
    for i in (1, 3, 2, 0, 9, 5, 7, 6, 8, 4):
        a.free(offs[i])
        a.check_invariants()
    assert a.largest_free() == 640 and a.free_bytes == 640
    assert a.alloc(640) == 0


def test_fragmentation_reported_as_none() -> None:
    a = ExtentAllocator(256, alignment=64)
    offs = [a.alloc(64) for _ in range(4)]
    a.free(offs[0])
    a.free(offs[2])
    assert a.free_bytes == 128 and a.alloc(128) is None  # two holes of 64, not adjacent


def test_bad_calls() -> None:
    a = ExtentAllocator(256)
    off = a.alloc(10)
    assert off is not None
    a.free(off)
    with pytest.raises(InvalidInputError, match="not an allocated extent"):
        a.free(off)
    with pytest.raises(InvalidInputError):
        a.alloc(0)
    with pytest.raises(InvalidInputError):
        ExtentAllocator(256, alignment=48)
    assert ExtentAllocator(0).alloc(1) is None


def test_random_ops_match_a_byte_map() -> None:
    rng = random.Random(7)
    cap = 64 * 200
    a = ExtentAllocator(cap, alignment=64)
    owner = [-1] * (cap // 64)
    live: dict[int, int] = {}
    for step in range(3000):
        if live and rng.random() < 0.45:
            off = rng.choice(list(live))
            size = live.pop(off)
            a.free(off)
            for i in range(off // 64, (off + size) // 64):
                owner[i] = -1
        else:
            want = rng.randint(1, 64 * 12)
            off = a.alloc(want)
            size = a.aligned(want)
            if off is None:
                # best fit fails only if no run of free units is long enough
                run = best = 0
                for o in owner:
                    run = run + 1 if o < 0 else 0
                    best = max(best, run)
                assert best * 64 < size
                continue
            for i in range(off // 64, (off + size) // 64):
                assert owner[i] < 0, f"step {step}: extent {off} overlaps a live one"
                owner[i] = off
            live[off] = size
        if step % 100 == 0:
            a.check_invariants()
    assert a.used_bytes == sum(live.values())
