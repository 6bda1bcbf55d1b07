"""How far a node's key and a request's tokens agree: the comparison of every tree walk.

Two implementations return the same values: a C extension (``_keycmp``, built by
``pip install -e .`` where a C compiler is at hand), which compares the lists in place, and
:func:`py_common_len` below (slices compared in chunks; the reference, used where the
extension is missing).  :data:`KEYCMP_IMPL` says which one runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiocache_kv.errors import InvalidInputError
from aiocache_kv.extensions import optional_extension

__all__ = [
    "KEYCMP_IMPL",
    "common_len",
    "int_common_len",
    "page_key",
    "py_common_len",
    "py_int_common_len",
    "py_page_key",
]

_CHUNK = 64  # items compared per slice before the item-by-item search for the mismatch


def py_common_len(key: list[int], tokens: list[int], pos: int, limit: int) -> int:
    """How many leading items of ``key[:limit]`` equal ``tokens[pos:pos + limit]``, in order
    (``limit`` is clipped to what both lists hold).

    Raises:
        InvalidInputError: ``pos`` or ``limit`` is negative (the C path raises a plain
            ``ValueError``, which it also is).
    """
    if pos < 0 or limit < 0:
        raise InvalidInputError(f"pos and limit must be >= 0, got pos={pos} limit={limit}")
    limit = min(limit, len(key), max(len(tokens) - pos, 0))
    # the common case, the whole key: one comparison and one slice
    if limit == len(key) and key == tokens[pos : pos + limit]:
        return limit
    i = 0
    while i + _CHUNK <= limit and key[i : i + _CHUNK] == tokens[pos + i : pos + i + _CHUNK]:
        i += _CHUNK
    end = min(limit, i + _CHUNK)
    while i < end and key[i] == tokens[pos + i]:
        i += 1
    return i


def py_int_common_len(key: list[int], tokens: list[Any], pos: int, limit: int) -> int:
    """:func:`py_common_len`, where a token that is not an ``int`` never equals: every token
    it counts is an int equal to a key item (a walk that matched them has checked them).

    Raises:
        InvalidInputError: ``pos`` or ``limit`` is negative.
    """
    same = py_common_len(key, tokens, pos, limit)
    return next((i for i in range(same) if not isinstance(tokens[pos + i], int)), same)


def py_page_key(tokens: list[Any], pos: int, page_size: int) -> tuple[int, ...] | None:
    """``tuple(tokens[pos:pos + page_size])`` (a child's key in the tree) when those are
    ``page_size`` exact ints, else ``None``: too few, or an object whose hash could run code.

    Raises:
        InvalidInputError: ``pos`` is negative or ``page_size`` < 1.
    """
    if pos < 0 or page_size < 1:
        raise InvalidInputError(f"pos must be >= 0 and page_size >= 1, got {pos}, {page_size}")
    page = tokens[pos : pos + page_size]
    if len(page) < page_size or any(type(t) is not int for t in page):
        return None
    return tuple(page)


_EXT = optional_extension("aiocache_kv.tree._keycmp")
#: ``"c"`` where the C extension compares, else ``"python"``.
KEYCMP_IMPL = "python" if _EXT is None else "c"

#: :func:`py_common_len`, in C where the extension is built.
common_len: Callable[[list[int], list[int], int, int], int] = (
    py_common_len if _EXT is None else _EXT.common_len
)
#: :func:`py_int_common_len`, in C where the extension is built.
int_common_len: Callable[[list[int], list[Any], int, int], int] = (
    py_int_common_len if _EXT is None else _EXT.int_common_len
)
#: :func:`py_page_key`, in C where the extension is built.
page_key: Callable[[list[Any], int, int], tuple[int, ...] | None] = (
    py_page_key if _EXT is None else _EXT.page_key
)
