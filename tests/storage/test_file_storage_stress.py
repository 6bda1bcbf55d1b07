"""Seeded concurrent churn on one ``FileStorage``: puts (plain and chained), reads and removes
from four threads into a capacity that forces eviction all the time.

Every key's bytes are derived from the key, so whichever worker wrote a page, a read must
return exactly those bytes.  After each run: every indexed page is on disk with its size and
nothing else is; the byte count fits the capacity; every indexed key reads back verified
with its own bytes; no temporary file is left.  ``AKV_FILE_STRESS_SEED=<n>`` adds a seed.
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import threading
import zlib
from pathlib import Path

import pytest
import torch

from aiocache_kv.storage import FileStorage, PageBuffer, integrity
from tests.storage.test_file_storage import SLOT, empty, file_size, keys_for

PAYLOAD = SLOT - integrity.FRAME_OVERHEAD
SEEDS = [1, 2] + (
    [int(os.environ["AKV_FILE_STRESS_SEED"])] if os.environ.get("AKV_FILE_STRESS_SEED") else []
)


def page_of(key: str) -> PageBuffer:
    """The bytes of ``key``'s page (its payload; the trailer is written by put)."""
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    return PageBuffer.from_tensor(torch.randint(0, 256, (SLOT,), dtype=torch.uint8, generator=g))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("fsync", ["never", "data"])
def test_concurrent_churn_keeps_disk_index_and_bytes_agreeing(
    tmp_path: Path, seed: int, fsync: str
) -> None:
    universe = keys_for("s", 48)
    cap = 16 * file_size(universe[0])
    fs = FileStorage(tmp_path, capacity_bytes=cap, fsync=fsync)  # type: ignore[arg-type]
    mismatches: list[str] = []

    def work(w: int) -> None:
        rng = random.Random(seed * 100 + w)
        for _ in range(40):
            op = rng.random()
            ks = rng.sample(universe, rng.randrange(1, 20))
            if op < 0.45:
                fs.put(ks, [page_of(k) for k in ks])
            elif op < 0.6:  # a chain: each page depends on the one before
                ks = sorted(ks)
                fs.put_chain(ks, [page_of(k) for k in ks], [None, *ks[:-1]])
            elif op < 0.9:
                dst = empty(len(ks))
                for k, ok, b in zip(ks, fs.get_into(ks, dst), dst, strict=True):
                    want = page_of(k)
                    n = PAYLOAD
                    if ok and bytes(b.view[:n]) != bytes(want.view[:n]):
                        mismatches.append(f"seed {seed}: {k} read other bytes")
            else:
                fs.remove(ks[:3])

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(work, range(4)))
    assert not mismatches, mismatches[:3]
    on_disk = {p.stem: p.stat().st_size for p in tmp_path.rglob("*.kv")}
    assert sorted(on_disk) == sorted(fs.lru_order()), f"seed {seed}"
    assert fs.total_bytes() == sum(on_disk.values()) <= cap, f"seed {seed}"
    assert not list(tmp_path.rglob("*.tmp")), f"seed {seed}"
    fs.check_index()
    stored = [k for k in universe if fs.exists([k]) == [True]]
    dst = empty(len(stored))
    assert fs.get_into(stored, dst) == [True] * len(stored), f"seed {seed}"
    for k, b in zip(stored, dst, strict=True):
        assert bytes(b.view[:PAYLOAD]) == bytes(page_of(k).view[:PAYLOAD]), f"seed {seed}"
    assert fs.statistics().corrupt == 0, f"seed {seed}"


@pytest.mark.parametrize("seed", SEEDS)
def test_two_instances_sharing_a_directory_never_serve_wrong_bytes(
    tmp_path: Path, seed: int
) -> None:
    """Two ``FileStorage`` instances on one directory (two processes pointed at the same
    path by mistake, or a shared filesystem): each keeps its own index, and the other
    unlinks, replaces and evicts files behind its back.  Nothing may hang (the workers are
    daemon threads joined with a bound), every read returns its key's bytes or misses, and a
    third instance opened afterwards reads every page it indexes back intact."""
    universe = keys_for("two", 40)
    cap = 12 * file_size(universe[0])
    stores = [FileStorage(tmp_path, capacity_bytes=cap) for _ in range(2)]
    mismatches: list[str] = []
    errors: list[BaseException] = []

    def work(w: int) -> None:
        fs = stores[w % 2]
        rng = random.Random(seed * 1000 + w)
        try:
            for _ in range(40):
                op = rng.random()
                ks = rng.sample(universe, rng.randrange(1, 12))
                if op < 0.5:
                    fs.put(ks, [page_of(k) for k in ks])
                elif op < 0.9:
                    dst = empty(len(ks))
                    for k, ok, b in zip(ks, fs.get_into(ks, dst), dst, strict=True):
                        n = PAYLOAD
                        if ok and bytes(b.view[:n]) != bytes(page_of(k).view[:n]):
                            mismatches.append(f"seed {seed}: {k} read other bytes")
                else:
                    fs.remove(ks[:3])
        except BaseException as exc:  # reported below: a worker must not die silently
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(w,), daemon=True) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), f"seed {seed}: a worker hung"
    assert not errors, f"seed {seed}: {errors[:3]!r}"
    assert not mismatches, mismatches[:3]
    for fs in stores:
        fs.close()
    third = FileStorage(tmp_path, capacity_bytes=cap)
    stored = [k for k in universe if third.exists([k]) == [True]]
    dst = empty(len(stored))
    assert third.get_into(stored, dst) == [True] * len(stored), f"seed {seed}"
    for k, b in zip(stored, dst, strict=True):
        assert bytes(b.view[:PAYLOAD]) == bytes(page_of(k).view[:PAYLOAD]), f"seed {seed}"
    assert not list(tmp_path.rglob("*.tmp")), f"seed {seed}"
