"""``MemoryStorage``: the in-memory fake backend behaves like a real one, faults on demand."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from aiocache_kv.errors import StorageKeyError, StorageUnavailableError
from aiocache_kv.storage import integrity
from aiocache_kv.storage.base import PageBuffer, StorageBackend
from aiocache_kv.testing import MemoryStorage

SLOT = 64 + integrity.FRAME_OVERHEAD


def page(fill: int) -> PageBuffer:
    buf = PageBuffer.allocate(SLOT)
    buf.tensor[: SLOT - integrity.FRAME_OVERHEAD] = fill
    return buf


def test_round_trip_seals_and_verifies() -> None:
    s = MemoryStorage()
    assert isinstance(s, StorageBackend)
    assert s.put(["a/0000000000000001/kv", "a/0000000000000002/kv"], [page(1), page(2)]) == [
        True,
        True,
    ]
    raw = s.contents()["a/0000000000000001/kv"]
    assert len(raw) == SLOT and raw[:64] == bytes([1]) * 64
    assert s.payload("a/0000000000000002/kv") == bytes([2]) * 64
    out = [PageBuffer.allocate(SLOT), PageBuffer.allocate(SLOT), PageBuffer.allocate(SLOT)]
    keys = ["a/0000000000000001/kv", "a/0000000000000002/kv", "a/0000000000000003/kv"]
    assert s.get_into(keys, out) == [True, True, False]
    assert bytes(out[1].view[:64]) == bytes([2]) * 64
    assert s.exists(keys) == [True, True, False] and s.leading_hits(keys) == 2
    assert s.put(keys[:1], [page(9)]) == [True]  # present: skipped, not rewritten
    assert s.payload(keys[0]) == bytes([1]) * 64
    st = s.statistics()
    assert (st.put_ok, st.put_skipped, st.hits, st.misses) == (2, 1, 2, 1)
    assert s.remove(keys) == [True, True, False]
    with pytest.raises(StorageKeyError):
        s.exists([""])


def test_corrupt_page_is_a_miss_and_dropped() -> None:
    s = MemoryStorage()
    key = "a/0000000000000001/kv"
    s.put([key], [page(1)])
    s.corrupt_key(key)
    assert s.get_into([key], [PageBuffer.allocate(SLOT)]) == [False]
    assert key not in s.contents() and key in s.dropped
    assert s.statistics().corrupt == 1
    # a page stored under another key's name is rejected too (the trailer binds the key)
    s.put([key], [page(1)])
    other = "a/0000000000000002/kv"
    with s._lock:
        s._data[other] = s._data[key]
    assert s.get_into([other], [PageBuffer.allocate(SLOT)]) == [False]


def test_injected_faults_are_seeded_per_key() -> None:
    keys = [f"a/{i:016x}/kv" for i in range(1, 200)]
    s = MemoryStorage(7, put_failure=0.5)
    ok = s.put(keys, [page(1) for _ in keys])
    assert 0 < sum(ok) < len(keys)
    assert s.exists(keys) == ok
    again = MemoryStorage(7, put_failure=0.5).put(keys, [page(1) for _ in keys])
    assert again == ok  # one thread: the same seed gives the same faults
    s.quiet()
    s.fail_get_keys.add(keys[0])
    assert s.put(keys, [page(1) for _ in keys]) == [True] * len(keys)
    assert s.get_into(keys[:2], [PageBuffer.allocate(SLOT) for _ in range(2)]) == [False, True]
    s.set_faults(vanish=1.0)
    before = len(s.contents())
    s.exists(keys[:1])
    assert len(s.contents()) == before - 1 and len(s.dropped) == 1
    with pytest.raises(TypeError):
        s.set_faults(nonsense=1.0)


def test_put_reads_the_buffer_after_its_delay() -> None:
    """A late worker stores what the slot holds when it starts, not when it was called."""
    s = MemoryStorage()
    s.gates["put"].clear()
    buf = page(1)
    key = "a/0000000000000001/kv"
    worker = threading.Thread(target=s.put, args=([key], [buf]))
    worker.start()
    time.sleep(0.05)
    buf.tensor[:64] = 5  # the slot is reused while the call waits
    s.gates["put"].set()
    worker.join()
    assert s.payload(key) == bytes([5]) * 64


def test_stalls_and_close_keep_data() -> None:
    s = MemoryStorage(1, stall_probability=1.0, stall_seconds=0.05)
    t = time.monotonic()
    s.put(["a/0000000000000001/kv"], [page(3)])
    assert time.monotonic() - t >= 0.05
    s.close()
    with pytest.raises(StorageUnavailableError):
        s.exists(["a/0000000000000001/kv"])
    s.open()
    s.quiet()
    assert s.exists(["a/0000000000000001/kv"]) == [True]
    assert torch.equal(
        torch.frombuffer(bytearray(s.payload("a/0000000000000001/kv") or b""), dtype=torch.uint8),
        torch.full((64,), 3, dtype=torch.uint8),
    )
