"""The per-request checks: the C extension and the numpy reference agree on hostile input, and
the cache's insert path built on them rejects what it must, names the values, changes nothing,
and never keeps the caller's buffers."""

from __future__ import annotations

import random
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch

from aiocache_kv import fastcheck
from aiocache_kv.cache import HiCache
from aiocache_kv.config import CacheConfig
from aiocache_kv.errors import InvalidInputError, InvalidTypeError
from aiocache_kv.pools import PageAllocator, PageState
from aiocache_kv.tree.hashing import MAX_TOKEN_ID
from aiocache_kv.tree.radix import RadixTree
from aiocache_kv.validate import check_tokens, page_slots, slots_to_pages


def _ext() -> ModuleType:
    """The C extension; skipped where it was not built (a failure in CI: conftest.py)."""
    if fastcheck._EXT is None:
        pytest.skip("aiocache_kv._fastcheck not built (pip install -e . builds it)")
    return fastcheck._EXT


def test_c_extension_is_the_one_in_use() -> None:
    ext = _ext()
    assert fastcheck.FASTCHECK_IMPL == "c" and fastcheck.first_bad_token is ext.first_bad_token


_BAD: list[Any] = [
    -1,
    MAX_TOKEN_ID + 1,
    1 << 64,
    -(1 << 70),
    1.0,
    "7",
    None,
    b"\x01",
    np.int64(3),
    torch.tensor(1),
]
_GOOD: list[Any] = [0, 1, (1 << 30) - 1, 1 << 30, (1 << 31) + 5, 1 << 62, MAX_TOKEN_ID, True]


def test_first_bad_token_agrees_on_hostile_lists() -> None:
    ext = _ext()
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    for trial in range(400):
        n = rng.randint(1, 300)
        toks: list[Any] = [
            rng.choice(_GOOD) if rng.random() < 0.3 else rng.randrange(1 << 15) for _ in range(n)
        ]
        if rng.random() < 0.6:
            for _ in range(rng.randint(1, 3)):
                toks[rng.randrange(n)] = rng.choice(_BAD)
        want = fastcheck.py_first_bad_token(toks)
        got = ext.first_bad_token(toks)
        assert got == want, f"seed {seed} trial {trial}: C {got} vs numpy {want}"
        if want >= 0:
            assert any(toks[want] is b for b in _BAD), f"seed {seed} trial {trial}"
        else:
            assert all(isinstance(t, int) and 0 <= t <= MAX_TOKEN_ID for t in toks)


class _Token(int):
    """An int subclass: a valid token, but a list holding it stays tracked (its instances
    carry a ``__dict__``, so they could close a reference cycle)."""


def test_checked_key_agrees_and_untracks_only_exact_int_keys() -> None:
    """``checked_key`` (the plan's one pass: check the tail, make the new leaf's key) against
    the reference ``first_bad_token`` + slice + ``gcfree.keep``: the same bad index, or an
    equal new list, untracked exactly when every item of the key is an exact int."""
    import gc

    ext = _ext()
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    goods: list[Any] = [*_GOOD, _Token(9), _Token(1 << 40)]
    for trial in range(600):
        size = rng.randint(1, 200)
        toks: list[Any] = [
            rng.choice(goods) if rng.random() < 0.1 else rng.randrange(1 << 15) for _ in range(size)
        ]
        pos = rng.randint(0, size)
        start = rng.randint(pos, size)
        n = rng.randint(pos, size)
        if rng.random() < 0.5 and start < size:  # a bad token after start (the walk's part
            toks[rng.randrange(start, size)] = rng.choice(_BAD)  # before it is vouched for)
        why = f"seed {seed} trial {trial}: start {start} pos {pos} n {n}"
        want = fastcheck.py_checked_key(toks, start, pos, n)
        got = ext.checked_key(toks, start, pos, n)
        if isinstance(want, int):
            assert got == want == fastcheck.py_first_bad_token(toks, start) >= 0, why
            continue
        assert isinstance(got, list) and got == want == toks[pos:n], why
        assert got is not toks and all(a is b for a, b in zip(got, toks[pos:n], strict=True))
        exact = all(type(t) is int for t in toks[pos:n])
        assert gc.is_tracked(got) is (not exact), why
        assert gc.is_tracked(want) is (not exact), why
    for bad in ((toks, 0, 1, 1), (toks, 2, 1, len(toks) + 1), (toks, 1, 2, 3), ([1], -1, -1, 0)):
        with pytest.raises(ValueError):
            ext.checked_key(*bad)
        with pytest.raises(ValueError):
            fastcheck.py_checked_key(*bad)
    with pytest.raises(TypeError):
        ext.checked_key((1, 2), 0, 0, 1)


def test_set_states_agrees_on_runs_scatters_and_bad_ids() -> None:
    """``set_states`` (an allocator's ``take``: one memset for a contiguous run, a scatter
    otherwise) writes what numpy's ``state[ids] = value`` writes, and nothing at all when an
    id is outside the array."""
    ext = _ext()
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    for trial in range(500):
        size = rng.randint(1, 300)
        backing = np.zeros(size + 64, dtype=np.uint8)  # what a bad write past the end hits
        state = backing[:size]
        state[:] = [rng.randrange(6) for _ in range(size)]
        n = rng.randint(0, size)
        a = rng.randint(0, size - n)
        kind = rng.choice(["run", "shuffled", "gappy", "bad", "run_past"])
        ids = np.arange(a, a + n, dtype=np.int64)
        if kind == "shuffled" and n > 1:
            ids = ids[rng.sample(range(n), n)]
        elif kind == "gappy" and n:
            ids = np.array(sorted(rng.sample(range(size), n)), dtype=np.int64)
        elif kind == "bad":
            ids = np.append(ids, rng.choice([-1, size, size + 7, -(1 << 40)])).astype(np.int64)
            ids = ids[rng.sample(range(ids.size), ids.size)]
        elif kind == "run_past":  # a run that ends past the array, or starts below it
            lo = rng.choice([size - rng.randint(0, 5), -rng.randint(1, 5)])
            ids = np.arange(lo, lo + rng.randint(6, 20), dtype=np.int64)
            kind = "bad"
        value = rng.randrange(256)
        why = f"seed {seed} trial {trial}: {kind} ids {ids.tolist()[:8]}"
        orig, want, got = state.copy(), state.copy(), state  # got: a write past it hits backing
        if kind == "bad":
            with pytest.raises(IndexError):
                fastcheck.py_set_states(want, ids, value)
            with pytest.raises(IndexError):
                ext.set_states(got, ids, value)
            assert np.array_equal(got, orig), why  # nothing written
            assert not backing[size:].any(), why  # nor past the end
            continue
        fastcheck.py_set_states(want, ids, value)
        ext.set_states(got, ids, value)
        assert np.array_equal(got, want), why


def test_slot_pages_agrees_and_catches_every_broken_run() -> None:
    ext = _ext()
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    for trial in range(400):
        p = rng.choice([1, 2, 3, 16])
        limit_pages = rng.randint(4, 64)
        k = rng.randint(0, limit_pages)
        pages = rng.sample(range(limit_pages), k)
        slots = np.array([pg * p + j for pg in pages for j in range(p)], dtype=np.int64)
        fault = rng.randrange(5)
        if slots.size and fault == 1:
            slots[rng.randrange(slots.size)] += rng.choice([1, -1, p])
        elif slots.size and fault == 2:
            slots[rng.randrange(slots.size)] = rng.choice([-1, limit_pages * p, 1 << 40])
        elif fault == 3:
            slots = slots[: max(0, slots.size - 1)]  # a short last run
        size = slots.size // p
        out_py = np.full(size, -7, dtype=np.int64)
        out_c = np.full(size, -7, dtype=np.int64)
        want = fastcheck.py_slot_pages(slots, p, limit_pages * p, out_py)
        got = ext.slot_pages(slots, p, limit_pages * p, out_c)
        assert got == want, f"seed {seed} trial {trial}: C {got} vs numpy {want}, p {p}"
        ok = (
            slots.size % p == 0
            and all(0 <= s < limit_pages * p for s in slots.tolist())
            and all(
                slots[i] % p == 0 and list(slots[i : i + p]) == list(range(slots[i], slots[i] + p))
                for i in range(0, slots.size, p)
            )
        )
        assert (want == fastcheck.SLOTS_OK) == ok, f"seed {seed} trial {trial}"
        if ok:
            assert out_c.tolist() == out_py.tolist() == (slots[::p] // p).tolist()


def test_first_repeat_and_held_check_agree() -> None:
    ext = _ext()
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    num = 64
    stamp_c = np.zeros(num, dtype=np.int64)
    epoch = 0
    for trial in range(400):
        ids = np.array([rng.randrange(num) for _ in range(rng.randint(0, 20))], dtype=np.int64)
        epoch -= 1
        got = ext.first_repeat(ids, stamp_c, epoch)
        want = fastcheck.py_first_repeat(ids, np.zeros(num, dtype=np.int64), 0)
        distinct = len(set(ids.tolist())) == ids.size
        assert (got < 0) == (want < 0) == distinct, f"seed {seed} trial {trial}: {ids}"
        for i in (got, want):
            assert i < 0 or ids.tolist().count(ids[i]) > 1, f"seed {seed} trial {trial}"
        state = np.array([rng.randrange(4) for _ in range(num)], dtype=np.uint8)
        existing = np.array(
            [
                int(x) if rng.random() < 0.7 else rng.randrange(num)
                for x in ids[: rng.randint(0, ids.size)]
            ],
            dtype=np.int64,
        )
        c = ext.held_check(ids, existing, state, int(PageState.HELD))
        py = fastcheck.py_held_check(ids, existing, state, int(PageState.HELD))
        assert tuple(c) == tuple(py), f"seed {seed} trial {trial}: C {c} vs numpy {py}"


def test_insert_pages_agrees_with_the_reference_and_the_separate_checks() -> None:
    """The fused insert check: C and numpy give the same (code, index, differing) and ids, and
    each code is the one the separate checks (slot_pages, first_repeat, held_check) imply."""
    ext = _ext()
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    num = 32
    stamp_c = np.zeros(num, dtype=np.int64)
    epoch = 0
    seen: set[int] = set()
    for trial in range(600):
        p = rng.choice((1, 2, 4))
        pages = [rng.randrange(num + 2) for _ in range(rng.randint(0, 8))]
        if rng.random() < 0.3:  # one alloc's run (the fast path), maybe past the pool's end
            a = rng.randrange(num + 2)
            pages = list(range(a, a + rng.randint(1, 10)))
        slots = np.array([pg * p + j for pg in pages for j in range(p)], dtype=np.int64)
        if slots.size and rng.random() < 0.15:  # break a run
            slots[rng.randrange(slots.size)] += rng.choice((-1, 1))
        # pages past the pool read as HELD were the bounds not checked (the array is a view)
        backing = np.full(num + 16, int(PageState.HELD), dtype=np.uint8)
        state = backing[:num]
        state[:] = [rng.randrange(4) for _ in range(num)]
        if rng.random() < 0.5:  # mostly held, as after an alloc
            state[np.array([rng.random() < 0.9 for _ in range(num)])] = int(PageState.HELD)
        k = rng.randint(0, len(pages)) if rng.random() < 0.5 else 0
        existing = np.array(
            [pg if rng.random() < 0.7 else rng.randrange(num) for pg in pages[:k]], dtype=np.int64
        )
        held = int(PageState.HELD)
        out_c = np.full(slots.size // p, -7, dtype=np.int64)
        out_py = np.full(slots.size // p, -7, dtype=np.int64)
        epoch -= 1
        c = ext.insert_pages(slots, p, num * p, out_c, existing, state, held, stamp_c, epoch)
        py = fastcheck.py_insert_pages(
            slots, p, num * p, out_py, existing, state, held, np.zeros(num, dtype=np.int64), 0
        )
        where = f"seed {seed} trial {trial}: p={p} slots={slots.tolist()} C {c} numpy {py}"
        assert tuple(c) == tuple(py), where
        code = c[0]
        seen.add(code)
        want = fastcheck.py_slot_pages(slots, p, num * p, np.empty(slots.size // p, np.int64))
        if want != fastcheck.SLOTS_OK:
            assert code == want, where
            continue
        assert out_c.tolist() == out_py.tolist(), where
        distinct = len(set(out_c.tolist())) == out_c.size
        assert (code == fastcheck.INSERT_REPEAT) == (not distinct), where
        if distinct:
            bad, differing = fastcheck.py_held_check(out_c, existing, state, held)
            assert (code, c[1]) == ((fastcheck.INSERT_NOT_HELD, bad) if bad >= 0 else (0, -1))
            assert c[2] == differing, where
    assert seen == {0, 1, 2, 3, 4}, f"seed {seed}: codes seen {seen}"


def test_page_slots_agree() -> None:
    """Scattered pages, one run of ids (an alloc's: filled as one run of slots), runs broken
    at the start, middle or end, one page, none: C, reference and the definition agree."""
    ext = _ext()
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    cases = [[5, 0, 9, 3], [7, 8, 9, 10], [7], []]
    for _ in range(200):
        first, n = rng.randrange(1000), rng.randint(1, 40)
        run = list(range(first, first + n))
        if rng.random() < 0.6:  # a run with one id off by one (a near-run is no run)
            k = rng.randrange(n)
            run[k] += rng.choice((-1, 1, n))
        cases.append(run)
    for p in (1, 2, 16):
        for ids in cases:
            pages = np.array(ids, dtype=np.int64)
            a = np.full(pages.size * p, -7, dtype=np.int64)
            b = np.empty(pages.size * p, dtype=np.int64)
            ext.page_slots(pages, p, a)
            fastcheck.py_page_slots(pages, p, b)
            want = [pg * p + j for pg in ids for j in range(p)]
            assert a.tolist() == b.tolist() == want, f"seed {seed}: p={p} {ids}"
    with pytest.raises(ValueError):
        ext.page_slots(np.zeros(2, dtype=np.int64), 4, np.empty(7, dtype=np.int64))


class _Bytes(bytes):
    pass


def test_hex_keys_agree_on_hashes_and_hostile_items() -> None:
    """Storage keys made in C: the reference's strings, the same first bad index for items
    that are not exactly bytes of the size (a subclass, bytearray, a str, another size)."""
    ext = _ext()
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    bad: list[Any] = [_Bytes(32), bytearray(32), "ab" * 16, bytes(31), bytes(33), None, 7]
    for _ in range(300):
        n = rng.randint(0, 40)
        hashes: list[Any] = [rng.randbytes(32) for _ in range(n)]
        if n and rng.random() < 0.5:
            hashes[rng.randrange(n)] = rng.choice(bad)
        pre, post = rng.choice([("t/", "/kv"), ("", ""), ("model-9/", "/mamba")])
        got, want = (
            ext.hex_keys(pre, hashes, post, 32),
            fastcheck.py_hex_keys(pre, hashes, post, 32),
        )
        assert got == want, f"seed {seed}: {hashes!r:.200}"
        if isinstance(want, list):
            assert want == [f"{pre}{h.hex()}{post}" for h in hashes]
            assert all(type(k) is str and k.isascii() for k in got)
    assert ext.hex_keys("p", [b"\x00\xff"], "s", 2) == ["p00ffs"]
    with pytest.raises(TypeError):
        ext.hex_keys("p", (bytes(32),), "s", 32)  # a tuple: the wrapper makes it a list
    with pytest.raises(ValueError):
        ext.hex_keys("é/", [bytes(32)], "/kv", 32)  # not ASCII: never a checked tag
    with pytest.raises(ValueError):
        ext.hex_keys("t/", [], "/kv", -1)


def test_the_c_functions_refuse_foreign_buffers() -> None:
    ext = _ext()
    with pytest.raises(TypeError):
        ext.first_bad_token((1, 2))
    with pytest.raises(ValueError):
        ext.slot_pages(np.zeros(3, dtype=np.int32), 1, 8, np.empty(3, dtype=np.int64))
    with pytest.raises(IndexError):
        ext.first_repeat(np.array([70], dtype=np.int64), np.zeros(64, dtype=np.int64), -1)
    with pytest.raises(IndexError):
        ext.held_check(
            np.array([70], dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(64, np.uint8), 1
        )
    with pytest.raises(TypeError):  # read-only output
        ext.slot_pages(
            np.zeros(2, dtype=np.int64), 1, 8, np.zeros(2, dtype=np.int64).setflags(write=False)
        )


def test_check_tokens_names_the_offender() -> None:
    with pytest.raises(InvalidTypeError, match=r"found 1\.5 \(float\) at 2"):
        check_tokens([1, 2, 1.5])
    with pytest.raises(InvalidInputError, match=r"found -3 at 1"):
        check_tokens([1, -3])
    with pytest.raises(InvalidInputError, match=str(1 << 63)):
        check_tokens([0, 1 << 63])
    assert check_tokens((True, 2)) == [True, 2]


def test_slots_to_pages_copies_and_checks_strided_input() -> None:
    slots = torch.arange(32, dtype=torch.int64)
    pages = slots_to_pages(slots[::1], 32, 4, 8)
    slots[0] = 99  # the caller reuses its buffer: the pages must not move
    assert pages.tolist() == list(range(8))
    every_other = torch.arange(0, 64, dtype=torch.int64)[::2]  # not contiguous
    with pytest.raises(InvalidInputError, match="whole pages"):
        slots_to_pages(every_other, 32, 4, 16)
    assert slots_to_pages(torch.arange(8, dtype=torch.int32), 8, 2, 4).tolist() == [0, 1, 2, 3]
    assert page_slots(torch.tensor([2, 0]), 3).tolist() == [6, 7, 8, 0, 1, 2]


def test_allocator_scratch_and_checks() -> None:
    a = PageAllocator(16, "test")
    held = a.alloc(4, PageState.HELD)
    assert a.repeat_at(held) == -1 and a.repeat_at(held) == -1  # epochs never collide
    twice = torch.cat([held, held[:1]])
    assert a.repeat_at(twice) in (0, 4)
    none = np.empty(0, dtype=np.int64)

    def check(pages: np.ndarray, existing: np.ndarray) -> tuple[int, int, int]:
        code, at, differing, _ = a.check_insert(pages, 1, existing)  # page size 1: ids
        return code, at, differing

    assert check(held.numpy(), none) == (0, -1, 0)
    owned = a.alloc(2)
    mixed = torch.cat([owned, held]).numpy()
    assert check(mixed, owned.numpy()) == (0, -1, 0)  # the tree's own pages in front are fine
    # not the tree's and not held
    assert check(mixed, owned.flip(0).numpy()) == (fastcheck.INSERT_NOT_HELD, 0, 2)
    assert a.scratch(3).size == 3 and a.scratch(100).size == 100


def _cfg(p: int) -> CacheConfig:
    return CacheConfig(
        page_size=p,
        num_layers=1,
        num_kv_heads=1,
        head_dim=2,
        dtype=torch.float32,
        device="cpu",
        device_pages=32,
        host_pages=0,
        host_memory_reserve_bytes=0,
    )


@pytest.mark.parametrize("impl", ["c", "python"])
@pytest.mark.parametrize("p", [1, 4])
async def test_insert_rejects_bad_pages_and_keeps_no_caller_buffer(
    p: int, impl: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if impl == "python":  # the numpy reference, as where the extension is not built
        for name, ref in (
            ("insert_pages", fastcheck.py_insert_pages),
            ("slot_pages", fastcheck.py_slot_pages),
            ("first_repeat", fastcheck.py_first_repeat),
            ("page_slots_into", fastcheck.py_page_slots),
            ("first_bad_token", fastcheck.py_first_bad_token),
            ("checked_key", fastcheck.py_checked_key),
        ):
            monkeypatch.setattr(fastcheck, name, ref)
    async with HiCache(_cfg(p)) as cache:
        toks = list(range(100, 100 + 8 * p))
        slots = cache.alloc(len(toks))
        before = cache.statistics()
        with pytest.raises(InvalidInputError, match=r"repeat page \d+"):
            cache.insert(toks, torch.cat([slots[: 4 * p], slots[: 4 * p]]))
        foreign = slots.clone()
        foreign[-p:] = torch.arange(31 * p, 32 * p)  # a page nobody gave the caller
        with pytest.raises(InvalidInputError, match=r"name page 31 \(of token "):
            cache.insert(toks, foreign)
        assert cache.statistics() == before
        cache.check_invariants()
        r = cache.insert(toks, slots)
        slots.fill_(0)  # the caller reuses its buffer
        m = cache.match_prefix(toks)
        assert m.device_pages.tolist() == sorted(m.device_pages.tolist())  # alloc is ascending
        assert len(set(m.device_pages.tolist())) == 8 and 0 not in m.device_pages.tolist()[1:]
        # the duplicate of the tree's prefix is freed; the new tail is the tree's
        extra = cache.alloc(4 * p)
        r2 = cache.insert(toks + list(range(4 * p)), torch.cat([m.device_indices, extra]))
        assert r2.prefix_len == len(toks)
        for h in (r, m, r2):
            cache.release(h)
        cache.check_invariants()


def test_insert_plan_matches_a_plain_insert() -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    for p in (1, 2):
        a, b = RadixTree(p), RadixTree(p)
        for tree in (a, b):
            tree.root("ns", "t")
        for trial in range(150):
            n = rng.randint(1, 12) * p
            toks = [rng.randrange(3) for _ in range(n)]
            pages = torch.arange(trial * 100, trial * 100 + n // p)
            plan = a.plan_insert("ns", toks, n)
            out_a = a.insert("ns", toks, n, pages, plan=plan, pin=False)
            out_b = b.insert("ns", toks, n, pages, pin=False)
            assert (out_a.prefix_tokens, out_a.inserted_tokens) == (
                out_b.prefix_tokens,
                out_b.inserted_tokens,
            ), f"seed {seed} trial {trial}"
            assert _shape(a) == _shape(b), f"seed {seed} p {p} trial {trial}"
            a.check_invariants()
            assert (
                a.device_prefix("ns", toks, n).tolist() == b.device_prefix("ns", toks, n).tolist()
            )


def test_a_stale_plan_is_refused() -> None:
    tree = RadixTree(1)
    tree.root("ns", "t")
    tree.insert("ns", [1, 2, 3, 4], 4, torch.arange(4), pin=False)
    plan = tree.plan_insert("ns", [1, 2, 9], 3)  # ends inside the node [1, 2, 3, 4]
    tree.insert("ns", [1, 5], 2, torch.arange(10, 12), pin=False)  # splits it under the plan
    with pytest.raises(AssertionError, match="stale insert plan"):
        tree.insert("ns", [1, 2, 9], 3, torch.arange(20, 23), plan=plan)


def _shape(tree: RadixTree) -> list[tuple[tuple[int, ...], list[int]]]:
    out = []
    stack = list(tree.roots())
    while stack:
        node = stack.pop()
        pages = [] if node.device_pages is None else node.device_pages.tolist()
        out.append((tuple(t for n in tree.path(node) for t in n.key), pages))
        stack.extend(node.children.values())
    return sorted(out)


def test_fast_calls_refuse_bad_arguments_before_reading_a_buffer() -> None:
    """The per-request C calls parse their arguments by hand: a wrong count, a float where
    an int goes, or an int past a C int raise before any buffer is read or written."""
    ext = _ext()
    state = np.zeros(8, dtype=np.uint8)
    ids = np.arange(4, dtype=np.int64)
    out = np.zeros(8, dtype=np.int64)
    stamp = np.zeros(8, dtype=np.int64)
    for call, args in (
        (ext.set_states, (state, ids)),
        (ext.page_slots, (ids, 2)),
        (ext.insert_pages, (ids, 1, 8, out, ids, state, 1, stamp)),
    ):
        with pytest.raises(TypeError, match="takes"):
            call(*args)
    with pytest.raises(TypeError):
        ext.page_slots(ids, 2.0, out)
    with pytest.raises(OverflowError):
        ext.set_states(state, ids, 1 << 40)
    with pytest.raises(TypeError):
        ext.insert_pages(ids, 1, 8.0, out[:4], ids[:0], state, 1, stamp, 1)
    assert not state.any() and not out.any() and not stamp.any()
    ext.set_states(state, ids, 3)  # the same calls, well formed
    ext.page_slots(ids[:2], 4, out)
    assert state.tolist() == [3] * 4 + [0] * 4 and out.tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
