"""Page allocator: a free list of page ids plus an ownership state per page.

Every page is FREE, HELD (handed to the caller by ``cache.alloc`` and not yet inserted),
OWNED (belongs to the tree or to a transfer in flight), QUARANTINED or RETAINED.  The states let
the cache reject a double free or an insert of pages it never handed out, with a few vectorized
operations per call.

Retained rows.  An insert does not free the caller's rows that the tree does not take (its own
copies of pages the tree already holds, the pages after a node still loading back): the
insert's result keeps a *reference* on each (``retain``) until it is released (``unretain``),
so a request still attending over its rows never reads a page handed to someone else.  A page
with references is never FREE: not taken by the tree it is RETAINED, and a tree page that is
freed while referenced (a later insert handed a retained row to the tree) becomes RETAINED
too.  It returns to the free list when its last reference ends.

Leases (the buffer-lease rule, docs/ARCHITECTURE.md).  A page handed to a worker thread (a
storage call reading or writing its bytes) is *leased* for as long as the worker holds it:
``lease`` before the hand-off, ``unlease`` when the worker reports it is done (on the loop).
Freeing a leased page does not make it allocatable: it becomes QUARANTINED and returns to the
free list only when its last lease ends.  So whatever the loop decides meanwhile (a deadline
passed, the caller was cancelled, the node was evicted, the cache closes), no page a worker
still touches is ever reused, and a late worker sees (or writes) bytes nobody else owns.

The states live in numpy arrays (shared zero-copy with the torch page tensors): numpy's
per-call overhead on small index arrays is a fraction of torch's, and these checks run on
every insert.  Allocation hands out ascending ids from a sorted free list so that neighbouring
pages tend to be contiguous, which lets copies coalesce into few large ``copy_`` calls.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

import numpy as np
import torch

from aiocache_kv import fastcheck
from aiocache_kv.errors import CapacityError, InvalidInputError


class PageState(enum.IntEnum):
    """Ownership of one page."""

    FREE = 0
    HELD = 1  #: handed to the caller by ``alloc``; the caller inserts or frees it
    OWNED = 2  #: referenced by the tree or by a transfer in flight
    QUARANTINED = 3  #: freed while a worker still holds it; free again when its lease ends
    #: a caller's row kept by insert results (references), not the tree's; free at the last
    RETAINED = 4


def _int64(arr: np.ndarray) -> np.ndarray:
    if arr.dtype == np.int64 and arr.flags.c_contiguous:
        return arr
    return np.ascontiguousarray(arr, dtype=np.int64)


#: page ids as the tree and callers pass them: device pages are int64 arrays (the per-request
#: path never crosses to torch), host pages tensors; both share memory when converted
PageIds = torch.Tensor | np.ndarray


def as_ids(pages: PageIds) -> np.ndarray:
    """The int64 array of ``pages`` (a tensor's own memory, no copy)."""
    return pages.numpy() if isinstance(pages, torch.Tensor) else pages


def has_duplicates(pages: PageIds) -> bool:
    """Whether any page id occurs twice (sort-based; for checks off the hot path)."""
    ids = as_ids(pages)
    if ids.size < 2:
        return False
    s = np.sort(ids)
    return bool((s[1:] == s[:-1]).any())


_FREE, _HELD, _OWNED = int(PageState.FREE), int(PageState.HELD), int(PageState.OWNED)
#: allocations :meth:`PageAllocator.handed_slots` remembers until their insert reads them
#: (past that many, it starts over: callers that free or drop what they allocated)
_HANDED_MAX = 256
_UNIT_STRIDE = (1,)  # a 1-D tensor whose elements are adjacent
_QUARANTINED, _RETAINED = int(PageState.QUARANTINED), int(PageState.RETAINED)


class PageAllocator:
    """Free list of ``num_pages`` page ids of one pool."""

    def __init__(self, num_pages: int, name: str) -> None:
        if num_pages < 1:
            raise InvalidInputError(f"{name} pool needs at least one page, got {num_pages}")
        self.name = name
        self.num_pages = num_pages
        self._state = np.zeros(num_pages, dtype=np.uint8)
        self._stamp = np.zeros(num_pages, dtype=np.int64)  # scratch for duplicate checks
        self._epoch = 0  # the last mark written to _stamp; counts down (never a position)
        self._ids = np.empty(num_pages, dtype=np.int64)  # see ``scratch``
        self._leases = np.zeros(num_pages, dtype=np.int32)  # workers holding each page
        self._refs = np.zeros(num_pages, dtype=np.int32)  # insert results retaining each page
        # touch every page of the per-page arrays now: zeros/empty of a large array maps them
        # lazily, and the first request to reach each 4 KiB of them would take the fault
        for arr in (self._state, self._stamp, self._ids, self._leases, self._refs):
            arr.fill(0)
        self.quarantined = 0  #: pages freed while leased, waiting for their workers
        self.retained = 0  #: RETAINED pages: callers' rows kept by insert results
        self.referenced = 0  #: pages with references (RETAINED, or taken by the tree since)
        #: called (on the loop) whenever pages return to the free list
        self.on_free: Callable[[], None] | None = None
        # numpy, not torch: slicing it costs a tenth, and alloc runs on every request
        self._free = np.arange(num_pages, dtype=np.int64)
        self._cursor = 0
        self._returned: list[np.ndarray] = []
        #: pages currently free (kept, not computed: every request reads it)
        self.num_free = num_pages
        #: ``id(tensor) -> (tensor, its array, data pointer)`` of recent HELD allocations
        self._handed: dict[int, tuple[torch.Tensor, np.ndarray, int]] = {}

    def _consolidate(self) -> None:
        parts = [self._free[self._cursor :], *self._returned]
        self._free = np.sort(np.concatenate(parts))
        self._cursor = 0
        self._returned = []

    def alloc(
        self, n: int, state: PageState = PageState.OWNED, *, slots_of: int = 0
    ) -> torch.Tensor:
        """Take ``n`` free pages and mark them ``state``; returns their ids, or with
        ``slots_of=p`` (> 1) their token slots ``page * p + 0..p-1`` (one conversion less on
        the per-request path).

        Raises:
            CapacityError: fewer than ``n`` pages are free (nothing is taken).
        """
        cursor = self._cursor
        if self._free.size - cursor < n:
            if n > self.num_free:
                raise CapacityError(f"{self.name} pool: need {n} pages, {self.num_free} free")
            self._consolidate()
            cursor = 0
        # the free list before the cursor is never written again (``_consolidate`` builds a
        # new array), so the ids are handed out as a view: no copy, one tensor made
        taken = self._free[cursor : cursor + n]
        self._cursor = cursor + n
        self.num_free -= n
        first = taken.item(0) if n else 0
        # the free list is sorted (``_consolidate`` sorts it), so n distinct ids spanning
        # n values are one contiguous run: a slice fill instead of a gather (``fill``: half
        # the cost of a slice assignment)
        if n and taken.item(-1) - first == n - 1:
            self._state[first : first + n].fill(state)
        else:
            self._state[taken] = state
        if slots_of > 1:
            arr = np.empty(n * slots_of, dtype=np.int64)
            fastcheck.page_slots_into(taken, slots_of, arr)
        else:
            arr = taken
        out = torch.from_numpy(arr)
        if state == _HELD:  # the caller's: its insert reads the array back, not the tensor
            handed = self._handed
            if len(handed) >= _HANDED_MAX:
                handed.clear()
            handed[id(out)] = (out, arr, out.data_ptr())
        return out

    def handed_slots(self, slots: object) -> np.ndarray | None:
        """The int64 array behind ``slots`` if it is a tensor :meth:`alloc` handed out
        (``HELD``) and still on the memory and in the shape it was given (no conversion, no
        checks of dtype or shape needed), else ``None``: the caller converts it the general
        way.  Its values are still to be checked (the caller may have written to it).  A
        tensor restrided or reshaped in place (``as_strided_``, ``unsqueeze_``) keeps its
        data pointer, so its strides are compared too: ``(1,)``, one dimension, every element
        next to the last (shrunk in place by ``resize_``, its elements lead the array).

        The table forgets ``slots`` here (an insert reads it once; another insert of the same
        tensor converts it the general way): it keeps no caller's tensor alive past its
        insert, and a full table (:data:`_HANDED_MAX`, callers that free or drop what they
        allocated) is the rare case."""
        entry = self._handed.pop(id(slots), None)
        if entry is None or entry[0] is not slots or entry[2] != entry[0].data_ptr():
            return None
        return entry[1] if entry[0].stride() == _UNIT_STRIDE else None

    def forget(self, slots: object) -> None:
        """``slots`` (a tensor :meth:`alloc` handed out, or anything) was given back without
        an insert: the table of handed-out allocations lets it go (no insert will read it)."""
        self._handed.pop(id(slots), None)

    def free(self, pages: Sequence[PageIds]) -> None:
        """Return pages (OWNED or HELD) to the free list; leased ones to quarantine, retained
        ones (an insert result still refers to them) to RETAINED."""
        parts = [a for a in map(as_ids, pages) if a.size]
        if not parts:
            return
        idx = parts[0] if len(parts) == 1 else np.concatenate(parts)
        state = self._state[idx]
        assert bool(((state == _OWNED) | (state == _HELD)).all()), f"{self.name}: double free"
        if self.referenced:
            kept = self._refs[idx] > 0
            if kept.any():
                self._state[idx[kept]] = _RETAINED
                self.retained += int(np.count_nonzero(kept))
                idx = idx[~kept]
        leased = self._leases[idx] > 0
        if leased.any():
            self._state[idx[leased]] = _QUARANTINED
            self.quarantined += int(np.count_nonzero(leased))
            idx = idx[~leased]
        self._release(idx)

    def _release(self, idx: np.ndarray) -> None:
        if idx.size:
            self._state[idx] = _FREE
            self._returned.append(idx)
            self.num_free += idx.size
            if self.on_free is not None:
                self.on_free()

    def retain(self, ids: np.ndarray) -> None:
        """One more reference on each of ``ids`` (distinct int64 ids: HELD, RETAINED, or
        OWNED by the tree after an earlier insert took a retained row): HELD ones become
        RETAINED.  Nothing reuses a referenced page until :meth:`unretain`."""
        if not ids.size:
            return
        held = self._state[ids] == _HELD
        if held.any():
            self._state[ids[held]] = _RETAINED
            self.retained += int(np.count_nonzero(held))
        self.referenced += int(np.count_nonzero(self._refs[ids] == 0))
        self._refs[ids] += 1

    def unretain(self, ids: np.ndarray) -> None:
        """Drop one reference from each of ``ids`` (as given to :meth:`retain`): RETAINED
        pages whose last reference ended are freed (quarantined while leased)."""
        if not ids.size:
            return
        refs = self._refs
        refs[ids] -= 1
        assert bool((refs[ids] >= 0).all()), f"{self.name}: unretain without retain"
        done = ids[refs[ids] == 0]
        self.referenced -= int(done.size)
        done = done[self._state[done] == _RETAINED]
        if done.size:
            self._state[done] = _HELD  # then freed as the caller's own
            self.retained -= int(done.size)
            self.free([done])

    def lease(self, pages: PageIds) -> None:
        """A worker starts using ``pages`` (repeats allowed): they cannot be reused until
        the matching :meth:`unlease`."""
        idx = as_ids(pages)
        assert bool((self._state[idx] != _FREE).all()), f"{self.name}: lease of a free page"
        if self.repeat_at(idx) < 0:
            self._leases[idx] += 1  # distinct ids (the usual case): no slow ufunc.at
        else:
            np.add.at(self._leases, idx, 1)

    def unlease(self, pages: PageIds) -> None:
        """The worker is done with ``pages`` (the same tensor given to :meth:`lease`);
        quarantined pages whose last lease ended become free."""
        idx = as_ids(pages)
        if self.repeat_at(idx) < 0:
            self._leases[idx] -= 1
        else:
            np.subtract.at(self._leases, idx, 1)
        assert bool((self._leases[idx] >= 0).all()), f"{self.name}: unlease without lease"
        if not self.quarantined:
            return  # nothing waits for a lease to end
        done = np.unique(idx[(self._leases[idx] == 0) & (self._state[idx] == _QUARANTINED)])
        if done.size:
            self.quarantined -= int(done.size)
            self._release(done)

    @property
    def leased(self) -> int:
        """Pages some worker holds now (in use or quarantined)."""
        return int(np.count_nonzero(self._leases))

    def take(self, ids: np.ndarray) -> None:
        """Held (or retained) pages (int64 ids) become the tree's (-> OWNED on insert)."""
        if self.retained:
            self.retained -= int(np.count_nonzero(self._state[ids] == _RETAINED))
        fastcheck.set_states(self._state, ids, _OWNED)  # one C pass, not numpy's gather

    def recheck_insert(self, ids: np.ndarray, existing: np.ndarray) -> tuple[int, int, int]:
        """:meth:`check_insert`'s ownership verdict when retained rows may be among ``ids``
        (the ids it computed, in range and distinct): each page must be ``existing[i]`` (the
        tree's own), HELD or RETAINED.  ``(code, index, differing)`` as there."""
        d = min(existing.size, ids.size)
        same = np.zeros(ids.size, dtype=bool)
        same[:d] = ids[:d] == _int64(existing)[:d]
        state = self._state[ids]
        bad = ~same & (state != _HELD) & (state != _RETAINED)
        differing = d - int(np.count_nonzero(same))
        if bad.any():
            return fastcheck.INSERT_NOT_HELD, int(bad.argmax()), differing
        return fastcheck.SLOTS_OK, -1, differing

    def check(self, pages: PageIds, state: PageState) -> bool:
        """Whether every page in ``pages`` is in ``state``."""
        return bool((self._state[as_ids(pages)] == int(state)).all())

    def distinct(self, pages: PageIds) -> bool:
        """Whether ``pages`` has no repeated id, in O(n) (a scratch array, no sort)."""
        return self.repeat_at(pages) < 0

    def repeat_at(self, pages: PageIds) -> int:
        """-1 if ``pages`` (ids of this pool) are distinct, else the index of a repeated id."""
        idx = as_ids(pages)
        if idx.size < 2:
            return -1
        self._epoch -= 1
        return int(fastcheck.first_repeat(_int64(idx), self._stamp, self._epoch))

    def scratch(self, n: int) -> np.ndarray:
        """An int64 array of ``n`` entries to fill and read before the next call (reused,
        never kept by anyone; a fresh one if ``n`` exceeds the pool)."""
        if n > self._ids.size:
            return np.empty(n, dtype=np.int64)
        return self._ids[:n]

    def check_insert(
        self, slots: np.ndarray, page_size: int, existing: np.ndarray
    ) -> tuple[int, int, int, np.ndarray]:
        """The page ids of an insert's token ``slots`` (int64, C-contiguous) and every check
        of them at once: ``(code, index, differing, ids)``.  ``ids`` is scratch (read it
        before the next call); codes are :func:`fastcheck.insert_pages`'s: whole pages in
        range, distinct, each ``existing[i]`` (the tree's own) or HELD by the caller."""
        n = slots.size // page_size
        ids = self._ids[:n] if n <= self._ids.size else self.scratch(n)  # (scratch, inline)
        self._epoch -= 1
        code, index, differing = fastcheck.insert_pages(
            slots,
            page_size,
            self.num_pages * page_size,
            ids,
            existing if not existing.size else _int64(existing),  # (none: the common case)
            self._state,
            _HELD,
            self._stamp,
            self._epoch,
        )
        return code, index, differing, ids

    def count(self, state: PageState) -> int:
        """Pages in ``state``."""
        return int(np.count_nonzero(self._state == state))

    def check_invariants(
        self, owned: Sequence[PageIds], retained: list[np.ndarray] | None = None
    ) -> None:
        """``owned`` (every page the tree and transfers hold) must be exactly the OWNED pages,
        and ``retained`` (one id array per live insert result) exactly the references."""
        free = torch.from_numpy(np.concatenate([self._free[self._cursor :], *self._returned]))
        assert (
            free.numel()
            == self.num_free
            == self._free.size - self._cursor + sum(r.size for r in self._returned)
        ), f"{self.name}: free count drifted"
        assert not has_duplicates(free), f"{self.name}: page on free list twice"
        assert bool((self._state[free.numpy()] == PageState.FREE).all()), (
            f"{self.name}: free page in use"
        )
        assert self.count(PageState.FREE) == free.numel(), f"{self.name}: FREE pages off list"
        flat = np.concatenate([as_ids(p) for p in owned]) if owned else np.empty(0, np.int64)
        assert not has_duplicates(flat), f"{self.name}: page owned twice"
        assert bool((self._state[flat] == PageState.OWNED).all()), f"{self.name}: owned not OWNED"
        assert self.count(PageState.OWNED) == flat.size, (
            f"{self.name}: {self.count(PageState.OWNED)} OWNED pages but {flat.size} referenced"
        )
        quarantined = self._state == _QUARANTINED
        assert int(np.count_nonzero(quarantined)) == self.quarantined, (
            f"{self.name}: quarantine count {self.quarantined} drifted"
        )
        assert bool((self._leases[quarantined] > 0).all()), (
            f"{self.name}: quarantined page with no lease"
        )
        assert bool((self._leases >= 0).all()), f"{self.name}: negative lease count"
        refs = np.zeros(self.num_pages, dtype=np.int64)
        for ids in retained or []:
            assert not has_duplicates(ids), f"{self.name}: retained twice"
            refs[ids] += 1
        assert bool((refs == self._refs).all()), f"{self.name}: references drifted"
        assert int(np.count_nonzero(refs)) == self.referenced, f"{self.name}: referenced drifted"
        kept = self._state == _RETAINED
        assert int(np.count_nonzero(kept)) == self.retained, (
            f"{self.name}: retained count {self.retained} drifted"
        )
        assert bool((refs[kept] > 0).all()), f"{self.name}: retained page with no reference"
        free_or_held = (self._state == _FREE) | (self._state == _HELD)
        assert not bool((refs[free_or_held] > 0).any()), f"{self.name}: referenced page reused"
