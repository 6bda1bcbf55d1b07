"""FileStorage, round 5: a read that raced a remove and a put, torn pages found at a restart,
probe files left by a crash at open.

Each test replays one interleaving deterministically (a patched ``page_file.read_chunk`` runs
the other workers' steps at the point the race needs) or one crash's leftovers on disk.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from aiocache_kv.storage import FileStorage, PageBuffer, page_file
from tests.storage.test_file_storage import SLOT, empty, file_size, keys_for, pages, payload

Step = Callable[[], None]


def _race_reads(
    monkeypatch: pytest.MonkeyPatch, before: Step | None = None, after: Step | None = None
) -> list[int]:
    """Patch ``page_file.read_chunk`` so the first call runs ``before`` right before the
    reader opens its files (the index was already consulted) and ``after`` right after
    (before the reader applies what it found); return a list counting the calls."""
    real = page_file.read_chunk
    calls: list[int] = []

    def racing(*args: object, **kwargs: object) -> page_file.ChunkRead:
        calls.append(1)
        first = len(calls) == 1
        if first and before is not None:
            before()
        out = real(*args, **kwargs)  # type: ignore[arg-type]
        if first and after is not None:
            after()
        return out

    monkeypatch.setattr(page_file, "read_chunk", racing)
    return calls


def _assert_stored(fs: FileStorage, key: str, src: PageBuffer) -> None:
    """``key`` is indexed, counted, on disk with its size, and reads back as ``src``."""
    assert fs.exists([key]) == [True]
    assert fs.lru_order() == [fs.path_of(key).stem]
    assert fs.total_bytes() == file_size(key)
    assert fs.path_of(key).stat().st_size == file_size(key)
    fs.check_index()
    dst = empty(1)
    assert fs.get_into([key], dst) == [True]
    assert payload(dst[0]) == payload(src)


def _damage(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[200] ^= 0x5A  # in the payload: the checksum fails
    path.write_bytes(bytes(data))


# -- 1. a read applies what it found only to the page it read --------------------------------


@pytest.mark.parametrize("found", ["gone", "corrupt", "junk"])
def test_a_read_racing_a_remove_and_a_put_keeps_the_page_stored_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, found: str
) -> None:
    """The reader saw the key indexed; a remove dropped it and a put stored it again while
    the reader's files were read; the reader found the old file gone (unlinked), corrupt or
    junk (a FIFO).  It used to forget the name afterwards (and, corrupt or junk, unlink it):
    the new page was left un-indexed on disk (uncounted, never evicted) or deleted, although
    its put returned ``True``."""
    [key] = keys_for("race", 1)
    fs = FileStorage(tmp_path, capacity_bytes=10 * file_size(key))
    [old] = pages(1, seed=1)
    [new] = pages(1, seed=2)
    assert fs.put([key], [old]) == [True]
    path = fs.path_of(key)
    if found == "corrupt":
        _damage(path)
    elif found == "junk":
        path.unlink()
        os.mkfifo(path)
    restored: list[list[bool]] = []

    def remove() -> None:
        assert fs.remove([key]) == [True]

    def put_again() -> None:
        if found != "gone":
            remove()  # the reader has read the old file: now drop it
        restored.append(fs.put([key], [new]))

    calls = _race_reads(monkeypatch, before=remove if found == "gone" else None, after=put_again)
    assert fs.get_into([key], empty(1)) == [False]
    assert calls == [1] and restored == [[True]]
    monkeypatch.undo()
    _assert_stored(fs, key, new)
    assert sorted(p.stem for p in tmp_path.rglob("*.kv")) == [path.stem]


def test_a_stale_corrupt_read_does_not_delete_a_page_rewritten_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a restart a torn page is indexed; a reader reads it (corrupt) while a put of the
    key rewrites it: the reader must not forget or unlink the rewritten page."""
    [key] = keys_for("torn", 1)
    fs = FileStorage(tmp_path, capacity_bytes=None)
    [src] = pages(1, seed=3)
    assert fs.put([key], [src]) == [True]
    fs.close()
    os.truncate(fs.path_of(key), file_size(key) // 2)
    again = FileStorage(tmp_path, capacity_bytes=None)
    assert again.exists([key]) == [True]  # indexed with the size the scan found
    rewritten: list[list[bool]] = []
    _race_reads(monkeypatch, after=lambda: rewritten.append(again.put([key], [src])))
    assert again.get_into([key], empty(1)) == [False]
    assert rewritten == [[True]]
    monkeypatch.undo()
    _assert_stored(again, key, src)


# -- 2. a present key counts as stored only at the size this put writes -----------------------


@pytest.mark.parametrize("policy", ["never", "data"])
@pytest.mark.parametrize("damage", ["zero_length", "truncated", "other_slot_size"])
def test_a_put_after_a_restart_rewrites_a_page_of_the_wrong_size(
    tmp_path: Path, damage: str, policy: str
) -> None:
    """A crash mid-write (``fsync="never"``) leaves a zero-length or truncated file; a run
    with another slot size leaves a file of another size.  The restarted storage indexed it
    and a put of the key answered ``True`` (skipped) without rewriting it: every read missed."""
    [key] = keys_for("restart", 1)
    fs = FileStorage(tmp_path, capacity_bytes=None)
    slot = 2 * SLOT if damage == "other_slot_size" else SLOT
    assert fs.put([key], pages(1, seed=1, slot=slot)) == [True]
    fs.close()
    path = fs.path_of(key)
    if damage == "zero_length":
        os.truncate(path, 0)
    elif damage == "truncated":
        os.truncate(path, path.stat().st_size // 2)
    again = FileStorage(tmp_path, capacity_bytes=None, fsync=policy)  # type: ignore[arg-type]
    [src] = pages(1, seed=2)
    assert again.put([key], [src]) == [True]
    st = again.statistics()
    assert (st.put_ok, st.put_skipped, st.bytes_written) == (1, 0, SLOT)
    _assert_stored(again, key, src)
    assert again.put([key], [src]) == [True]  # now present at its size: skipped
    assert again.statistics().put_skipped == 1
    assert not list(tmp_path.rglob("*.tmp"))


def test_a_put_with_another_slot_size_rewrites_a_present_page(tmp_path: Path) -> None:
    """While running: a key stored with one slot size and put with another is rewritten
    (through a temporary file and a rename), not acknowledged as present."""
    [key] = keys_for("resize", 1)
    fs = FileStorage(tmp_path, capacity_bytes=None)
    assert fs.put([key], pages(1, seed=1, slot=2 * SLOT)) == [True]
    [src] = pages(1, seed=2)
    assert fs.put([key], [src]) == [True]
    assert fs.statistics().put_skipped == 0
    _assert_stored(fs, key, src)
    assert not list(tmp_path.rglob("*.tmp"))


def test_a_failed_rewrite_leaves_index_and_disk_agreeing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rewrite of a page of the wrong size that fails (a full disk) reports ``False`` and
    leaves neither the old file nor its index entry behind; a later put stores the page."""
    [key] = keys_for("full", 1)
    fs = FileStorage(tmp_path, capacity_bytes=None)
    assert fs.put([key], pages(1, seed=1)) == [True]
    fs.close()
    os.truncate(fs.path_of(key), 0)
    again = FileStorage(tmp_path, capacity_bytes=None)
    again.open()
    real = page_file.write_page

    def no_space(*args: object, **kwargs: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(page_file, "write_page", no_space)
    [src] = pages(1, seed=2)
    assert again.put([key], [src]) == [False]
    assert again.exists([key]) == [False] and again.total_bytes() == 0
    assert not list(tmp_path.rglob("*.kv")) and not list(tmp_path.rglob("*.tmp"))
    again.check_index()
    monkeypatch.setattr(page_file, "write_page", real)
    assert again.put([key], [src]) == [True]
    _assert_stored(again, key, src)


# -- 3. probe files left in the root by a crash at open are removed ---------------------------


def test_stale_probe_files_in_the_root_are_removed_at_open(tmp_path: Path) -> None:
    """A crash between the open probe's create and its unlink left ``.probe-*.tmp`` in the
    root for good (only the shards' temporary files were cleaned).  Now regular files named
    like a probe are removed at open; a link or a directory of that name, other files and
    whatever a link points to stay."""
    root = tmp_path / "kv"
    FileStorage(root).open()
    outside = tmp_path / "outside.tmp"
    outside.write_bytes(b"keep")
    (root / ".probe-4242-7f00deadbeef-0.tmp").write_bytes(b"x")
    (root / ".probe-17-abc-3.tmp").write_bytes(b"")
    (root / ".probe-1-a-0.tmp").symlink_to(outside)
    (root / ".probe-2-b-0.tmp").mkdir()
    (root / ".probe-notes.txt").write_bytes(b"keep")
    (root / "mine.tmp").write_bytes(b"keep")
    fs = FileStorage(root)
    fs.open()
    left = sorted(p.name for p in root.iterdir() if len(p.name) != 2)
    assert left == [".probe-1-a-0.tmp", ".probe-2-b-0.tmp", ".probe-notes.txt", "mine.tmp"]
    assert outside.read_bytes() == b"keep"
    assert fs.put(["k"], pages(1)) == [True]
