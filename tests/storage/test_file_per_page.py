"""FileStorage's per-page costs: a single page read summed as it lands (one pass), and the
index's batched add of a put's group."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from aiocache_kv.storage import FRAME_OVERHEAD, FileStorage, integrity, page_file
from aiocache_kv.storage.page_index import PageIndex
from tests.storage.test_file_storage import empty, keys_for, pages, payload


def test_a_single_page_is_read_and_summed_in_one_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk of one page (a 4 MiB page is a chunk of its own) goes through the C reader
    too, which sums the payload as it lands: the verify gets that sum and reads only the
    trailer (it was read into the slot, then summed again, in a second pass)."""
    if page_file.PAGEIO is None:
        pytest.skip("aiocache_kv.storage._pageio not built")
    slot = (300 << 10) + FRAME_OVERHEAD  # a few pieces of the fused read
    fs = FileStorage(tmp_path, capacity_bytes=None)
    (key,) = keys_for("one", 1)
    (src,) = pages(1, slot=slot)
    assert fs.put([key], [src]) == [True]
    real_read, real_verify = page_file.PAGEIO.read_pages, integrity.verify_many
    calls: list[tuple[int, bool]] = []
    sums: list[Any] = []

    class Reader:
        @staticmethod
        def read_pages(reads: list[Any], summing: bool = False) -> Any:
            calls.append((len(reads), summing))
            return real_read(reads, summing)

    def verify_many(*args: Any, **kwargs: Any) -> Any:
        sums.append(kwargs.get("sums"))
        return real_verify(*args, **kwargs)

    monkeypatch.setattr(page_file, "PAGEIO", Reader)
    monkeypatch.setattr(integrity, "verify_many", verify_many)
    dst = empty(1, slot=slot)
    assert fs.get_into([key], dst) == [True]
    assert payload(dst[0]) == payload(src)
    assert calls == [(1, True)]
    assert len(sums) == 1 and sums[0] is not None and sums[0][0][2] == slot - FRAME_OVERHEAD
    # and a flipped payload byte is still caught through that sum
    path = fs.path_of(key)
    data = bytearray(path.read_bytes())
    data[-FRAME_OVERHEAD - 1000] ^= 0x01  # in the payload
    path.write_bytes(bytes(data))
    assert fs.get_into([key], empty(1, slot=slot)) == [False]
    assert fs.statistics().corrupt == 1


def _state(ix: PageIndex) -> tuple[object, ...]:
    ix.check()
    names = ix.names()
    return (
        names,
        ix.total,
        [(ix.parent(n), ix.children(n)) for n in names],
        {t: ix.tag_pages(t) for t in ("a", "b")},
    )


@pytest.mark.parametrize("seed", range(20))
def test_add_many_is_add_page_by_page(seed: int) -> None:
    """A put's group enters the index in one ``add_many``: the same entries, chains, tags,
    order and victims as one ``add`` per page (re-adds, self-parents, orphans included)."""
    rng = random.Random(seed)
    one, many = PageIndex(), PageIndex()
    pool = [f"{i:040x}" for i in range(40)]
    for _ in range(30):
        group = []
        for _ in range(rng.randint(0, 8)):
            name = rng.choice(pool)
            parent = rng.choice([None, name, *rng.sample(pool, 3)])
            group.append((name, rng.randint(1, 100), parent, rng.choice([None, "a", "b"])))
        for entry in group:
            one.add(*entry)
        many.add_many(group)
        assert _state(one) == _state(many), f"seed {seed}"
        if rng.random() < 0.3:
            victim = rng.choice(pool)
            assert one.remove(victim) == many.remove(victim), f"seed {seed}"
        if rng.random() < 0.3:
            run = rng.sample(pool, 4)
            one.touch_run(run)
            many.touch_run(run)
        if rng.random() < 0.2:
            cap = max(0, one.total - rng.randint(0, 300))
            assert one.pick_victims(cap) == many.pick_victims(cap), f"seed {seed}"
    assert _state(one) == _state(many), f"seed {seed}"
