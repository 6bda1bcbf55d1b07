"""Types of the C extension built from ``_blocksum.c`` (see ``aiocache_kv.storage.integrity``)."""

from collections.abc import Sequence
from typing import Any

def sums(buffers: Sequence[Any], nbytes: int, /) -> list[tuple[int, int]]: ...
def seal(buffers: Sequence[Any], keys: Sequence[str], identities: Sequence[bytes], /) -> None: ...
def verify(
    buffers: Sequence[Any],
    keys: Sequence[str],
    identities: Sequence[bytes],
    sizes: Sequence[int | None],
    given: Sequence[Any] | None = None,
    rows: Sequence[Any] | None = None,
    /,
) -> list[int]: ...
