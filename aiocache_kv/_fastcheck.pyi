"""Types of the C extension built from ``_fastcheck.c`` (see ``aiocache_kv.fastcheck``)."""

from typing import Any

def first_bad_token(tokens: list[Any], /) -> int: ...
def slot_pages(slots: Any, page_size: int, limit: int, out: Any, /) -> int: ...
def first_repeat(pages: Any, stamp: Any, epoch: int, /) -> int: ...
def held_check(pages: Any, existing: Any, state: Any, held: int, /) -> tuple[int, int]: ...
def page_slots(pages: Any, page_size: int, out: Any, /) -> None: ...
def insert_pages(
    slots: Any,
    page_size: int,
    limit: int,
    out: Any,
    existing: Any,
    state: Any,
    held: int,
    stamp: Any,
    epoch: int,
    /,
) -> tuple[int, int, int]: ...
