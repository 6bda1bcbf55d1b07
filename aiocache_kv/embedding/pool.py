"""``EntryPool``: the embedding cache's host pool, its table of entries and their LRU.

One host tensor of ``pool_bytes`` (pinned when CUDA is present) split into 64-byte aligned
extents by an :class:`~aiocache_kv.embedding.allocator.ExtentAllocator`; an entry occupies one
extent: ``[header 64 B | data | integrity trailer 40 B]`` (:mod:`~aiocache_kv.embedding.layout`).
The table maps hash -> :class:`~aiocache_kv.embedding.entries.Entry`; the LRU holds exactly the
evictable entries (``READY``, no push reading them), next victim first, and
``evictable_bytes`` their extents' sizes.

Loop-owned and synchronous: the cache's facade and its store paths
(:mod:`~aiocache_kv.embedding.transfers`) call it on the event-loop thread only; workers only
touch the bytes of the slots (:class:`~aiocache_kv.storage.base.PageBuffer`) they were handed.
"""

from __future__ import annotations

import collections

import torch

from aiocache_kv.embedding.allocator import ExtentAllocator
from aiocache_kv.embedding.entries import Entry, EntryState
from aiocache_kv.embedding.keys import embedding_key
from aiocache_kv.embedding.layout import HEADER_BYTES, EntryShape, pack_header
from aiocache_kv.storage.base import PageBuffer
from aiocache_kv.storage.integrity import FRAME_OVERHEAD

__all__ = ["ALIGNMENT", "EntryPool"]

ALIGNMENT = 64


class EntryPool:
    """The pool's memory, extents, entry table and LRU (see the module docstring).

    Built empty (no memory: safe on the loop); :meth:`install` hands it the pool tensor once
    it is allocated.  ``counters`` is the cache's counter dict: the pool counts evictions.
    """

    def __init__(self, counters: dict[str, int]) -> None:
        self.memory = torch.empty(0, dtype=torch.uint8)
        self.alloc = ExtentAllocator(0, ALIGNMENT)
        self.entries: dict[bytes, Entry] = {}
        self.lru: collections.OrderedDict[bytes, Entry] = collections.OrderedDict()
        self.evictable_bytes = 0
        self.counters = counters

    def install(self, memory: torch.Tensor) -> None:
        """Use ``memory`` (a 1-D uint8 tensor) as the pool, every byte free."""
        self.memory = memory
        self.alloc = ExtentAllocator(memory.numel(), ALIGNMENT)

    # ------------------------------------------------------------------ slots

    def slot(self, offset: int, nbytes: int) -> PageBuffer:
        """The ``nbytes`` of the pool at ``offset``, as a buffer a worker can fill or send."""
        return PageBuffer.from_tensor(self.memory[offset : offset + nbytes])

    def data(self, e: Entry) -> torch.Tensor:
        """The ``num_tokens x dim`` view of ``e``'s data, in its slot (no copy)."""
        assert e.offset is not None and e.shape is not None
        start = e.offset + HEADER_BYTES
        raw = self.memory[start : start + e.shape.data_nbytes]
        return raw.view(e.shape.dtype).view(e.shape.num_tokens, e.shape.dim)

    def read(self, e: Entry) -> torch.Tensor:
        """A copy of the embedding of ``READY`` entry ``e``."""
        assert e.state is EntryState.READY, f"read of {e!r}"
        return self.data(e).clone()

    def plausible(self, size: int) -> bool:
        """Whether a stored object of ``size`` bytes could be an entry that fits the pool."""
        return HEADER_BYTES + FRAME_OVERHEAD < size <= self.alloc.capacity

    def reserve(self, nbytes: int) -> int | None:
        """An extent of ``nbytes``, evicting LRU entries as needed; ``None`` if impossible."""
        size = self.alloc.aligned(nbytes)
        if size > self.alloc.capacity or size > self.alloc.free_bytes + self.evictable_bytes:
            return None
        while (offset := self.alloc.alloc(nbytes)) is None:
            if not self.lru:
                return None
            _, victim = self.lru.popitem(last=False)
            self.evict_popped(victim)
        return offset

    def add_ready(
        self, h: bytes, namespace: str, shape: EntryShape, t: torch.Tensor
    ) -> Entry | None:
        """Table a new ``READY`` entry holding a copy of ``t``, pinned by one push (never in
        the LRU yet); ``None`` if no extent can be had even after eviction."""
        offset = self.reserve(shape.slot_nbytes)
        if offset is None:
            return None
        e = Entry(h, embedding_key(namespace, h, shape.dtype), EntryState.READY)
        e.shape = shape
        e.offset = offset
        e.buffer = self.slot(offset, shape.slot_nbytes)
        e.buffer.view[:HEADER_BYTES] = pack_header(shape)
        try:
            self.data(e).copy_(t.detach())
        except BaseException:
            self.alloc.free(offset)  # nothing of the entry is left behind
            raise
        self.entries[h] = e
        e.pushes = 1  # born pinned by this batch (READY, never in the LRU yet)
        return e

    # ------------------------------------------------------------------ eviction and removal

    def evict(self, nbytes: int | None) -> int:
        """Evict LRU entries until at least ``nbytes`` were freed (all when ``None``)."""
        freed = 0
        while self.lru and (nbytes is None or freed < nbytes):
            _, victim = self.lru.popitem(last=False)
            freed += self.evict_popped(victim)
        return freed

    def evict_popped(self, victim: Entry) -> int:
        """Drop ``victim``, just popped from the LRU; returns the bytes freed."""
        assert victim.offset is not None and victim.evictable, f"evicting {victim!r}"
        freed = self.alloc.size_of(victim.offset)
        self.evictable_bytes -= freed
        self.counters["evictions"] += 1
        self.counters["evicted_bytes"] += freed
        self.drop(victim)
        return freed

    def drop(self, e: Entry) -> None:
        """Remove ``e`` from the table and the LRU and free its extent (-> GONE)."""
        if e.hash in self.lru:
            self.lru_remove(e)
        if self.entries.get(e.hash) is e:
            del self.entries[e.hash]
        if e.offset is not None:
            self.alloc.free(e.offset)
            e.offset = None
            e.buffer = None
        e.transition(EntryState.GONE)

    # ------------------------------------------------------------------ LRU and pins

    def lru_add(self, e: Entry) -> None:
        """File evictable ``e`` as most recently used."""
        assert e.evictable and e.offset is not None, f"LRU add of {e!r}"
        self.lru[e.hash] = e
        self.evictable_bytes += self.alloc.size_of(e.offset)

    def lru_remove(self, e: Entry) -> None:
        assert e.offset is not None
        del self.lru[e.hash]
        self.evictable_bytes -= self.alloc.size_of(e.offset)

    def touch(self, e: Entry) -> None:
        """Mark ``e`` most recently used (if it is evictable)."""
        if e.hash in self.lru:
            self.lru.move_to_end(e.hash)

    def pin(self, e: Entry) -> None:
        """One more push reads ``e``'s slot: not evictable until :meth:`unpin`."""
        if e.hash in self.lru:
            self.lru_remove(e)
        e.pin_push()

    def unpin(self, e: Entry) -> None:
        """A push is done with ``e``'s slot; evictable again (most recently used) if none is."""
        e.unpin_push()
        if e.evictable and self.entries.get(e.hash) is e:
            self.lru_add(e)  # most recently used

    # ------------------------------------------------------------------ invariants

    def check_invariants(self, namespace: str, dtype: torch.dtype) -> None:
        """Recompute every derived quantity and raise ``AssertionError`` on any inconsistency."""
        self.alloc.check_invariants()
        base = int(self.memory.data_ptr()) if self.memory.numel() else 0
        extents: set[int] = set()
        for h, e in self.entries.items():
            assert e.hash == h, f"{e!r} filed under another hash"
            assert e.key == embedding_key(namespace, h, dtype), f"{e!r} has a wrong key"
            assert e.state is not EntryState.GONE, f"{e!r} is GONE but still tabled"
            assert e.pushes >= 0, f"{e!r} has negative pushes"
            if e.state is EntryState.LOOKUP:
                assert e.offset is None and e.buffer is None, f"{e!r}: LOOKUP with a slot"
                continue
            assert e.offset is not None and e.buffer is not None, f"{e!r}: no slot"
            assert e.buffer.ptr == base + e.offset, f"{e!r}: buffer not at its offset"
            assert e.buffer.nbytes <= self.alloc.size_of(e.offset), f"{e!r}: slot overflows"
            assert e.offset not in extents, f"{e!r}: extent shared"
            extents.add(e.offset)
            if e.state is EntryState.READY:
                assert e.shape is not None and e.buffer.nbytes == e.shape.slot_nbytes, (
                    f"{e!r}: slot size differs from its shape"
                )
            else:
                assert e.pushes == 0, f"{e!r}: pushed while {e.state.name}"
            assert (h in self.lru) == e.evictable, f"{e!r}: LRU membership wrong"
        used = self.alloc.used_offsets()
        assert extents == used, f"pool extents {sorted(used - extents)} belong to no entry"
        assert all(self.entries.get(h) is e for h, e in self.lru.items()), "stale LRU entry"
        evictable = sum(self.alloc.size_of(e.offset or 0) for e in self.lru.values())
        assert evictable == self.evictable_bytes, (
            f"evictable bytes {self.evictable_bytes} != recomputed {evictable}"
        )
