"""``ExtentAllocator``: variable-size byte ranges ("extents") of one host pool.

Best fit over a free list kept sorted by offset, with coalescing of neighbours on free, so
``free`` followed by ``alloc`` of the same size always succeeds and the pool never fragments
into adjacent free pieces.  Offsets and sizes are multiples of ``alignment`` (64 bytes by
default: a cache line, and enough for every torch dtype viewed at an extent's start).

Loop-owned and synchronous: no locks.  Costs are O(number of free extents) for ``alloc`` (a
scan for the best fit) and O(log n) + a list insert for ``free``; the embedding cache holds at
most a few thousand entries, far below where a size-indexed structure would pay off.
"""

from __future__ import annotations

import bisect

from aiocache_kv.errors import InvalidInputError

__all__ = ["ExtentAllocator"]


class ExtentAllocator:
    """Best-fit allocator of aligned extents inside ``[0, capacity)``."""

    def __init__(self, capacity: int, alignment: int = 64) -> None:
        """Raises:
        InvalidInputError: ``alignment`` is not a positive power of two, or ``capacity`` is
            negative.
        """
        if alignment < 1 or alignment & (alignment - 1):
            raise InvalidInputError(f"alignment must be a power of two, got {alignment}")
        if capacity < 0:
            raise InvalidInputError(f"capacity must be >= 0, got {capacity}")
        self.alignment = alignment
        self.capacity = capacity - capacity % alignment
        self._starts: list[int] = [0] if self.capacity else []  # free extents, sorted
        self._free: dict[int, int] = {0: self.capacity} if self.capacity else {}
        self._used: dict[int, int] = {}  # offset -> aligned size
        self.free_bytes = self.capacity

    def __repr__(self) -> str:
        return (
            f"ExtentAllocator(capacity={self.capacity}, used={self.used_bytes}, "
            f"free_extents={len(self._starts)}, largest_free={self.largest_free()})"
        )

    @property
    def used_bytes(self) -> int:
        """Bytes handed out (aligned sizes)."""
        return self.capacity - self.free_bytes

    def aligned(self, nbytes: int) -> int:
        """``nbytes`` rounded up to the alignment."""
        a = self.alignment
        return (nbytes + a - 1) // a * a

    def largest_free(self) -> int:
        """Size of the largest free extent (0 if none)."""
        return max(self._free.values(), default=0)

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a new extent of at least ``nbytes`` bytes, or ``None`` if none fits.

        Raises:
            InvalidInputError: ``nbytes`` is not positive.
        """
        if nbytes <= 0:
            raise InvalidInputError(f"alloc needs nbytes > 0, got {nbytes}")
        size = self.aligned(nbytes)
        if size > self.free_bytes:
            return None
        best = -1
        best_size = 0
        for start in self._starts:
            avail = self._free[start]
            if avail >= size and (best < 0 or avail < best_size):
                best, best_size = start, avail
                if avail == size:
                    break
        if best < 0:
            return None
        del self._free[best]
        i = bisect.bisect_left(self._starts, best)
        if best_size == size:
            del self._starts[i]
        else:
            self._starts[i] = best + size  # the remainder keeps its place in the order
            self._free[best + size] = best_size - size
        self._used[best] = size
        self.free_bytes -= size
        return best

    def free(self, offset: int) -> None:
        """Return the extent at ``offset``, merging it with free neighbours.

        Raises:
            InvalidInputError: ``offset`` is not the start of an allocated extent (double free).
        """
        size = self._used.pop(offset, None)
        if size is None:
            raise InvalidInputError(f"free of offset {offset}: not an allocated extent")
        self.free_bytes += size
        i = bisect.bisect_left(self._starts, offset)
        start, end = offset, offset + size
        if i < len(self._starts) and self._starts[i] == end:  # merge the right neighbour
            end += self._free.pop(end)
            del self._starts[i]
        if i > 0:
            left = self._starts[i - 1]
            if left + self._free[left] == start:  # merge into the left neighbour
                self._free[left] = end - left
                return
        self._starts.insert(i, start)
        self._free[start] = end - start

    def size_of(self, offset: int) -> int:
        """Aligned size of the allocated extent at ``offset`` (``KeyError`` if none)."""
        return self._used[offset]

    def used_offsets(self) -> set[int]:
        """Offsets of every allocated extent (for invariant checks)."""
        return set(self._used)

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the free/used lists are inconsistent."""
        assert self._starts == sorted(self._free), "free list out of order or out of sync"
        pieces = sorted([*self._free.items(), *self._used.items()])
        pos = 0
        for start, size in pieces:
            assert start == pos, f"gap or overlap at {pos}: next extent starts at {start}"
            assert size > 0 and size % self.alignment == 0, f"bad extent size {size} at {start}"
            pos += size
        assert pos == self.capacity, f"extents cover {pos} of {self.capacity} bytes"
        for a, b in zip(self._starts, self._starts[1:], strict=False):
            assert a + self._free[a] < b, f"adjacent free extents at {a} and {b} not merged"
        assert self.free_bytes == sum(self._free.values()), "free_bytes out of sync"
