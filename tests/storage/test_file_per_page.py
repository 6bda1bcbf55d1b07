"""FileStorage's per-page costs: a single page read summed as it lands (one pass)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from aiocache_kv.storage import FRAME_OVERHEAD, FileStorage, integrity, page_file
from tests.storage.test_file_storage import empty, keys_for, pages, payload


def test_a_single_page_is_read_and_summed_in_one_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk of one page (a 4 MiB page is a chunk of its own) goes through the C reader
    too, which sums the payload as it lands: the verify gets that sum and reads only the
    trailer (it was read into the slot, then summed again, in a second pass)."""
    if page_file.PAGEIO is None:
        pytest.skip("aiocache_kv.storage._pageio not built")
    slot = (300 << 10) + FRAME_OVERHEAD  # a few pieces of the fused read
    fs = FileStorage(tmp_path, capacity_bytes=None)
    (key,) = keys_for("one", 1)
    (src,) = pages(1, slot=slot)
    assert fs.put([key], [src]) == [True]
    real_read, real_verify = page_file.PAGEIO.read_pages, integrity.verify_many
    calls: list[tuple[int, bool]] = []
    sums: list[Any] = []

    class Reader:
        @staticmethod
        def read_pages(reads: list[Any], summing: bool = False) -> Any:
            calls.append((len(reads), summing))
            return real_read(reads, summing)

    def verify_many(*args: Any, **kwargs: Any) -> Any:
        sums.append(kwargs.get("sums"))
        return real_verify(*args, **kwargs)

    monkeypatch.setattr(page_file, "PAGEIO", Reader)
    monkeypatch.setattr(integrity, "verify_many", verify_many)
    dst = empty(1, slot=slot)
    assert fs.get_into([key], dst) == [True]
    assert payload(dst[0]) == payload(src)
    assert calls == [(1, True)]
    assert len(sums) == 1 and sums[0] is not None and sums[0][0][2] == slot - FRAME_OVERHEAD
    # and a flipped payload byte is still caught through that sum
    path = fs.path_of(key)
    data = bytearray(path.read_bytes())
    data[-FRAME_OVERHEAD - 1000] ^= 0x01  # in the payload
    path.write_bytes(bytes(data))
    assert fs.get_into([key], empty(1, slot=slot)) == [False]
    assert fs.statistics().corrupt == 1
