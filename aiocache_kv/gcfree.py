"""Int lists the tree keeps for good, taken out of the cyclic garbage collector's view.

The tree keeps every cached token run (a node's key) as a list of ints and its page hashes as
a list of ``bytes``.
The collector tracks every list and visits each element at every collection that sees it, so
with many cached tokens a young collection after a large insert, and every full collection,
pause the event loop for milliseconds (7-12 ms measured on an H100 machine while 8 GiB was
written through; ~100 ms full collections in ``bench tree``).  A list of ints cannot be part
(or of bytes) of a reference cycle, so :func:`keep` untracks it (C extension ``_gcfree``, built by
``pip install -e .`` where a C compiler is at hand; without it the lists stay tracked, which is
only slower).  Reference counting still frees them.  Nothing may put anything but ints or
bytes into such a list afterwards: the tree never mutates keys or hashes, it replaces them.
"""

from __future__ import annotations

from typing import TypeVar

from aiocache_kv.extensions import optional_extension

_T = TypeVar("_T", int, bytes)

__all__ = ["GCFREE_IMPL", "keep", "py_keep"]


_EXT = optional_extension("aiocache_kv._gcfree")
#: ``"c"`` where kept int lists are untracked, else ``"none"`` (they stay tracked)
GCFREE_IMPL = "none" if _EXT is None else "c"


def py_keep(ints: list[_T]) -> list[_T]:
    """``ints`` (a list of ints or of bytes, returned), out of the collector's view where
    possible: the caller keeps it and never stores anything but ints or bytes in it.  (This
    one, where the extension is missing, leaves it tracked.)"""
    return ints


#: :func:`py_keep`, untracking the list, as one C call where the extension is built (every
#: node a request inserts keeps its key through it)
keep = py_keep if _EXT is None else _EXT.keep
