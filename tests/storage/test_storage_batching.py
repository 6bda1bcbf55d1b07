"""The batched backend paths: FileStorage in-place writes / preadv reads / chunked checksums,
MooncakeStorage's existence check overlapped with the seal, StorageIO's worker threads."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from pathlib import Path

import pytest
import torch

from aiocache_kv.errors import ConfigError, StorageUnavailableError
from aiocache_kv.storage import (
    FRAME_OVERHEAD,
    FileStorage,
    MooncakeStorage,
    PageBuffer,
    StorageIO,
    page_file,
)
from aiocache_kv.storage.integrity import Verdict, verify
from aiocache_kv.testing.fake_mooncake import FakeMooncakeClient, FakeMooncakeStorage

PAGE = 4096
SLOT = PAGE + FRAME_OVERHEAD


def pool(n: int, seed: int = 0, slot: int = SLOT) -> list[PageBuffer]:
    """``n`` slots as rows of one tensor, rows rounded up to 64 bytes (like the host pool)."""
    stride = -(-slot // 64) * 64
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n, stride), dtype=torch.uint8, generator=g)
    return [PageBuffer.from_tensor(raw[i, :slot]) for i in range(n)]


def empty(n: int, slot: int = SLOT) -> list[PageBuffer]:
    return pool(n, seed=99, slot=slot)  # garbage, not zeros: a read must overwrite it all


def payload(buf: PageBuffer) -> bytes:
    return bytes(buf.view[: buf.nbytes - FRAME_OVERHEAD])


def keys_for(n: int, tag: str = "t") -> list[str]:
    return [f"{tag}/{i:016x}/kv" for i in range(n)]


# -- FileStorage ------------------------------------------------------------------------------


def test_chunked_batches_detect_corruption_per_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(page_file, "CHUNK_BYTES", 3 * SLOT)  # several chunks per call
    fs = FileStorage(tmp_path)
    keys, src = keys_for(10), pool(10, seed=1)
    assert fs.put(keys, src) == [True] * 10
    for i in (2, 7):
        path = fs.path_of(keys[i])
        data = bytearray(path.read_bytes())
        data[-FRAME_OVERHEAD - 100] ^= 0x01  # one payload bit
        path.write_bytes(bytes(data))
    dst = empty(10)
    got = fs.get_into(keys, dst)
    assert got == [i not in (2, 7) for i in range(10)]
    assert all(payload(dst[i]) == payload(src[i]) for i in range(10) if got[i])
    assert fs.statistics().corrupt == 2
    assert fs.exists(keys) == got  # corrupt pages were dropped


def test_writes_leave_no_temporary_files(tmp_path: Path) -> None:
    fs = FileStorage(tmp_path)
    fs.put(keys_for(20), pool(20))
    assert not list(tmp_path.rglob("*.tmp"))
    assert len(list(tmp_path.rglob("*.kv"))) == 20


def test_second_writer_of_a_name_waits_for_the_first(tmp_path: Path) -> None:
    """One name, one writer at a time: a put of a name another put is writing waits until
    that write ended (and then finds the page stored, or writes it); it never races it
    through a temporary file that an eviction of the first copy could then unlink."""
    fs = FileStorage(tmp_path)
    fs.open()
    [key] = keys_for(1)
    name = fs.path_of(key).stem
    with fs._lock:
        fs._writing.add(name)  # another worker is writing this name
    [src] = pool(1, seed=4)
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        put = ex.submit(fs.put, [key], [src])
        with pytest.raises(concurrent.futures.TimeoutError):
            put.result(timeout=0.2)  # waiting for the other writer
        with fs._settled:  # the other writer gave up without storing it
            fs._writing.discard(name)
            fs._settled.notify_all()
        assert put.result(timeout=5) == [True]
    assert not list(tmp_path.rglob("*.tmp"))
    dst = empty(1)
    assert fs.get_into([key], dst) == [True] and payload(dst[0]) == payload(src)


def test_concurrent_puts_of_the_same_keys_store_valid_pages(tmp_path: Path) -> None:
    fs = FileStorage(tmp_path)
    keys = keys_for(40)

    def work(w: int) -> list[bool]:
        return fs.put(keys, pool(40, seed=w))

    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        results = list(ex.map(work, range(4)))
    assert all(all(r) for r in results)
    st = fs.statistics()
    assert st.put_ok + st.put_skipped == 4 * 40 and st.put_failed == 0
    assert fs.get_into(keys, empty(40)) == [True] * 40
    assert fs.statistics().corrupt == 0
    assert not list(tmp_path.rglob("*.tmp"))
    assert fs.total_bytes() == sum(p.stat().st_size for p in tmp_path.rglob("*.kv"))


def test_torn_file_after_a_crash_is_a_miss_and_is_deleted(tmp_path: Path) -> None:
    fs = FileStorage(tmp_path)
    keys = keys_for(3)
    fs.put(keys, pool(3))
    path = fs.path_of(keys[1])
    with open(path, "r+b") as f:  # a crash in the middle of an in-place write
        f.truncate(path.stat().st_size // 2)
    fs.close()
    again = FileStorage(tmp_path)
    assert again.exists(keys) == [True] * 3  # indexed at open, like any file
    assert again.get_into(keys, empty(3)) == [True, False, True]
    assert again.statistics().corrupt == 1
    assert not path.exists() and again.exists(keys) == [True, False, True]


def test_longer_file_and_foreign_header_are_misses(tmp_path: Path) -> None:
    fs = FileStorage(tmp_path)
    keys = keys_for(3)
    fs.put(keys, pool(3))
    with open(fs.path_of(keys[0]), "ab") as f:
        f.write(b"x")  # one byte too many: the slot would not be the stored object
    other = fs.path_of(keys[1])
    data = bytearray(other.read_bytes())
    data[0:4] = b"XXXX"
    other.write_bytes(bytes(data))
    assert fs.get_into(keys, empty(3)) == [False, False, True]
    assert fs.statistics().corrupt == 2


def test_duplicate_keys_in_one_put(tmp_path: Path) -> None:
    fs = FileStorage(tmp_path)
    [a, b] = keys_for(2)
    assert fs.put([a, b, a], pool(3, seed=2)) == [True, True, True]
    st = fs.statistics()
    assert (st.puts, st.put_ok, st.put_skipped, st.put_failed) == (3, 2, 1, 0)
    assert len(list(tmp_path.rglob("*.kv"))) == 2


def test_large_pages_round_trip(tmp_path: Path) -> None:
    slot = (1 << 20) + FRAME_OVERHEAD  # bigger than a checksum block, several per chunk
    fs = FileStorage(tmp_path)
    keys, src = keys_for(6), pool(6, seed=3, slot=slot)
    assert fs.put(keys, src) == [True] * 6
    dst = empty(6, slot=slot)
    assert fs.get_into(keys, dst) == [True] * 6
    assert [payload(b) for b in dst] == [payload(b) for b in src]


# -- MooncakeStorage (scripted client: the call sequence, not the store) ----------------------


def scripted(client: FakeMooncakeClient) -> MooncakeStorage:
    s = FakeMooncakeStorage(client, no_space_retry_delay=0.0, check_existing=True)
    s.open()
    return s


def track(bufs: list[PageBuffer]) -> list[PageBuffer]:
    return bufs  # the fake client reads and writes the buffers' own addresses


@pytest.mark.parametrize("overlap", [True, False])
def test_mooncake_put_overlaps_exist_with_seal(
    overlap: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = FakeMooncakeClient()
    s = scripted(client)
    if not overlap:
        monkeypatch.setattr(s, "_submit", lambda *a: None)  # the inline path (closed helper)
    keys = keys_for(6)
    first = track(pool(6, seed=1))
    assert s.put(keys[:2], first[:2]) == [True, True]
    second = track(pool(6, seed=2))
    assert s.put([*keys, keys[3]], [*second, second[0]]) == [True] * 7
    assert client.log[-1] == ("batch_put_from", keys[2:])  # present keys, duplicates not re-sent
    st = s.statistics()
    assert (st.put_ok, st.put_skipped, st.bytes_written) == (6, 3, 6 * SLOT)
    for i in range(2, 6):
        assert verify(second[i], keys[i]) is Verdict.OK  # what was sent carries its trailer
    dst = track(empty(6))
    assert s.get_into(keys, dst) == [True] * 6
    assert [payload(b) for b in dst[:2]] == [payload(b) for b in first[:2]]
    assert [payload(b) for b in dst[2:]] == [payload(b) for b in second[2:6]]


def test_mooncake_batch_corruption_is_per_key() -> None:
    client = FakeMooncakeClient()
    s = scripted(client)
    keys = keys_for(5)
    assert s.put(keys, track(pool(5, seed=3))) == [True] * 5
    blob = bytearray(client.objects[keys[2]])
    blob[10] ^= 0x04
    client.objects[keys[2]] = bytes(blob)
    client.objects[keys[4]] = client.objects[keys[4]][:-1]  # short object
    got = s.get_into(keys, track(empty(5)))
    assert got == [True, True, False, True, False]
    assert s.statistics().corrupt == 2
    assert keys[2] not in client.objects and keys[4] not in client.objects  # removed


def test_mooncake_helper_stops_at_close() -> None:
    client = FakeMooncakeClient()
    s = scripted(client)
    assert s.put(keys_for(1), track(pool(1))) == [True]
    assert s._helper is not None
    s.close()
    assert s._helper is None and s._submit(len, []) is None
    with pytest.raises(StorageUnavailableError):
        s.put(keys_for(1), pool(1))


# -- StorageIO workers ------------------------------------------------------------------------


class ThreadsProbe:
    """A backend method that reports torch's intra-op thread count on the worker."""

    def threads(self) -> int:
        return torch.get_num_threads()


@pytest.mark.parametrize("threads", [1, None])
def test_workers_cap_intra_op_threads(threads: int | None) -> None:
    probe = ThreadsProbe()
    before = torch.get_num_threads()

    async def main() -> int:
        io = StorageIO(FileStorage(os.devnull + ".unused"), workers=1, intra_op_threads=threads)
        try:
            got: int = await io.call("threads", probe.threads)
            return got
        finally:
            await io.aclose()

    got = asyncio.run(main())
    if threads == 1:
        assert got == 1
    else:
        assert got >= 1  # torch's default for a new thread
    assert torch.get_num_threads() == before  # the caller's thread is untouched


def test_intra_op_threads_must_be_positive() -> None:
    with pytest.raises(ConfigError):
        StorageIO(FileStorage("/nonexistent-unused"), intra_op_threads=0)


def test_mooncake_default_put_has_no_existence_check_and_no_hand_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client = FakeMooncakeClient()
    s = FakeMooncakeStorage(client, no_space_retry_delay=0.0)
    s.open()
    keys = keys_for(4)
    first = track(pool(4, seed=1))
    assert s.put(keys[:2], first[:2]) == [True, True]

    def no_helper(*_: object) -> None:
        raise AssertionError("a one-chunk put must not hand off to a helper thread")

    monkeypatch.setattr(s, "_submit", no_helper)
    second = track(pool(4, seed=2))
    assert s.put([*keys, keys[1]], [*second, second[0]]) == [True] * 5
    assert client.calls["batch_is_exist"] == 0
    assert client.log[-1] == ("batch_put_from", keys)  # present keys too; the repeat rides along
    st = s.statistics()
    assert (st.put_ok, st.put_skipped) == (2 + 4, 1)
    dst = track(empty(4))
    assert s.get_into(keys, dst) == [True] * 4  # the store kept the first values: they verify
    assert [payload(b) for b in dst] == [payload(b) for b in [*first[:2], *second[2:]]]
