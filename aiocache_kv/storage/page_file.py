"""One page file of ``FileStorage``: its format, writing a new one, reading one back.

A file is ``b"AKVF" | u32 key_len | key | slot`` (the slot being the sealed page, see
:mod:`.integrity`).  Both directions take a directory descriptor and one name component and go
through :mod:`.safe_fs`: a new file is created with ``O_EXCL | O_NOFOLLOW`` (never an existing
name), a read opens a regular file only, without following a link or blocking.
"""

from __future__ import annotations

import errno
import os
import struct

from aiocache_kv.storage import integrity, safe_fs
from aiocache_kv.storage.base import PageBuffer

__all__ = ["HEADER", "MAGIC", "header_for", "read_into", "write_new"]

HEADER = struct.Struct("<4sI")
MAGIC = b"AKVF"


def header_for(key_bytes: bytes) -> bytes:
    """The bytes that precede the slot in the file of ``key_bytes``."""
    return HEADER.pack(MAGIC, len(key_bytes)) + key_bytes


def write_new(dfd: int, fname: str, header: bytes, buf: PageBuffer, fsync: bool) -> int:
    """Create ``fname`` in directory ``dfd`` holding ``header`` + the slot (one ``writev``,
    continued after a short write; ``fsync`` before close if asked); return its size.

    Raises:
        FileExistsError: the name exists (of any kind, link included); it is left untouched.
        OSError: any other failure (e.g. ``ENOSPC``); the new file is removed first.
    """
    total = len(header) + buf.nbytes
    fd = os.open(fname, safe_fs.CREATE_FLAGS, 0o644, dir_fd=dfd)
    try:
        try:
            done = os.writev(fd, [header, buf.view])
            while done < total:  # short write: finish from where it stopped
                if done < len(header):
                    n = os.writev(fd, [header[done:], buf.view])
                else:
                    n = os.write(fd, buf.view[done - len(header) :])
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
    if got < HEADER.size:
        return integrity.Verdict.BAD_LENGTH
    magic, key_len = HEADER.unpack_from(header)
    if magic != MAGIC:
        return integrity.Verdict.BAD_MAGIC
    if key_len != len(key_bytes) or got < len(header) or header[HEADER.size :] != key_bytes:
        return integrity.Verdict.BAD_KEY
    if got != want:  # shorter (truncated) or longer (another slot size) than the slot
        return integrity.Verdict.BAD_LENGTH
    return None
