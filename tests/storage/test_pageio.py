"""The batched C reader of page files (``_pageio.read_pages``) against the page-by-page Python
reader (``page_file.read_into``): the same outcome for every kind of entry a hostile or
crashed directory holds, and the same bytes in the slots."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from aiocache_kv.storage import FileStorage, PageBuffer, integrity, page_file, safe_fs
from aiocache_kv.storage.page_file import SUFFIX, file_name, read_chunk
from tests.storage.test_file_storage import SLOT, empty, keys_for, pages, payload


def _pageio() -> object:
    """The C reader; skipped where it was not built (a failure in CI: conftest.py)."""
    if page_file.PAGEIO is None:
        pytest.skip("aiocache_kv.storage._pageio not built (pip install -e . builds it)")
    return page_file.PAGEIO


def _hostile_store(tmp_path: Path) -> tuple[FileStorage, list[str]]:
    """Ten stored pages, then on disk: a missing one, a link to another page, a dangling
    link, a FIFO, a directory, a truncated file, a longer one, a bad magic, a bad key."""
    fs = FileStorage(tmp_path / "store", capacity_bytes=None)
    keys = keys_for("t", 10)
    assert all(fs.put(keys, pages(10, seed=3)))
    path = {k: tmp_path / "store" / file_name(k)[:2] / (file_name(k) + SUFFIX) for k in keys}
    path[keys[1]].unlink()  # missing
    path[keys[2]].unlink()
    path[keys[2]].symlink_to(path[keys[0]])  # a link to a good page: never followed
    path[keys[3]].unlink()
    path[keys[3]].symlink_to(tmp_path / "nowhere")  # dangling
    path[keys[4]].unlink()
    os.mkfifo(path[keys[4]])  # a FIFO: must not block
    path[keys[5]].unlink()
    path[keys[5]].mkdir()  # a directory
    with open(path[keys[6]], "r+b") as f:
        f.truncate(100)  # torn
    with open(path[keys[7]], "ab") as f:
        f.write(b"x")  # one byte longer than a slot
    with open(path[keys[8]], "r+b") as f:
        f.write(b"JUNK")  # bad magic
    data = path[keys[9]].read_bytes()
    path[keys[9]].write_bytes(data.replace(keys[9].encode(), keys[0].encode()))  # bad key
    return fs, keys


def _read(fs: FileStorage, keys: list[str], bufs: list[PageBuffer]) -> page_file.ChunkRead:
    names = [file_name(k) for k in keys]
    idents = [integrity.key_identity(k) for k in keys]  # as put bound them (no identity given)
    return read_chunk(fs._dirs.get, keys, names, bufs, idents, list(range(len(keys))))


def test_batched_reads_agree_with_page_by_page_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _pageio()
    fs, keys = _hostile_store(tmp_path)
    c_bufs = empty(len(keys))
    got_c = _read(fs, keys, c_bufs)
    monkeypatch.setattr(page_file, "PAGEIO", None)
    py_bufs = empty(len(keys))
    got_py = _read(fs, keys, py_bufs)
    assert got_c == got_py
    assert got_c.good == [0]
    assert got_c.gone == [1]
    assert sorted(got_c.junk) == [2, 3, 4, 5]
    assert sorted(i for i, _ in got_c.corrupt) == [6, 7, 8, 9]
    assert bytes(c_bufs[0].view) == bytes(py_bufs[0].view)  # the page and its trailer
    assert payload(c_bufs[0]) == payload(pages(10, seed=3)[0])
    assert all(len(b.view) == SLOT for b in c_bufs)


def test_read_pages_refuses_malformed_batches() -> None:
    pageio = _pageio()
    slot = bytearray(8)
    with pytest.raises(TypeError):
        pageio.read_pages((1, b"x", bytearray(1), slot))  # type: ignore[attr-defined]
    with pytest.raises(TypeError):
        pageio.read_pages([(1, "x", bytearray(1), slot)])  # type: ignore[attr-defined]
    with pytest.raises(ValueError):
        pageio.read_pages([(1, b"a\0b", bytearray(1), slot)])  # type: ignore[attr-defined]
    with pytest.raises(BufferError):  # a read-only slot
        pageio.read_pages([(1, b"x", bytearray(1), b"12345678")])  # type: ignore[attr-defined]
    assert pageio.read_pages([]) == []  # type: ignore[attr-defined]
    # a bad descriptor is a failure of that read, not of the batch
    ((status, err),) = pageio.read_pages([(-1, b"x", bytearray(1), slot)])  # type: ignore[attr-defined]
    assert status == 3 and err > 0


def test_a_shard_that_cannot_be_opened_reads_alike(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shard directory that is gone, a link, or unreadable: the same outcome per page from
    both readers (gone, junk, an I/O error), and the other pages still read."""
    _pageio()
    fs = FileStorage(tmp_path / "store", capacity_bytes=None)
    keys = keys_for("s", 6)
    assert all(fs.put(keys, pages(6, seed=5)))
    names = [file_name(k) for k in keys]
    failing = {
        names[1][:2]: FileNotFoundError(errno.ENOENT, "gone"),
        names[2][:2]: safe_fs.NotRegularFileError(errno.ELOOP, "a link"),
        names[3][:2]: OSError(errno.EIO, "broken"),
    }
    assert len({n[:2] for n in names}) == 6, "the pages must sit in six shards"

    def shard_fd(shard: str) -> int:
        if shard in failing:
            raise failing[shard]
        return fs._dirs.get(shard)

    def read() -> page_file.ChunkRead:
        idents = [integrity.key_identity(k) for k in keys]
        return read_chunk(shard_fd, keys, names, empty(6), idents, list(range(6)))

    got_c = read()
    monkeypatch.setattr(page_file, "PAGEIO", None)
    got_py = read()
    assert got_c == got_py
    assert (got_c.good, got_c.gone, got_c.junk) == ([0, 4, 5], [1], [2])
    assert len(got_c.io_errors) == 1 and "broken" in got_c.io_errors[0]


def _write_scene(root: Path) -> tuple[list[tuple[int, str, bytes, PageBuffer]], list[int]]:
    """Eight writes into one directory (its descriptor kept open): two new names, and a
    regular file, a link to another file, a dangling link, a FIFO and a directory named
    like the page, plus one into a directory removed under its descriptor."""
    root.mkdir()
    (root / "gone").mkdir()
    dfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    gone = os.open(root / "gone", os.O_RDONLY | os.O_DIRECTORY)
    os.rmdir(root / "gone")
    (root / "taken.kv").write_bytes(b"old page")
    (root / "target").write_bytes(b"not a page")
    (root / "link.kv").symlink_to(root / "target")
    (root / "dangling.kv").symlink_to(root / "nowhere")
    os.mkfifo(root / "fifo.kv")  # must neither block nor be written
    (root / "dir.kv").mkdir()
    names = ["a.kv", "b.kv", "taken.kv", "link.kv", "dangling.kv", "fifo.kv", "dir.kv", "x.kv"]
    bufs = pages(len(names), seed=9)
    writes = [
        (gone if n == "x.kv" else dfd, n, f"header-{n}".encode(), b)
        for n, b in zip(names, bufs, strict=True)
    ]
    return writes, [dfd, gone]


@pytest.mark.parametrize("writer", ["c", "python"])
def test_group_writes_create_only_new_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str
) -> None:
    """Both group writers (C, and the Python reference) give the same per-page results, the
    same bytes on disk, never write through a link or into an existing name of any kind,
    and leave nothing behind for a write that failed."""
    if writer == "c":
        _pageio()
    else:
        monkeypatch.setattr(page_file, "PAGEIO", None)
    root = tmp_path / "dir"
    writes, fds = _write_scene(root)
    try:
        got = page_file.write_group(writes)
    finally:
        for fd in fds:
            os.close(fd)
    size = len(b"header-a.kv") + SLOT
    assert got == [size, size] + [-errno.EEXIST] * 5 + [-errno.ENOENT]
    for name, header, buf in [(w[1], w[2], w[3]) for w in writes[:2]]:
        assert (root / name).read_bytes() == header + bytes(buf.view)
    assert (root / "taken.kv").read_bytes() == b"old page"
    assert (root / "target").read_bytes() == b"not a page"
    assert not (root / "nowhere").exists()
    assert (root / "link.kv").is_symlink() and (root / "dangling.kv").is_symlink()
    assert (root / "dir.kv").is_dir() and not list((root / "dir.kv").iterdir())
    assert sorted(p.name for p in root.iterdir()) == sorted(
        ["a.kv", "b.kv", "taken.kv", "target", "link.kv", "dangling.kv", "fifo.kv", "dir.kv"]
    )


def test_write_pages_refuses_malformed_batches(tmp_path: Path) -> None:
    pageio = _pageio()
    slot = bytearray(8)
    with pytest.raises(TypeError):
        pageio.write_pages((1, b"x", b"h", slot))  # type: ignore[attr-defined]
    with pytest.raises(TypeError):
        pageio.write_pages([(1, "x", b"h", slot)])  # type: ignore[attr-defined]
    with pytest.raises(ValueError):  # a NUL would cut the name short
        pageio.write_pages([(1, b"a\0b", b"h", slot)])  # type: ignore[attr-defined]
    with pytest.raises(TypeError):
        pageio.write_pages([(1, b"x", "h", slot)])  # type: ignore[attr-defined]
    assert pageio.write_pages([]) == []  # type: ignore[attr-defined]
    # a bad descriptor fails that write, not the batch
    assert pageio.write_pages([(-1, b"x", b"h", slot)]) == [-errno.EBADF]  # type: ignore[attr-defined]
    assert not list(tmp_path.iterdir())
