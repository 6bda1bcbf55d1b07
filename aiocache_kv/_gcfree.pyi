"""Types of the C extension built from ``_gcfree.c`` (see ``aiocache_kv.gcfree``)."""

from typing import TypeVar

_T = TypeVar("_T")

def untrack_ints(lst: object, /) -> bool: ...
def keep(lst: _T, /) -> _T: ...
