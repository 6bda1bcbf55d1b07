"""Page allocator and host admission."""

from __future__ import annotations

import pytest
import torch

import aiocache_kv as akv
from aiocache_kv.errors import CapacityError, HostMemoryError, InvalidInputError
from aiocache_kv.pools import PageAllocator, PageState, admit_host_bytes
from tests.conftest import small_config


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


def test_alloc_hands_out_views_no_later_alloc_touches() -> None:
    """``alloc`` returns a view of the free list (no copy): the part before the cursor is
    never written again, so a caller writing to its tensor changes no one else's pages."""
    a = PageAllocator(8, "dev")
    x = a.alloc(3, PageState.HELD)
    x[:] = torch.tensor([7, 7, 7])  # the caller's own business
    y = a.alloc(2, PageState.HELD)
    assert y.tolist() == [3, 4] and a.num_free == 3
    assert a.handed_slots(x[:2]) is None  # a slice is another tensor: converted as usual
    assert a.handed_slots(torch.tensor([3, 4])) is None
    got = a.handed_slots(x)
    assert got is not None and got.tolist() == [7, 7, 7]
    assert a.handed_slots(x) is None  # read once: the table forgot it
    z = a.alloc(1, PageState.HELD)
    z.set_(torch.tensor([5]))  # new memory: the remembered array no longer backs it
    assert a.handed_slots(z) is None
    assert a.handed_slots(a.alloc(1)) is None  # only the caller's (HELD) allocations


def test_the_table_keeps_no_tensor_alive_past_its_insert() -> None:
    """An allocation's tensor is referenced by the allocator only until an insert reads it:
    a caller that dropped it after the insert frees its memory (up to 256 tensors, large
    ones included, were kept until the table filled up)."""
    import gc
    import weakref

    a = PageAllocator(64, "dev")
    x = a.alloc(8, PageState.HELD)
    ref = weakref.ref(x)
    assert a.handed_slots(x) is not None
    del x
    gc.collect()
    assert ref() is None, "the allocator still holds a tensor its insert has read"
    y = a.alloc(8, PageState.HELD)  # not read yet: remembered (the fast path needs it)
    ref = weakref.ref(y)
    del y
    gc.collect()
    assert ref() is not None


async def test_a_freed_allocation_is_not_kept_alive() -> None:
    """``HiCache.free`` gives the pages back and the allocator lets the tensor go (an
    aborted request's rows were referenced until 256 more allocations came)."""
    import gc
    import weakref

    async with akv.HiCache(small_config(page_size=2, host_pages=0)) as cache:
        own = cache.alloc(6)
        ref = weakref.ref(own)
        cache.free(own)
        del own
        gc.collect()
        assert ref() is None, "the allocator still holds a tensor the caller freed"
        cache.check_invariants()


async def test_insert_rechecks_slots_written_after_alloc() -> None:
    """The insert reads an allocation's array directly, but still checks its values: a
    repeated or foreign page written into the tensor is refused with nothing changed, and a
    tensor moved to new memory (``set_``) is read the general way."""
    async with akv.HiCache(small_config(page_size=1, host_pages=0)) as cache:
        own = cache.alloc(4)
        before = cache.statistics().device
        bad = own.clone()
        own[1] = own[0]
        with pytest.raises(InvalidInputError, match="repeat page"):
            cache.insert([1, 2, 3, 4], own)
        own[1] = 15  # a page the caller does not hold
        with pytest.raises(InvalidInputError, match="does not hold"):
            cache.insert([1, 2, 3, 4], own)
        assert cache.statistics().device == before
        own.set_(bad.clone())  # new memory: converted the general way, then checked
        r = cache.insert([1, 2, 3, 4], own)
        assert r.inserted_len == 4 and r.device_pages.tolist() == bad.tolist()
        cache.release(r)
        cache.check_invariants()
