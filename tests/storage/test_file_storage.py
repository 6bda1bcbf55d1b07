"""FileStorage: atomic files, safe names, exact LRU, corruption as misses, typed errors."""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import os
import random
import shutil
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from aiocache_kv.errors import ConfigError, StorageKeyError, StorageUnavailableError
from aiocache_kv.storage import FRAME_OVERHEAD, FileStorage, PageBuffer, page_file, safe_fs
from aiocache_kv.storage.keys import parse_storage_key, storage_key
from aiocache_kv.testing import capture_logs

T = TypeVar("T")

PAGE = 4096
SLOT = PAGE + FRAME_OVERHEAD


def pages(n: int, seed: int = 0, slot: int = SLOT) -> list[PageBuffer]:
    g = torch.Generator().manual_seed(seed)
    pool = torch.randint(0, 256, (n * slot,), dtype=torch.uint8, generator=g)
    return [PageBuffer.from_tensor(pool[i * slot : (i + 1) * slot]) for i in range(n)]


def empty(n: int, slot: int = SLOT) -> list[PageBuffer]:
    return [PageBuffer.allocate(slot) for _ in range(n)]


def payload(buf: PageBuffer) -> bytes:
    return bytes(buf.view[: buf.nbytes - FRAME_OVERHEAD])


def keys_for(tag: str, n: int, start: int = 0) -> list[str]:
    return [storage_key(tag, (0x1000 + i).to_bytes(32, "big")) for i in range(start, start + n)]


def stored_keys(root: Path) -> list[str]:
    """Read the raw key back from every page file under ``root``."""
    out = []
    for path in sorted(root.rglob("*.kv")):
        with open(path, "rb") as f:
            magic, n, _parent = struct.unpack("<4sI20s", f.read(28))
            assert magic == b"AKV3"
            out.append(f.read(n).decode("utf-8", "surrogatepass"))
    return out


def file_size(key: str) -> int:
    return 28 + len(key.encode()) + SLOT


def test_round_trip_bit_identical(tmp_path: Path) -> None:
    fs = FileStorage(tmp_path / "kv")
    keys, src = keys_for("a", 4), pages(4)
    assert fs.put(keys, src) == [True] * 4
    dst = empty(4)
    assert fs.get_into(keys, dst) == [True] * 4
    assert [bytes(b.view) for b in dst] == [bytes(b.view) for b in src]  # trailer too
    assert fs.exists([*keys, "a/0000000000000000/kv"]) == [True] * 4 + [False]
    assert fs.leading_hits([keys[0], keys[1], "missing", keys[2]]) == 2
    st = fs.statistics()
    assert (st.puts, st.put_ok, st.gets, st.hits, st.bytes_written, st.bytes_read) == (
        4,
        4,
        4,
        4,
        4 * SLOT,
        4 * SLOT,
    )
    assert fs.total_bytes() == sum(p.stat().st_size for p in (tmp_path / "kv").rglob("*.kv"))


def test_existing_keys_not_rewritten(tmp_path: Path) -> None:
    fs = FileStorage(tmp_path)
    keys = keys_for("a", 2)
    fs.put(keys, pages(2, seed=1))
    mtimes = [fs.path_of(k).stat().st_mtime_ns for k in keys]
    other = pages(2, seed=2)
    assert fs.put(keys, other) == [True, True]
    st = fs.statistics()
    assert (st.put_ok, st.put_skipped, st.bytes_written) == (2, 2, 2 * SLOT)
    assert [fs.path_of(k).stat().st_mtime_ns for k in keys] == mtimes
    dst = empty(2)
    fs.get_into(keys, dst)
    assert [payload(b) for b in dst] == [payload(b) for b in pages(2, seed=1)]


@pytest.mark.parametrize(
    "key",
    [
        "../../etc/passwd",
        "/abs",
        "/abs/../../x",
        "a\x00b",
        "x" * 1000,
        "..",
        ".",
        "é/ü\\c:",
        "\udc80",
    ],
)
def test_keys_cannot_escape_the_directory(tmp_path: Path, key: str) -> None:
    root = tmp_path / "kv"
    outside_before = sorted(p for p in tmp_path.rglob("*") if root not in p.parents and p != root)
    fs = FileStorage(root)
    [src] = pages(1)
    assert fs.put([key], [src]) == [True]
    files = list(root.rglob("*.kv"))
    assert len(files) == 1
    assert files[0].resolve().parent.parent == root.resolve()
    assert len(files[0].stem) == 40 and all(c in "0123456789abcdef" for c in files[0].stem)
    assert stored_keys(root) == [key]
    dst = empty(1)
    assert fs.get_into([key], dst) == [True] and payload(dst[0]) == payload(src)
    outside_after = sorted(p for p in tmp_path.rglob("*") if root not in p.parents and p != root)
    assert outside_after == outside_before


def test_bad_keys_raise_before_any_io(tmp_path: Path) -> None:
    fs = FileStorage(tmp_path)
    for bad in ["", "x" * 2000]:
        with pytest.raises(StorageKeyError):
            fs.put(["ok", bad], pages(2))
    assert fs.statistics().puts == 0 and stored_keys(tmp_path) == []


def test_raw_keys_carry_exactly_one_tag(tmp_path: Path) -> None:
    fs = FileStorage(tmp_path)
    ka, kb = keys_for("tenantA", 3), keys_for("tenantB", 3)
    fs.put(ka, pages(3, seed=1))
    fs.put(kb, pages(3, seed=2))
    raw = stored_keys(tmp_path)
    assert sorted(raw) == sorted(ka + kb)
    tags = [parse_storage_key(k).tag for k in raw]  # raises on a doubly-tagged key
    assert sorted(tags) == ["tenantA"] * 3 + ["tenantB"] * 3
    # Same page hashes, other tag: never a cross hit, never the other tenant's bytes.
    fs2 = FileStorage(tmp_path / "only-a")
    fs2.put(ka, pages(3, seed=1))
    assert fs2.get_into(keys_for("tenantB", 3), empty(3)) == [False] * 3
    dst = empty(3)
    assert fs.get_into(kb, dst) == [True] * 3
    assert [payload(b) for b in dst] == [payload(b) for b in pages(3, seed=2)]


def test_corrupted_and_truncated_files_are_misses(tmp_path: Path) -> None:
    fs = FileStorage(tmp_path)
    keys, src = keys_for("a", 4), pages(4)
    fs.put(keys, src)
    flip = fs.path_of(keys[1])
    data = bytearray(flip.read_bytes())
    data[100] ^= 0x40
    flip.write_bytes(bytes(data))
    trunc = fs.path_of(keys[2])
    with open(trunc, "r+b") as f:
        f.truncate(trunc.stat().st_size - 7)
    with capture_logs() as logs:
        got = fs.get_into(keys, empty(4))
    assert got == [True, False, False, True]
    st = fs.statistics()
    assert (st.hits, st.corrupt, st.misses) == (2, 2, 0)
    corrupt_logs = [e for e in logs if e["event"] == "storage.corrupt_pages"]
    assert len(corrupt_logs) == 1 and corrupt_logs[0]["count"] == 2
    # Corrupt pages are dropped, so a re-put stores them again.
    assert fs.exists(keys) == [True, False, False, True]
    assert fs.put(keys, src) == [True] * 4
    dst = empty(4)
    assert fs.get_into(keys, dst) == [True] * 4
    assert [payload(b) for b in dst] == [payload(b) for b in src]


def test_wrong_slot_size_is_a_miss(tmp_path: Path) -> None:
    fs = FileStorage(tmp_path)
    fs.put(["k"], pages(1))
    assert fs.get_into(["k"], [PageBuffer.allocate(SLOT + 8)]) == [False]
    assert fs.statistics().corrupt == 1


def test_lru_eviction_exact_order(tmp_path: Path) -> None:
    ks = keys_for("a", 5)
    fs = FileStorage(tmp_path, capacity_bytes=3 * file_size(ks[0]))
    a, b, c, d, e = ks
    fs.put([a, b, c], pages(3))
    assert fs.get_into([a], empty(1)) == [True]  # a is now most recent
    assert fs.exists([b]) == [True]  # exists is not an access
    fs.put([d], pages(1))  # evicts b
    assert fs.exists(ks) == [True, False, True, True, False]
    fs.put([c], pages(1))  # present: not rewritten, but touched
    fs.put([e], pages(1))  # evicts a (c, d, e remain)
    assert fs.exists(ks) == [False, False, True, True, True]
    assert fs.lru_order() == [fs.path_of(k).stem for k in (d, c, e)]
    assert fs.statistics().evictions == 2
    assert fs.total_bytes() == 3 * file_size(a)
    assert sorted(stored_keys(tmp_path)) == sorted([c, d, e])


def test_page_larger_than_capacity_is_refused(tmp_path: Path) -> None:
    fs = FileStorage(tmp_path, capacity_bytes=SLOT)
    assert fs.put(["k"], pages(1)) == [False]
    assert fs.statistics().put_failed == 1 and stored_keys(tmp_path) == []


def test_index_rebuilt_at_open(tmp_path: Path) -> None:
    ks = keys_for("a", 3)
    fs = FileStorage(tmp_path)
    fs.put(ks, pages(3))
    for i, k in enumerate(ks):  # make the on-disk order explicit: ks[2] oldest
        os.utime(fs.path_of(k), ns=(10**18 - i * 10**9, 10**18 - i * 10**9))
    (tmp_path / "00" / ".stale.tmp").write_bytes(b"half a page")
    fs.close()
    with pytest.raises(StorageUnavailableError):
        fs.exists(ks)
    reopened = FileStorage(tmp_path, capacity_bytes=2 * file_size(ks[0]))
    assert reopened.exists(ks) == [True, True, False]  # over capacity: oldest evicted at open
    assert not (tmp_path / "00" / ".stale.tmp").exists()
    dst = empty(2)
    assert reopened.get_into(ks[:2], dst) == [True, True]


def _unwritable_target(tmp_path: Path) -> Path:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        (locked / "probe").write_bytes(b"x")  # succeeds as root: chmod does not stop root
    except PermissionError:
        return locked / "kv"
    (locked / "probe").unlink()
    locked.chmod(0o700)
    blocker = tmp_path / "file.txt"
    blocker.write_bytes(b"a regular file")
    return blocker / "sub"


def test_unwritable_directory_is_a_typed_error(tmp_path: Path) -> None:
    target = _unwritable_target(tmp_path)
    fs = FileStorage(target)  # construction does no I/O
    with pytest.raises(StorageUnavailableError, match="not usable"):
        fs.open()
    with pytest.raises(StorageUnavailableError):
        fs.put(["k"], pages(1))


def test_path_under_a_regular_file_is_a_typed_error(tmp_path: Path) -> None:
    (tmp_path / "file.txt").write_bytes(b"x")
    with pytest.raises(StorageUnavailableError, match=r"file\.txt"):
        FileStorage(tmp_path / "file.txt" / "sub").open()


def test_failure_mid_batch_is_per_key(tmp_path: Path) -> None:
    fs = FileStorage(tmp_path)
    fs.open()
    keys = [f"key-{i}" for i in range(40)]
    broken_shard = fs.path_of(keys[7]).parent.name
    os.rmdir(tmp_path / broken_shard)
    (tmp_path / broken_shard).write_bytes(b"not a directory")  # writes there fail
    with capture_logs() as logs:
        got = fs.put(keys, pages(40))
    expected = [fs.path_of(k).parent.name != broken_shard for k in keys]
    assert got == expected and not all(got) and any(got[8:])
    st = fs.statistics()
    assert (st.put_ok, st.put_failed) == (sum(expected), len(keys) - sum(expected))
    assert sorted(stored_keys(tmp_path)) == sorted(k for k, ok in zip(keys, got, strict=True) if ok)
    assert fs.exists(keys) == expected
    assert len([e for e in logs if e["event"] == "storage.file.put_failed"]) == 1


@pytest.mark.parametrize("policy", ["never", "data", "always"])
def test_fsync_policies_round_trip(tmp_path: Path, policy: str) -> None:
    fs = FileStorage(tmp_path, fsync=policy)  # type: ignore[arg-type]
    src = pages(2)
    assert fs.put(["a", "b"], src) == [True, True]
    dst = empty(2)
    assert fs.get_into(["a", "b"], dst) == [True, True]
    assert [payload(b) for b in dst] == [payload(b) for b in src]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"fsync": "sometimes"},
        {"capacity_bytes": 0},
        {"capacity_bytes": -5},
        {"capacity_bytes": 1.5},
        {"capacity_bytes": True},
    ],
)
def test_bad_config(tmp_path: Path, kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        FileStorage(tmp_path, **kwargs)  # type: ignore[arg-type]


def test_concurrent_workers_keep_the_index_consistent(tmp_path: Path) -> None:
    cap = 20 * file_size(storage_key("a", bytes(32)))
    fs = FileStorage(tmp_path, capacity_bytes=cap)

    def work(w: int) -> None:
        ks = keys_for("a", 30, start=w * 10)  # overlapping ranges across workers
        fs.put(ks, pages(30, seed=w))
        fs.get_into(ks, empty(30))

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(work, range(4)))
    on_disk = list(tmp_path.rglob("*.kv"))
    assert fs.total_bytes() == sum(p.stat().st_size for p in on_disk) <= cap
    assert sorted(p.stem for p in on_disk) == sorted(fs.lru_order())
    assert fs.statistics().corrupt == 0


@pytest.mark.parametrize("fsync", ["never", "data"])
def test_racing_puts_and_evictions_keep_index_and_disk_equal(tmp_path: Path, fsync: str) -> None:
    """Four workers put random, overlapping sets of 8-30 of 40 keys, again and again, into
    room for 12: the same name written by two puts at once, and a name evicted (unlinked
    outside the lock) while another put writes it again.  Afterwards every indexed page is on
    disk with its size, and nothing else is.  (Timing-dependent: without the put's wait for
    names being written or unlinked it fails about one run in three.)"""
    seed = 99
    cap = 12 * file_size(storage_key("a", bytes(32)))
    fs = FileStorage(tmp_path, capacity_bytes=cap, fsync=fsync)  # type: ignore[arg-type]
    universe = keys_for("a", 40)

    def work(w: int) -> None:
        rng = random.Random(seed + w)
        for _ in range(30):
            ks = rng.sample(universe, rng.randrange(8, 31))
            fs.put(ks, pages(len(ks), seed=w))

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(work, range(4)))
    on_disk = {p.stem: p.stat().st_size for p in tmp_path.rglob("*.kv")}
    assert sorted(on_disk) == sorted(fs.lru_order()), f"seed {seed}"
    assert fs.total_bytes() == sum(on_disk.values()) <= cap, f"seed {seed}"
    assert not list(tmp_path.rglob("*.tmp")), f"seed {seed}"
    fs.check_index()


# -- links, non-regular files, junk at open, full disk -----------------------------------------


def bounded(fn: Callable[[], T], timeout: float = 5.0, unblock: Path | None = None) -> T:
    """Run ``fn`` in a daemon thread; fail (not hang) if it takes longer than ``timeout``.

    ``unblock``: a FIFO to open for writing on timeout, so that a reader stuck in ``open``
    returns and the thread ends.
    """
    out: list[T] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # reported to the test below
            err.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        if unblock is not None:  # let a reader blocked on the FIFO go
            for flags in (os.O_WRONLY | os.O_NONBLOCK, os.O_RDONLY | os.O_NONBLOCK):
                with contextlib.suppress(OSError):
                    os.close(os.open(unblock, flags))
        pytest.fail(f"call still blocked after {timeout} s")
    if err:
        raise err[0]
    return out[0]


@pytest.mark.parametrize("policy", ["never", "data"])
def test_symlink_named_like_a_page_is_not_followed(tmp_path: Path, policy: str) -> None:
    root, victim = tmp_path / "kv", tmp_path / "victim"
    victim.write_bytes(b"precious")
    fs = FileStorage(root, fsync=policy)  # type: ignore[arg-type]
    fs.open()
    key = "k"
    fs.path_of(key).symlink_to(victim)
    [src] = pages(1)
    got = fs.put([key], [src])
    assert victim.read_bytes() == b"precious"
    dst = empty(1)
    assert fs.get_into([key], dst) == got
    if got == [True]:  # the link was replaced by the page, not written through
        assert not fs.path_of(key).is_symlink() and payload(dst[0]) == payload(src)


def test_dangling_symlink_creates_nothing_outside(tmp_path: Path) -> None:
    root, outside = tmp_path / "kv", tmp_path / "outside"
    outside.mkdir()
    fs = FileStorage(root)
    fs.open()
    fs.path_of("k").symlink_to(outside / "created")
    fs.put(["k"], pages(1))
    assert list(outside.iterdir()) == []


def test_link_planted_before_open_is_a_miss_and_never_followed(tmp_path: Path) -> None:
    root, victim = tmp_path / "kv", tmp_path / "victim"
    fs = FileStorage(root)
    [src] = pages(1)
    fs.put(["k"], [src])
    victim.write_bytes(fs.path_of("k").read_bytes())  # a valid page, but outside the root
    fs.path_of("k").unlink()
    fs.path_of("k").symlink_to(victim)
    fs.close()
    again = FileStorage(root)
    assert again.exists(["k"]) == [False]
    assert again.get_into(["k"], empty(1)) == [False]
    assert again.remove(["k"]) == [False]
    assert victim.read_bytes()[:4] == b"AKV3"


def test_shard_replaced_by_a_symlink_after_open(tmp_path: Path) -> None:
    root, outside = tmp_path / "kv", tmp_path / "outside"
    outside.mkdir()
    fs = FileStorage(root)
    shard = fs.path_of("k0").parent
    same = [k for k in (f"k{i}" for i in range(2000)) if fs.path_of(k).parent == shard][:3]
    assert fs.put(same[:1], pages(1)) == [True]  # the shard's descriptor is now in use
    other = fs.path_of("x").parent
    assert other != shard
    for d in (shard, other):
        shutil.rmtree(d)
        d.symlink_to(outside, target_is_directory=True)
    assert fs.put([same[1], "x"], pages(2)) == [False, False]
    assert list(outside.iterdir()) == []
    assert fs.get_into([same[0], same[1], "x"], empty(3)) == [False] * 3
    planted = outside / fs.path_of("x").name
    planted.write_bytes(b"planted")
    assert fs.remove(["x"]) == [False] and planted.read_bytes() == b"planted"
    again = FileStorage(root)  # the links are replaced by real shard directories
    assert again.get_into(["x"], empty(1)) == [False]
    assert again.put(["x"], pages(1)) == [True]
    assert sorted(p.name for p in outside.iterdir()) == [planted.name]
    assert planted.read_bytes() == b"planted" and not other.is_symlink()


def test_shard_replaced_by_a_symlink_before_open(tmp_path: Path) -> None:
    root, outside = tmp_path / "kv", tmp_path / "outside"
    outside.mkdir()
    FileStorage(root).open()
    shard = FileStorage(root).path_of("k").parent
    shutil.rmtree(shard)
    shard.symlink_to(outside, target_is_directory=True)
    fs = FileStorage(root)
    [src] = pages(1)
    got = fs.put(["k"], [src])
    assert list(outside.iterdir()) == []
    dst = empty(1)
    assert fs.get_into(["k"], dst) == got
    assert outside.is_dir()  # the link was not followed when the shard was recreated


def test_fifo_named_like_an_indexed_page_is_a_miss_not_a_hang(tmp_path: Path) -> None:
    fs = FileStorage(tmp_path)
    keys = ["a", "b"]
    fs.put(keys, pages(2))
    fifo = fs.path_of("a")
    fifo.unlink()
    os.mkfifo(fifo)
    assert bounded(lambda: fs.get_into(keys, empty(2)), unblock=fifo) == [False, True]
    [src] = pages(1, seed=3)
    assert bounded(lambda: fs.put(["a"], [src]), unblock=fifo) == [True]
    dst = empty(1)
    assert fs.get_into(["a"], dst) == [True] and payload(dst[0]) == payload(src)


@pytest.mark.parametrize("policy", ["never", "always"])
def test_fifo_at_open_is_skipped_and_a_put_does_not_hang(tmp_path: Path, policy: str) -> None:
    fs = FileStorage(tmp_path)
    fs.open()
    fifo = fs.path_of("a")
    os.mkfifo(fifo)
    again = FileStorage(tmp_path, fsync=policy)  # type: ignore[arg-type]
    assert bounded(again.open, unblock=fifo) is None
    assert again.exists(["a"]) == [False]
    assert bounded(lambda: again.get_into(["a"], empty(1)), unblock=fifo) == [False]
    [src] = pages(1)
    assert bounded(lambda: again.put(["a"], [src]), unblock=fifo) == [True]
    dst = empty(1)
    assert again.get_into(["a"], dst) == [True] and payload(dst[0]) == payload(src)
    assert not fs.path_of("a").is_fifo()


def test_junk_in_the_directory_does_not_stop_open(tmp_path: Path) -> None:
    fs = FileStorage(tmp_path)
    keys = [f"key-{i}" for i in range(4)]
    src = pages(4)
    fs.put(keys, src)
    fs.close()
    junk = [fs.path_of(f"junk-{i}") for i in range(5)]
    junk[0].symlink_to(tmp_path / "nowhere")  # dangling link
    junk[1].symlink_to(fs.path_of(keys[0]))  # link to a valid page
    junk[2].mkdir()  # directory named like a page
    junk[3].write_bytes(b"AKVX not a page")  # bad header (found at its first read)
    os.mkfifo(junk[4])
    shard_file = next(
        s for s in (f"{i:02x}" for i in range(256)) if not (tmp_path / s).is_symlink()
    )
    os.rename(tmp_path / shard_file, tmp_path / "moved")
    (tmp_path / shard_file).write_bytes(b"a file where a shard should be")
    with capture_logs() as logs:
        again = FileStorage(tmp_path)
        again.open()
    warnings = [e for e in logs if e["event"] == "storage.file.junk_skipped"]
    assert len(warnings) == 1 and warnings[0]["log_level"] == "warning"
    assert warnings[0]["count"] >= 4
    names = [p.stem for p in junk]
    assert again.exists([f"junk-{i}" for i in range(5)]) == [False, False, False, True, False]
    assert not set(names[:3] + names[4:]) & set(again.lru_order())
    ok = [fs.path_of(k).parent.name != shard_file for k in keys]
    dst = empty(4)
    assert again.get_into(keys, dst) == ok
    assert bounded(lambda: again.get_into([f"junk-{i}" for i in range(5)], empty(5))) == [False] * 5
    assert (tmp_path / "nowhere").exists() is False


def _no_space(*args: object, **kwargs: object) -> int:
    raise OSError(errno.ENOSPC, "No space left on device")


def _fill_disk(monkeypatch: pytest.MonkeyPatch, writer: str) -> None:
    """Every write from now on fails with ENOSPC: the page-by-page writes (``os``), and
    the group writer either through its Python reference (``"python"``) or as the C writer
    reports it, ``-ENOSPC`` per page (``"group"``)."""
    monkeypatch.setattr(os, "writev", _no_space)
    monkeypatch.setattr(os, "write", _no_space)
    if writer == "python":
        monkeypatch.setattr(page_file, "PAGEIO", None)
    else:
        monkeypatch.setattr(
            page_file, "write_named", lambda fds, names, *rest: [-errno.ENOSPC for _ in names]
        )


@pytest.mark.parametrize("writer", ["python", "group"])
def test_put_on_a_full_disk_fails_per_page_without_raising(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str
) -> None:
    fs = FileStorage(tmp_path)
    fs.put(["old"], pages(1))
    assert fs.writable
    _fill_disk(monkeypatch, writer)
    with capture_logs() as logs:
        assert fs.put(["a", "b", "old"], pages(3)) == [False, False, True]
        assert fs.put(["c"], pages(1)) == [False]
    assert not fs.writable
    st = fs.statistics()
    assert (st.put_failed, st.put_skipped) == (3, 1)
    assert len([e for e in logs if e["event"] == "storage.file.read_only"]) == 1
    assert fs.exists(["a", "b", "c"]) == [False] * 3
    assert sorted(p.stem for p in tmp_path.rglob("*.kv")) == [fs.path_of("old").stem]
    assert not list(tmp_path.rglob("*.tmp"))
    monkeypatch.undo()
    with capture_logs() as logs:
        assert fs.put(["a"], pages(1)) == [True]
    assert fs.writable
    assert [e["event"] for e in logs] == ["storage.file.writable"]


@pytest.mark.parametrize("writer", ["python", "group"])
def test_open_on_a_full_disk_serves_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str
) -> None:
    fs = FileStorage(tmp_path)
    src = pages(2)
    fs.put(["a", "b"], src)
    fs.close()
    _fill_disk(monkeypatch, writer)
    again = FileStorage(tmp_path)
    with capture_logs() as logs:
        again.open()
        assert again.put(["c"], pages(1)) == [False]
    assert not again.writable
    assert [e["event"] for e in logs].count("storage.file.read_only") == 1
    dst = empty(2)
    assert again.get_into(["a", "b"], dst) == [True, True]
    assert [payload(b) for b in dst] == [payload(b) for b in src]
    assert again.statistics().put_failed == 1
    monkeypatch.undo()
    assert again.put(["c"], pages(1)) == [True] and again.writable


def test_root_that_is_a_symlink_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    with pytest.raises(StorageUnavailableError, match="symbolic link"):
        FileStorage(tmp_path / "link").open()
    assert list(real.iterdir()) == []


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd")
def test_close_releases_the_directory_descriptors(tmp_path: Path) -> None:
    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    before = open_fds()
    fs = FileStorage(tmp_path / "a")
    fs.put(keys_for("a", 20), pages(20))
    assert open_fds() > before  # the root and the shards used stay open
    fs.close()
    assert open_fds() == before
    with pytest.raises(StorageUnavailableError):
        fs.get_into(keys_for("a", 1), empty(1))
    gc_fs = FileStorage(tmp_path / "b")
    gc_fs.put(keys_for("b", 20), pages(20))
    del gc_fs  # released when collected, without close()
    assert open_fds() == before


def test_a_put_that_blows_up_leaves_no_name_marked_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not an I/O failure (those fail pages, not the put): the exception propagates, and
    the names it was writing are not left marked as being written in place, so the next
    put of the same keys writes them in place again and nothing is stored twice."""
    fs = FileStorage(tmp_path)
    keys = keys_for("blow", 3)

    def broken(*args: object) -> list[int]:
        raise RuntimeError("bug in the writer")

    with monkeypatch.context() as mp:
        mp.setattr(page_file, "write_named", broken)
        with pytest.raises(RuntimeError, match="bug in the writer"):
            fs.put(keys, pages(3))
    assert not fs._writing and fs.exists(keys) == [False] * 3
    calls: list[int] = []
    real = page_file.write_named

    def counting(fds: list[int], names: list[str], *rest: Any) -> list[int]:
        calls.append(len(names))
        return real(fds, names, *rest)

    monkeypatch.setattr(page_file, "write_named", counting)
    assert fs.put(keys, pages(3)) == [True] * 3
    assert calls == [3]  # all three in place, in one group
    assert sorted(stored_keys(tmp_path)) == sorted(keys)
    assert not list(tmp_path.rglob("*.tmp"))


@pytest.mark.parametrize("policy", ["never", "data"])
def test_a_page_deleted_behind_its_back_can_be_stored_again(tmp_path: Path, policy: str) -> None:
    """A page file deleted by someone else (an operator, a cleaner) is a miss at its next
    read, and a later put of the same key stores it again.  The read used to leave the name
    marked as being unlinked by nobody, so every later put of that key waited forever (found
    by the stress oracle over a damaged directory); the put runs in a thread with a bound."""
    fs = FileStorage(tmp_path, fsync=policy)  # type: ignore[arg-type]
    keys, src = keys_for("gone", 3), pages(3)
    assert fs.put(keys, src) == [True] * 3
    fs.path_of(keys[1]).unlink()
    assert fs.get_into(keys, empty(3)) == [True, False, True]
    assert fs.exists(keys) == [True, False, True]
    got: list[list[bool]] = []
    worker = threading.Thread(target=lambda: got.append(fs.put(keys, src)), daemon=True)
    worker.start()  # a daemon: a hung put must not keep the test process alive
    worker.join(timeout=10)
    assert not worker.is_alive(), "the re-put of a page deleted behind its back hung"
    assert got == [[True] * 3]
    dst = empty(3)
    assert fs.get_into(keys, dst) == [True] * 3
    assert [payload(b) for b in dst] == [payload(b) for b in src]
    assert sorted(stored_keys(tmp_path)) == sorted(keys)


def _damage_key_bytes(path: Path) -> None:
    """Overwrite the first byte of the key recorded in a page file with 0xFF (not UTF-8)."""
    data = bytearray(path.read_bytes())
    data[page_file.HEADER.size] = 0xFF
    path.write_bytes(bytes(data))


def test_a_header_whose_key_is_not_utf8_does_not_stop_open(tmp_path: Path) -> None:
    """Start-up reads every header for its parent: a key damaged into bytes that are not
    UTF-8 made ``open`` raise ``UnicodeDecodeError``.  Now the page is indexed, a miss at
    its first read (deleted), and the others are served."""
    fs = FileStorage(tmp_path)
    keys, src = keys_for("u8", 3), pages(3)
    assert fs.put(keys, src) == [True] * 3
    fs.close()
    _damage_key_bytes(fs.path_of(keys[0]))
    again = FileStorage(tmp_path)
    assert again.get_into(keys, empty(3)) == [False, True, True]
    assert sorted(stored_keys_lenient(tmp_path)) == sorted(keys[1:])


def test_evicting_a_page_whose_key_is_damaged_keeps_puts_going(tmp_path: Path) -> None:
    """Eviction reads each victim's key from its header to report it.  A key that is not
    UTF-8 raised out of the put and left the victims marked as being unlinked, so the next
    put of those names waited forever.  Now the damaged page is evicted without being
    reported (its recorded key is not its own), and later puts of every key run."""
    fs = FileStorage(tmp_path, capacity_bytes=3 * file_size(keys_for("ev", 1)[0]))
    keys, src = keys_for("ev", 5), pages(5)
    assert fs.put(keys[:3], src[:3]) == [True] * 3
    _damage_key_bytes(fs.path_of(keys[0]))
    assert fs.put(keys[3:4], src[3:4]) == [True]  # evicts keys[0], the least recent
    assert fs.take_evicted() == []  # its header no longer names it
    got: list[list[bool]] = []
    worker = threading.Thread(target=lambda: got.append(fs.put(keys, src)), daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "a put after evicting a damaged page hung"
    assert len(got) == 1 and sum(fs.exists(keys)) == 3
    assert not list(tmp_path.rglob("*.tmp"))


def stored_keys_lenient(root: Path) -> list[str]:
    """Like ``stored_keys``, skipping files whose key is not UTF-8."""
    out = []
    for path in sorted(root.rglob("*.kv")):
        data = path.read_bytes()
        _, n, _ = struct.unpack_from("<4sI20s", data)
        with contextlib.suppress(UnicodeDecodeError):
            out.append(data[28 : 28 + n].decode("utf-8"))
    return out


def test_a_put_counts_each_page_once_whatever_repeats_and_sizes_it_holds(tmp_path: Path) -> None:
    """A key twice in one put, stored at the first one's size: the first is skipped, the
    second (another slot size: not that page) rewritten, each counted once; repeats of an
    absent key ride along with their first occurrence; a put of only present pages writes
    nothing.  (The count of a present page whose key repeated at another size was taken
    twice: failed pages came out negative.)"""
    fs = FileStorage(tmp_path)
    (k,) = keys_for("dup", 1)
    a, b = keys_for("dup", 2, start=1)
    assert fs.put([k], pages(1)) == [True]
    wide = pages(1, slot=2 * SLOT)
    got = fs.put([k, k, a, a, b], [pages(1)[0], wide[0], *pages(3, seed=2)])
    assert got == [True] * 5
    st = fs.statistics()
    assert (st.puts, st.put_ok, st.put_skipped, st.put_failed) == (6, 4, 2, 0)
    assert fs.put([a, b, a], pages(3, seed=2)) == [True] * 3
    st = fs.statistics()
    assert (st.puts, st.put_ok, st.put_skipped, st.put_failed) == (9, 4, 5, 0)
    assert sorted(stored_keys(tmp_path)) == sorted([k, a, b])


def test_puts_use_the_shard_table_once_every_shard_is_open(tmp_path: Path) -> None:
    """Once all 256 shard directories are open a put takes their descriptors from one table
    (no lookup a page); each page still lands in its own shard.  A close drops the table
    with the descriptors (numbers the system may hand to other files next)."""
    fs = FileStorage(tmp_path / "kv")
    by_shard: dict[str, list[str]] = {}
    i = 0
    while len(by_shard) < 256 or min(len(v) for v in by_shard.values()) < 2:
        key = f"k{i}"
        by_shard.setdefault(fs.path_of(key).parent.name, []).append(key)
        i += 1
    rounds = [[keys[r] for keys in by_shard.values()] for r in range(2)]
    assert fs.put(rounds[0], pages(256)) == [True] * 256  # every shard opened
    assert fs.put(rounds[1], pages(256, seed=1)) == [True] * 256  # through the table
    for r, keys in enumerate(rounds):
        assert all(fs.path_of(k).is_file() for k in keys)
        got = empty(256)
        assert fs.get_into(keys, got) == [True] * 256
        want = [bytes(b.view)[:-FRAME_OVERHEAD] for b in pages(256, seed=r)]
        assert [bytes(b.view)[:-FRAME_OVERHEAD] for b in got] == want
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kv"]
    dirs = safe_fs.ShardDirs(str(tmp_path / "kv"))
    dirs.open_root()
    names = [f"{n:02x}" for n in range(256)]
    for name in names[:-1]:
        dirs.get(name)
    assert dirs.table() is None  # one shard not open yet
    last = dirs.get(names[-1])
    table = dirs.table()
    assert table is not None and table[255] == last and len(set(table)) == 256
    dirs.close()
    assert dirs.table() is None
    dirs.open_root()
    dirs.get("00")
    assert dirs.table() is None  # the old numbers are gone with the close
    dirs.close()
