"""One page file of ``FileStorage``: its format, writing a new one, reading one back.

A file is ``b"AKV3" | u32 key_len | parent (20 bytes) | key | slot`` (the slot being the
sealed page, see :mod:`.integrity`: its trailer binds the page's identity).  ``parent`` is the
20-byte name digest of the page this one depends on (all zero: none), so the index can
rebuild chains at start-up
(:func:`read_header`).  Files of earlier formats (``b"AKVF"``: no parent; ``b"AKV2"``: a
trailer without the page identity, keys with 64-bit page hashes) read as ``BAD_MAGIC``: a
miss, deleted at first read.  Both directions take a directory descriptor and
one name component and go through :mod:`.safe_fs`: a new file is created with
``O_EXCL | O_NOFOLLOW`` (never an existing name), a read opens a regular file only, without
following a link or blocking.

Writes are atomic for readers: a page becomes visible (enters the in-memory index that decides
hits) only once its file is complete.  With ``fsync="never"`` the file is written in place (one
``open`` + ``writev`` + ``close``, no rename: ~15 us less per page on tmpfs) while the name is
marked as being written, so no other worker writes or reads it meanwhile (a second writer of the
same name falls back to the temporary file); with ``"data"``/``"always"`` (and for that
fallback) the page is written to a temporary file in the same shard directory and moved into
place with ``os.replace``.  Stale temporary files (a crash mid-write) are deleted at open; a
page torn by a crash mid in-place write fails the integrity check at its first read (a miss,
deleted).  Reads are one ``open`` + ``preadv`` (header, slot and one byte past the slot, which
checks the size) + ``close``; seal and verify run on groups of ~4 MiB of pages right before
their writes / right after their reads, while the bytes are still in cache.  With ``_pageio``
the verify's checksum is taken *during* the read (each 256 KiB piece summed as it lands), so
the verify reads only the trailer; a page whose host copy carries its sum (:mod:`.presum`) is
sealed without reading its payload.  Where the
``_pageio`` extension is built, a group's reads run in one C call with the GIL released once
(:data:`PAGEIO`): page by page, each of the four system calls gave the GIL up and waited to get
it back behind the event loop and the other workers, which doubled a small page's cost.

Durability (``fsync``):

* ``"never"`` (default): no fsync, pages written in place.  After a power loss or a crash a
  page may be missing or torn; a torn page fails the integrity check and is a miss.  Right for
  a cache.
* ``"data"``: fsync the temporary file before the rename: a page that is visible after a crash
  has its full content.
* ``"always"``: ``"data"`` plus fsync of the shard directory after the rename: a put that
  returned ``True`` survives a crash.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import hashlib
import os
import struct
from collections.abc import Callable, Sequence
from types import ModuleType

from aiocache_kv.extensions import optional_extension
from aiocache_kv.storage import integrity, safe_fs
from aiocache_kv.storage.base import PageBuffer

__all__ = [
    "CHUNK_BYTES",
    "HEADER",
    "MAGIC",
    "NO_PARENT",
    "SUFFIX",
    "TMP_SUFFIX",
    "ChunkRead",
    "chunks",
    "file_name",
    "header_for",
    "is_page_name",
    "names_of",
    "read_chunk",
    "read_header",
    "read_into",
    "write_named",
    "write_new",
    "write_page",
]

SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
_SUFFIX_B = SUFFIX.encode()
_NAME_LEN = 40  # hex digits of BLAKE2b-160
_SHARDS = 256  # directories, by a name's first two hex digits
#: pages are sealed / verified in groups of about this many bytes, each group right before its
#: files are written / right after they are read, so the checksum reads bytes still in cache
CHUNK_BYTES = 4 << 20
HEADER = struct.Struct("<4sI20s")
MAGIC = b"AKV3"
NO_PARENT = bytes(20)


@functools.lru_cache(maxsize=1 << 14)  # a prefetch hashes its keys for exists, then for reads
def file_name(key: str) -> str:
    """The file name (40 hex digits, without suffix) of ``key``: BLAKE2b-160 of its UTF-8."""
    return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=20).hexdigest()


def names_of(key_bytes: Sequence[bytes]) -> list[str]:
    """:func:`file_name` of each key, given as its UTF-8 bytes."""
    blake2b = hashlib.blake2b
    return [blake2b(kb, digest_size=20).hexdigest() for kb in key_bytes]


def is_page_name(name: str) -> bool:
    """Whether a directory entry is named like a page file."""
    return name.endswith(SUFFIX) and len(name) == _NAME_LEN + len(SUFFIX)


def chunks(idx: list[int], buffers: Sequence[PageBuffer]) -> list[list[int]]:
    """Split ``idx`` into consecutive groups of about :data:`CHUNK_BYTES` of slots."""
    out: list[list[int]] = []
    cur: list[int] = []
    nbytes = 0
    for i in idx:
        cur.append(i)
        nbytes += buffers[i].nbytes
        if nbytes >= CHUNK_BYTES:
            out.append(cur)
            cur = []
            nbytes = 0
    if cur:
        out.append(cur)
    return out


def header_for(key_bytes: bytes, parent: str | None = None) -> bytes:
    """The bytes that precede the slot in the file of ``key_bytes``; ``parent`` is the hex
    name (40 digits) of the page it depends on, if any."""
    digest = NO_PARENT if parent is None else bytes.fromhex(parent)
    return HEADER.pack(MAGIC, len(key_bytes), digest) + key_bytes


def read_header(dfd: int, fname: str, max_key: int) -> tuple[str | None, str | None]:
    """The key and the parent name recorded in file ``fname`` (``None`` for what is not there:
    no parent, another format, a key longer than ``max_key`` bytes or not UTF-8).

    Raises:
        FileNotFoundError, safe_fs.NotRegularFileError, OSError: as :func:`read_into`.
    """
    fd = safe_fs.open_regular(fname, dfd)
    try:
        head = os.pread(fd, HEADER.size + max_key, 0)
    finally:
        os.close(fd)
    if len(head) < HEADER.size:
        return None, None
    magic, key_len, digest = HEADER.unpack_from(head)
    if magic != MAGIC:
        return None, None
    parent = None if digest == NO_PARENT else digest.hex()
    if key_len > max_key or len(head) < HEADER.size + key_len:
        return None, parent
    try:
        key = head[HEADER.size : HEADER.size + key_len].decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:  # damaged: not a key anything could have written
        return None, parent
    return key, parent


def write_new(dfd: int, fname: str, header: bytes, slot: memoryview, fsync: bool) -> int:
    """Create ``fname`` in directory ``dfd`` holding ``header`` + ``slot`` (one ``writev``,
    continued after a short write; ``fsync`` before close if asked); return its size.

    Raises:
        FileExistsError: the name exists (of any kind, link included); it is left untouched.
        OSError: any other failure (e.g. ``ENOSPC``); the new file is removed first.
    """
    total = len(header) + slot.nbytes
    fd = os.open(fname, safe_fs.CREATE_FLAGS, 0o644, dir_fd=dfd)
    try:
        try:
            done = os.writev(fd, [header, slot])
            while done < total:  # short write: finish from where it stopped
                if done < len(header):
                    n = os.writev(fd, [header[done:], slot])
                else:
                    n = os.write(fd, slot[done - len(header) :])
                if not n:
                    raise OSError(errno.EIO, f"short write to {fname}")
                done += n
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        safe_fs.unlink_quietly(fname, dfd)
        raise
    return total


def write_named(
    shard_fds: list[int],
    names: list[str],
    keys: list[bytes],
    parents: list[str | None],
    slots: list[memoryview],
) -> list[int]:
    """Create the page files of a put, in place, as :func:`write_new` does without fsync;
    one result per page: the file size, or ``-errno`` (``-EEXIST``: the name exists and was
    left untouched; any other: nothing was left behind).  Page ``i`` is
    ``names[i] + SUFFIX`` in the shard directory ``shard_fds[int(names[i][:2], 16)]`` (a
    descriptor, or ``-errno`` for a shard that cannot be used: that page's result, nothing
    touched), holding :func:`header_for` ``(keys[i], parents[i])`` and ``slots[i]``.  Where
    ``_pageio`` is built one C call makes the names and headers too, with the GIL released
    once for the writes.

    Raises:
        TypeError, ValueError: malformed lists (a name or parent that is not 40 lowercase hex
            digits, a key that is not bytes, lengths that differ).
    """
    if PAGEIO is not None:
        return list(PAGEIO.write_named(shard_fds, _SUFFIX_B, names, keys, parents, slots))
    if len(shard_fds) != _SHARDS or not len(names) == len(keys) == len(parents) == len(slots):
        raise ValueError("write_named needs 256 shards and one key, parent and slot a name")
    for fd in shard_fds:
        if not isinstance(fd, int):
            raise TypeError(f"shard descriptors are ints, got {type(fd).__name__}")
    for i, name in enumerate(names):
        _check_hex_name("name", i, name)
        if parents[i] is not None:
            _check_hex_name("parent", i, parents[i])
        if not isinstance(keys[i], bytes):
            raise TypeError(f"key {i} must be bytes")
        memoryview(slots[i])  # TypeError: not a buffer
    out: list[int] = []
    for name, key, parent, slot in zip(names, keys, parents, slots, strict=True):
        dfd = shard_fds[int(name[:2], 16)]
        if dfd < 0:
            out.append(dfd)
            continue
        try:
            out.append(write_new(dfd, name + SUFFIX, header_for(key, parent), slot, False))
        except OSError as exc:
            out.append(-(exc.errno or errno.EIO))
    return out


def _check_hex_name(what: str, i: int, name: object) -> None:
    if not isinstance(name, str):
        raise TypeError(f"{what} {i} must be a str")
    if len(name.encode("utf-8", "surrogatepass")) != _NAME_LEN:
        raise ValueError(f"{what} {i} has {len(name)} characters, not {_NAME_LEN}")
    if not all(c in "0123456789abcdef" for c in name):
        raise ValueError(f"{what} {i} is not lowercase hex")


def write_page(
    dfd: int, name: str, header: bytes, buf: PageBuffer, in_place: bool, fsync: str, tmp: str
) -> int:
    """Write page ``name`` (without suffix) of directory ``dfd``: in place (``in_place``), or
    as the temporary file ``tmp`` moved into place; return the file size.  ``fsync``:
    ``"never"``, ``"data"`` (the file before the rename) or ``"always"`` (and the directory
    after it).  On error nothing is left behind.  Never opens an existing name: a leftover of
    any kind (stale file, link, FIFO) is replaced by the rename.

    Raises:
        OSError: the write failed (e.g. ``ENOSPC``).
    """
    final = name + SUFFIX
    sync = fsync != "never"
    if in_place:
        try:
            return write_new(dfd, final, header, buf.view, sync)
        except FileExistsError:
            pass
    total = write_new(dfd, tmp, header, buf.view, sync)
    try:
        os.replace(tmp, final, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        safe_fs.unlink_quietly(tmp, dfd)
        raise
    if fsync == "always":
        os.fsync(dfd)
    return total


def read_into(dfd: int, fname: str, key_bytes: bytes, buf: PageBuffer) -> integrity.Verdict | None:
    """Read file ``fname`` of directory ``dfd`` into ``buf`` with one ``preadv`` (header, slot,
    one byte to detect a longer file); a failing verdict, or ``None`` when the checksum is next.

    Raises:
        FileNotFoundError: no such file.
        safe_fs.NotRegularFileError: the name is a link, FIFO, socket, device or directory.
        OSError: any other read failure.
    """
    header = bytearray(HEADER.size + len(key_bytes))
    extra = bytearray(1)
    want = len(header) + buf.nbytes
    fd = safe_fs.open_regular(fname, dfd)
    try:
        got = os.preadv(fd, [header, buf.view, extra], 0)
        while got < want:  # short read: continue until EOF (a truncated file)
            if got < len(header):
                n = os.preadv(fd, [memoryview(header)[got:], buf.view, extra], got)
            else:
                n = os.preadv(fd, [buf.view[got - len(header) :], extra], got)
            if not n:
                break
            got += n
    finally:
        os.close(fd)
    return judge(header, got, want, key_bytes)


def judge(header: bytearray, got: int, want: int, key_bytes: bytes) -> integrity.Verdict | None:
    """What a read of ``got`` bytes (``want``: header and slot) says before the checksum: a
    failing verdict, or ``None`` when the header and the size are right."""
    if got < HEADER.size:
        return integrity.Verdict.BAD_LENGTH
    magic, key_len, _ = HEADER.unpack_from(header)
    if magic != MAGIC:
        return integrity.Verdict.BAD_MAGIC
    if key_len != len(key_bytes) or got < len(header) or header[HEADER.size :] != key_bytes:
        return integrity.Verdict.BAD_KEY
    if got != want:  # shorter (truncated) or longer (another slot size) than the slot
        return integrity.Verdict.BAD_LENGTH
    return None


#: the batched reader (``_pageio.c``), or ``None``: :func:`read_chunk` reads page by page
PAGEIO = optional_extension("aiocache_kv.storage._pageio")


@dataclasses.dataclass
class ChunkRead:
    """What :func:`read_chunk` found, as indices into the batch."""

    good: list[int] = dataclasses.field(default_factory=list)  #: read and verified
    gone: list[int] = dataclasses.field(default_factory=list)  #: no such file
    junk: list[int] = dataclasses.field(default_factory=list)  #: not a regular file / unreadable
    #: failed the header, length or checksum check
    corrupt: list[tuple[int, integrity.Verdict]] = dataclasses.field(default_factory=list)
    io_errors: list[str] = dataclasses.field(default_factory=list)  #: other read failures

    def fail(self, i: int, exc: OSError) -> None:
        """Page ``i`` could not be read: ``exc`` as :func:`read_into` raises it."""
        if isinstance(exc, FileNotFoundError):
            self.gone.append(i)
        elif isinstance(exc, (safe_fs.NotRegularFileError, PermissionError)):
            self.junk.append(i)
        else:
            self.io_errors.append(f"{type(exc).__name__}: {exc}")


def read_chunk(
    shard_fd: Callable[[str], int],
    keys: Sequence[str],
    names: Sequence[str],
    buffers: Sequence[PageBuffer],
    idents: Sequence[bytes],
    chunk: list[int],
    table: list[int] | None = None,
) -> ChunkRead:
    """Read pages ``chunk`` (indices into ``keys`` / ``names`` / ``buffers`` / ``idents``) and
    verify the ones read in full in one pass, each against its identity (see
    :mod:`.integrity`); ``shard_fd(shard)`` gives a shard's directory descriptor, ``table``
    (where given: every shard open, ``ShardDirs.table``) all of them at once.
    Nothing here touches an index: the caller applies the outcome."""
    out = ChunkRead()
    read: list[int] = []  # read in full with the right header and size: checksum them
    sums: dict[int, tuple[int, int, int]] = {}  # what the C reader summed as the bytes arrived
    if PAGEIO is not None and table is not None:  # names, headers and verdicts in C too
        _read_named(PAGEIO, table, keys, names, buffers, chunk, out, read, sums)
    elif PAGEIO is not None:  # one page too: the C read sums it as it lands (no second pass)
        _read_batch(PAGEIO, shard_fd, keys, names, buffers, chunk, out, read, sums)
    else:
        for i in chunk:
            name = names[i]
            try:
                key_bytes = keys[i].encode("utf-8", "surrogatepass")
                verdict = read_into(shard_fd(name[:2]), name + SUFFIX, key_bytes, buffers[i])
            except OSError as exc:
                out.fail(i, exc)
                continue
            if verdict is None:
                read.append(i)
            else:
                out.corrupt.append((i, verdict))
    verdicts = integrity.verify_many(
        [buffers[i] for i in read],
        [keys[i] for i in read],
        identities=[idents[i] for i in read],
        sums=[sums.get(i) for i in read] if sums else None,
    )
    for i, verdict in zip(read, verdicts, strict=True):
        if verdict is integrity.Verdict.OK:
            out.good.append(i)
        else:
            out.corrupt.append((i, verdict))
    return out


def _read_batch(
    pageio: ModuleType,
    shard_fd: Callable[[str], int],
    keys: Sequence[str],
    names: Sequence[str],
    buffers: Sequence[PageBuffer],
    chunk: list[int],
    out: ChunkRead,
    read: list[int],
    sums: dict[int, tuple[int, int, int]],
) -> None:
    """:func:`read_chunk`'s reads in one C call (the GIL released once for the batch), with
    the outcomes :func:`read_into` gives page by page; each page's checksum is taken as its
    bytes arrive (``sums``: the integrity pass fused into the read)."""
    todo: list[int] = []
    reads: list[tuple[int, bytes, bytearray, memoryview]] = []
    key_bytes: list[bytes] = []
    for i in chunk:
        try:
            dfd = shard_fd(names[i][:2])  # a shard that cannot be opened: as read_into fails
        except OSError as exc:
            out.fail(i, exc)
            continue
        kb = keys[i].encode("utf-8", "surrogatepass")
        todo.append(i)
        key_bytes.append(kb)
        reads.append(
            (dfd, (names[i] + SUFFIX).encode(), bytearray(HEADER.size + len(kb)), buffers[i].view)
        )
    results = pageio.read_pages(reads, True) if reads else []
    for i, kb, (_, _, header, _), (status, value, s1, s2, summed) in zip(
        todo, key_bytes, reads, results, strict=True
    ):
        if status != _READ_OK:
            _failed(out, i, status, value, names[i] + SUFFIX)
        else:
            verdict = judge(header, value, len(header) + buffers[i].nbytes, kb)
            if verdict is None:
                read.append(i)
                if summed:
                    sums[i] = (s1, s2, summed)
            else:
                out.corrupt.append((i, verdict))


def _read_named(
    pageio: ModuleType,
    table: list[int],
    keys: Sequence[str],
    names: Sequence[str],
    buffers: Sequence[PageBuffer],
    chunk: list[int],
    out: ChunkRead,
    read: list[int],
    sums: dict[int, tuple[int, int, int]],
) -> None:
    """:func:`_read_batch` where every shard is open: one C call that also makes each file
    name and header buffer and judges each header (:func:`judge`), so no step a page here
    but for what it found."""
    results = pageio.read_named(
        table,
        _SUFFIX_B,
        [names[i] for i in chunk],
        [keys[i].encode("utf-8", "surrogatepass") for i in chunk],
        [buffers[i].view for i in chunk],
    )
    for i, (status, value, s1, s2, summed) in zip(chunk, results, strict=True):
        if status == _READ_OK:
            read.append(i)
            if summed:
                sums[i] = (s1, s2, summed)
        elif status >= _JUDGED:
            out.corrupt.append((i, _JUDGED_AS[status - _JUDGED]))
        else:
            _failed(out, i, status, value, names[i] + SUFFIX)


def _failed(out: ChunkRead, i: int, status: int, value: int, fname: str) -> None:
    """Page ``i``'s read failed as a C reader reports it (``status``, ``value``): as
    :func:`read_into` raises it."""
    if status == _READ_MISSING:
        out.fail(i, FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), fname))
    elif status == _READ_NOT_REGULAR:
        out.fail(i, safe_fs.NotRegularFileError(errno.EINVAL, "not a regular file", fname))
    else:
        out.fail(i, OSError(value, os.strerror(value), fname))


#: ``_pageio.read_named`` statuses from 4 on: a header :func:`judge` refuses, as it says
_JUDGED = 4
_JUDGED_AS = (integrity.Verdict.BAD_LENGTH, integrity.Verdict.BAD_MAGIC, integrity.Verdict.BAD_KEY)

#: ``_pageio.read_pages`` statuses
_READ_OK, _READ_MISSING, _READ_NOT_REGULAR = 0, 1, 2
