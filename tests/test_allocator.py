"""Page allocator and host admission."""

from __future__ import annotations

import pytest

from aiocache_kv.errors import CapacityError, HostMemoryError
from aiocache_kv.pools import PageAllocator, PageState, admit_host_bytes


def test_alloc_free_reuse_ascending() -> None:
    a = PageAllocator(8, "dev")
    x = a.alloc(3)
    assert x.tolist() == [0, 1, 2] and a.num_free == 5
    y = a.alloc(5, PageState.HELD)
    assert a.num_free == 0 and a.count(PageState.HELD) == 5
    with pytest.raises(CapacityError, match="need 1 pages, 0 free"):
        a.alloc(1)
    a.free([x[1:2], y[:2]])
    z = a.alloc(3)
    assert z.tolist() == [1, 3, 4]  # consolidated free list is sorted
    a.check_invariants([x[:1], x[2:], z])


def test_double_free_is_caught() -> None:
    a = PageAllocator(4, "dev")
    x = a.alloc(2)
    a.free([x])
    with pytest.raises(AssertionError, match="double free"):
        a.free([x])


def test_invariants_catch_a_leak() -> None:
    a = PageAllocator(4, "dev")
    a.alloc(2)
    with pytest.raises(AssertionError, match="OWNED pages but 0 referenced"):
        a.check_invariants([])


def test_admission_names_the_sizes() -> None:
    admit_host_bytes(10, reserve=5, available=20)
    with pytest.raises(HostMemoryError, match=r"need 30 bytes .* only 20 bytes .* 5 bytes"):
        admit_host_bytes(30, reserve=5, available=20)
