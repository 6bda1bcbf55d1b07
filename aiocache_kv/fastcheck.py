"""Checks of caller input that run on every request: token lists, slot runs, page ids.

Each function is one pass over a list or an int64 array and reports *where* the first bad
value is; the callers (:mod:`aiocache_kv.validate`, the page allocator) word the typed error.
Two implementations return the same values: a C extension (``_fastcheck``, built by
``pip install -e .`` where a C compiler is at hand) and the numpy functions below (the
reference, used where the extension is missing).  :data:`FASTCHECK_IMPL` says which one runs.

Arrays are C-contiguous ``int64`` (``state`` is ``uint8``); ``out`` is written in place.
"""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np

from aiocache_kv.extensions import optional_extension
from aiocache_kv.gcfree import keep
from aiocache_kv.tree.hashing import MAX_TOKEN_ID

#: the range of a C ``long long`` (:func:`py_exact_ints` leaves other values as they are)
_LL_MIN, _LL_MAX = -(2**63), 2**63 - 1

#: :func:`slot_pages` codes
SLOTS_OK, SLOTS_OUT_OF_RANGE, SLOTS_NOT_PAGES = 0, 1, 2


def py_first_bad_token(tokens: list[Any], start: int = 0) -> int:
    """Index of the first element from ``start`` on that is not an int in
    ``[0, MAX_TOKEN_ID]``, or -1.

    An int means an ``int`` instance (``bool`` included): numpy and torch scalars are refused,
    so tree keys and hashes only ever see plain ints.

    Raises:
        ValueError: ``start`` is negative.
    """
    if start < 0:
        raise ValueError("start must be >= 0")
    if start:
        bad = py_first_bad_token(tokens[start:])
        return bad + start if bad >= 0 else -1
    try:
        words = array("Q", tokens)  # one C pass: most bad values stop it
    except (TypeError, OverflowError):
        words = None
    if words is not None and all(isinstance(t, int) for t in tokens):
        big = np.frombuffer(words, dtype=np.uint64) > MAX_TOKEN_ID
        return int(big.argmax()) if big.any() else -1
    return next(
        i for i, t in enumerate(tokens) if not isinstance(t, int) or not 0 <= t <= MAX_TOKEN_ID
    )


def py_exact_ints(tokens: list[Any]) -> list[Any]:
    """``tokens`` itself when no item is an ``int`` subclass (a ``bool``, an ``IntEnum``, a
    hostile subclass), else a new list in which each such item whose value fits a C
    ``long long`` is an exact ``int`` of that value.  No code of the items runs
    (``int.__int__`` copies the value; no ``__index__``, ``__hash__`` or ``__eq__``), so a
    later tree walk cannot run a caller's code that changes the list under it.  Other items
    stay as they are (the token check names them).
    """
    if all(type(t) is int or not issubclass(type(t), int) for t in tokens):
        return tokens
    return [
        int.__int__(t)
        if type(t) is not int and issubclass(type(t), int) and _LL_MIN <= int.__int__(t) <= _LL_MAX
        else t
        for t in tokens
    ]


def py_checked_key(tokens: list[Any], start: int, pos: int, n: int) -> int | list[int]:
    """:func:`first_bad_token` ``(tokens, start)`` if it is >= 0, else a new list
    ``tokens[pos:n]`` for a tree key, out of the collector's view (:func:`.gcfree.keep`) when
    its items are exact ints.  The items before ``start`` are the caller's to vouch for (a
    tree walk matched them as ints).

    Raises:
        ValueError: not ``0 <= pos <= start`` and ``pos <= n <= len(tokens)``.
    """
    if not (0 <= pos <= start and pos <= n <= len(tokens)):
        raise ValueError("checked_key needs 0 <= pos <= start, pos <= n <= len")
    bad = py_first_bad_token(tokens, start)
    return bad if bad >= 0 else keep(tokens[pos:n])


def py_slot_pages(slots: np.ndarray, page_size: int, limit: int, out: np.ndarray) -> int:
    """Page ids of ``slots`` (whole runs ``page * page_size + 0..page_size-1``) into ``out``.

    Returns :data:`SLOTS_OK`, :data:`SLOTS_OUT_OF_RANGE` (a slot outside ``[0, limit)``) or
    :data:`SLOTS_NOT_PAGES` (a run is not one page, or ``out`` has the wrong length).
    """
    p = page_size
    if slots.size % p or out.size != slots.size // p:
        return SLOTS_NOT_PAGES
    if slots.size and (slots.min() < 0 or slots.max() >= limit):
        return SLOTS_OUT_OF_RANGE
    if p == 1:
        out[:] = slots
        return SLOTS_OK
    grid = slots.reshape(-1, p)
    first = grid[:, 0]
    if (first % p).any() or (np.diff(grid, axis=1) != 1).any():
        return SLOTS_NOT_PAGES
    out[:] = first // p
    return SLOTS_OK


def py_first_repeat(pages: np.ndarray, stamp: np.ndarray, epoch: int) -> int:
    """-1 if the ids in ``pages`` are distinct, else the index of an id that repeats.

    ``stamp`` is scratch indexed by page id; ``epoch`` differs from every value it holds (the
    C version marks ids with it and stops at the second sighting; this one writes positions
    and reports the first).
    """
    del epoch
    order = np.arange(pages.size, dtype=np.int64)
    stamp[pages] = order  # a repeated id keeps one of its positions (the last)
    lost = stamp[pages] != order
    return int(lost.argmax()) if lost.any() else -1


def py_held_check(
    pages: np.ndarray, existing: np.ndarray, state: np.ndarray, held: int
) -> tuple[int, int]:
    """``(first_bad, differing)``: page ``i < len(existing)`` is fine if it is
    ``existing[i]`` or in state ``held``, later pages must be ``held``; ``first_bad`` is the
    first index breaking that (-1: none), ``differing`` counts ``pages[i] != existing[i]``."""
    d = min(existing.size, pages.size)
    same = np.zeros(pages.size, dtype=bool)
    same[:d] = pages[:d] == existing[:d]
    bad = ~same & (state[pages] != held)
    return (int(bad.argmax()) if bad.any() else -1), int(d - np.count_nonzero(same))


#: :func:`insert_pages` codes beyond :func:`slot_pages`'s
INSERT_REPEAT, INSERT_NOT_HELD = 3, 4


def py_insert_pages(
    slots: np.ndarray,
    page_size: int,
    limit: int,
    out: np.ndarray,
    existing: np.ndarray,
    state: np.ndarray,
    held: int,
    stamp: np.ndarray,
    epoch: int,
) -> tuple[int, int, int]:
    """Every check of an insert in one call: ``(code, index, differing)``.

    :func:`py_slot_pages` into ``out`` (its codes, index -1), then a repeat check of ``out``
    (:data:`INSERT_REPEAT` at the first position whose id occurred before; ``stamp`` and
    ``epoch`` are the C version's scratch, unused here), then :func:`py_held_check`
    (:data:`INSERT_NOT_HELD` at ``index``); ``differing`` as there (0 before that check).
    """
    code = py_slot_pages(slots, page_size, limit, out)
    if code != SLOTS_OK:
        return code, -1, 0
    del stamp, epoch
    _, first = np.unique(out, return_index=True)
    if first.size < out.size:  # the first position holding an id seen before, as C reports
        again = np.ones(out.size, dtype=bool)
        again[first] = False
        return INSERT_REPEAT, int(again.argmax()), 0
    bad, differing = py_held_check(out, existing, state, held)
    return (INSERT_NOT_HELD if bad >= 0 else SLOTS_OK), bad, differing


def py_page_slots(pages: np.ndarray, page_size: int, out: np.ndarray) -> None:
    """Token slots of whole ``pages`` into ``out``: ``page * page_size + 0..page_size-1``."""
    p = page_size
    out.reshape(-1, p)[:] = pages[:, None] * p + np.arange(p, dtype=np.int64)


def py_set_states(state: np.ndarray, ids: np.ndarray, value: int) -> None:
    """``state[ids] = value`` (``state`` uint8, ``ids`` int64 within it).

    Raises:
        IndexError: an id is outside ``state`` (nothing written).
    """
    if ids.size and (ids.min() < 0 or ids.max() >= state.size):
        raise IndexError("page id outside the state array")
    state[ids] = value


def py_hex_keys(prefix: str, hashes: list[Any], suffix: str, nbytes: int) -> list[str] | int:
    """``prefix + h.hex() + suffix`` of every hash, or the index of the first item that is not
    exactly ``bytes`` of ``nbytes`` (storage keys around page hashes)."""
    for i, h in enumerate(hashes):
        if type(h) is not bytes or len(h) != nbytes:
            return i
    return [f"{prefix}{h.hex()}{suffix}" for h in hashes]


_EXT = optional_extension("aiocache_kv._fastcheck")
#: ``"c"`` where the C extension runs the checks, else ``"python"``.
FASTCHECK_IMPL = "python" if _EXT is None else "c"

first_bad_token = py_first_bad_token if _EXT is None else _EXT.first_bad_token
checked_key = py_checked_key if _EXT is None else _EXT.checked_key
exact_ints = py_exact_ints if _EXT is None else _EXT.exact_ints
slot_pages = py_slot_pages if _EXT is None else _EXT.slot_pages
first_repeat = py_first_repeat if _EXT is None else _EXT.first_repeat
held_check = py_held_check if _EXT is None else _EXT.held_check
page_slots_into = py_page_slots if _EXT is None else _EXT.page_slots
insert_pages = py_insert_pages if _EXT is None else _EXT.insert_pages
set_states = py_set_states if _EXT is None else _EXT.set_states
hex_keys = py_hex_keys if _EXT is None else _EXT.hex_keys

__all__ = [
    "FASTCHECK_IMPL",
    "INSERT_NOT_HELD",
    "INSERT_REPEAT",
    "SLOTS_NOT_PAGES",
    "SLOTS_OK",
    "SLOTS_OUT_OF_RANGE",
    "checked_key",
    "exact_ints",
    "first_bad_token",
    "first_repeat",
    "held_check",
    "hex_keys",
    "insert_pages",
    "page_slots_into",
    "set_states",
    "slot_pages",
]
