"""Types of the C extension built from ``_pageio.c`` (see ``aiocache_kv.storage.page_file``)."""

from typing import Any

def read_pages(reads: list[tuple[int, bytes, Any, Any]], /) -> list[tuple[int, int]]: ...
def read_named(
    shard_fds: list[int],
    suffix: bytes,
    names: list[str],
    keys: list[bytes],
    slots: list[Any],
    /,
) -> list[tuple[int, int, int, int, int]]: ...
def write_named(
    shard_fds: list[int],
    suffix: bytes,
    names: list[str],
    keys: list[bytes],
    parents: list[str | None],
    slots: list[Any],
    /,
) -> list[int]: ...
