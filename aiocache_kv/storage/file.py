"""``FileStorage``: the embedded default L3 backend, one file per page in a local directory.

Layout.  ``{root}/{nn}/{name}.kv`` where ``name`` is the hex BLAKE2b-160 of the UTF-8 key and
``nn`` its first two hex digits (256 shard directories made at open).  Whatever the key
(``"../../etc/passwd"``, ``"/abs"``, NUL bytes, 1 KiB of text) the file name is 40 hex digits,
so no key can escape the directory.  A file is ``b"AKVF" | u32 key_len | key | slot`` where the
slot is the framed page (payload + integrity trailer, see :mod:`.integrity`).  The stored key is
compared on read, so a hash collision or a misplaced file is a miss, and tests can list the
files and read back the raw keys.

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
their writes / right after their reads, while the bytes are still in cache.

Durability (``fsync``):

* ``"never"`` (default): no fsync, pages written in place.  After a power loss or a crash a
  page may be missing or torn; a torn page fails the integrity check and is a miss.  Right for
  a cache.
* ``"data"``: fsync the temporary file before the rename: a page that is visible after a crash
  has its full content.
* ``"always"``: ``"data"`` plus fsync of the shard directory after the rename: a put that
  returned ``True`` survives a crash.

Capacity.  ``capacity_bytes`` bounds the sum of file sizes.  Eviction is LRU by access order
(a put or a verified ``get_into`` hit is an access; ``exists`` is not).  The order is kept in
memory and rebuilt from file modification times at open (accesses of an earlier run that were
reads are therefore not remembered).  A page larger than the capacity is refused (``False``).
A corrupt page is deleted when detected so that a later put can store it again.

Links and special files (see :mod:`.safe_fs`).  No symbolic link is ever followed and only
regular files are pages: the root must be a real directory (its parents may be links); shards
and pages are opened relative to their directory's descriptor with ``O_NOFOLLOW``, pages with
``O_NONBLOCK`` then checked with ``fstat``.  A link, FIFO, socket, device or directory named
like a page is a miss, never read, written or deleted through, nor waited on; a put of its key
replaces the name.  A link in place of a shard is replaced at open; one planted later fails.

Start-up and full disk.  :meth:`FileStorage.open` skips junk (links, non-regular files, a shard
that is not a directory: one ``storage.file.junk_skipped`` warning); a bad header is found at
its first read.  On a full file system (``ENOSPC``/``EDQUOT`` from the open probe or a write)
it runs read-only: reads are served, puts fail per page (``False``, ``put_failed``, never
raised), :attr:`FileStorage.writable` is ``False`` (one ``storage.file.read_only`` warning)
until a write succeeds again.

One ``FileStorage`` (one process) owns a directory: it is the only writer and its in-memory
index decides hits.  All methods are thread-safe (an index lock; file I/O outside the lock).
It holds one descriptor for the root and one per shard directory it has used, released by
:meth:`FileStorage.close` (or when it is garbage-collected).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import itertools
import os
import threading
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

import torch

from aiocache_kv.errors import ConfigError, StorageUnavailableError
from aiocache_kv.logs import get_logger
from aiocache_kv.storage import integrity, page_file, safe_fs
from aiocache_kv.storage.base import PageBuffer, StatsCounter, StorageStats, leading_run
from aiocache_kv.storage.keys import check_keys

__all__ = ["FileStorage", "FsyncPolicy"]

log = get_logger(__name__)

FsyncPolicy = Literal["never", "data", "always"]
_FSYNC_POLICIES = ("never", "data", "always")
_SUFFIX = ".kv"
_TMP_SUFFIX = ".tmp"
_NAME_LEN = 40  # hex digits of BLAKE2b-160
_SHARDS = [f"{i:02x}" for i in range(256)]
#: pages are sealed / verified in groups of about this many bytes, each group right before its
#: files are written / right after they are read, so the checksum reads bytes still in cache
_CHUNK_BYTES = 4 << 20


@functools.lru_cache(maxsize=1 << 14)  # a prefetch hashes its keys for exists, then for reads
def _file_name(key: str) -> str:
    return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=20).hexdigest()


def _is_page_name(name: str) -> bool:
    return name.endswith(_SUFFIX) and len(name) == _NAME_LEN + len(_SUFFIX)


def _chunks(idx: list[int], buffers: Sequence[PageBuffer]) -> list[list[int]]:
    """Split ``idx`` into consecutive groups of about :data:`_CHUNK_BYTES` of slots."""
    out: list[list[int]] = []
    cur: list[int] = []
    nbytes = 0
    for i in idx:
        cur.append(i)
        nbytes += buffers[i].nbytes
        if nbytes >= _CHUNK_BYTES:
            out.append(cur)
            cur = []
            nbytes = 0
    if cur:
        out.append(cur)
    return out


class FileStorage:
    """Pages as files under ``path``; see the module docstring for layout and policies.

    Construction only validates arguments (no I/O, safe on the event loop); :meth:`open`
    (called lazily by every method) creates the directory, checks it is writable and rebuilds
    the LRU index.  :attr:`writable` is ``False`` while the file system is full.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int | None = None,
        fsync: FsyncPolicy = "never",
    ) -> None:
        """Raises:
        ConfigError: ``capacity_bytes`` not a positive int, or unknown ``fsync`` policy.
        """
        if capacity_bytes is not None and (
            isinstance(capacity_bytes, bool)
            or not isinstance(capacity_bytes, int)
            or capacity_bytes <= 0
        ):
            raise ConfigError(
                f"capacity_bytes must be a positive int or None, got {capacity_bytes!r}"
            )
        if fsync not in _FSYNC_POLICIES:
            raise ConfigError(f"fsync must be one of {_FSYNC_POLICIES}, got {fsync!r}")
        self.root = Path(path)
        self._root_str = os.fspath(self.root)
        self._pid = os.getpid()
        self._seq = itertools.count()
        self.capacity_bytes = capacity_bytes
        self.fsync: FsyncPolicy = fsync
        self._lock = threading.Lock()
        self._open_lock = threading.Lock()
        self._lru: collections.OrderedDict[str, int] = collections.OrderedDict()  # name -> size
        self._writing: set[str] = set()  # names being written in place (not yet in _lru)
        self._total = 0
        self._opened = False
        self._closed = False
        self._active = 0  # calls using the directory descriptors (close releases them at 0)
        self._writable = True
        self._dirs = safe_fs.ShardDirs(self._root_str)
        weakref.finalize(self, self._dirs.close)
        self._stats = StatsCounter()

    def __repr__(self) -> str:
        return (
            f"FileStorage(path={str(self.root)!r}, pages={len(self._lru)}, "
            f"bytes={self._total}, capacity_bytes={self.capacity_bytes}, fsync={self.fsync!r})"
        )

    # -- lifecycle ---------------------------------------------------------------------------

    def open(self) -> None:
        """Create the directory tree, probe writability, rebuild the index (idempotent).

        Junk in the directory (links, FIFOs, directories named like pages, a shard that is not
        a directory) is skipped with one ``storage.file.junk_skipped`` warning; a full file
        system opens read-only (see :attr:`writable`).

        Raises:
            StorageUnavailableError: the storage was closed, or the directory cannot be created
                or written (permissions, a path under a regular file, read-only filesystem), or
                it is a symbolic link.
        """
        with self._open_lock:
            if self._closed:
                raise StorageUnavailableError(f"FileStorage at {self.root} is closed")
            if self._opened:
                return
            try:
                self._dirs.open_root()
                try:
                    self._dirs.probe_write(f".probe-{self._pid}-{next(self._seq)}{_TMP_SUFFIX}")
                except OSError as exc:
                    if exc.errno not in safe_fs.NO_SPACE:
                        raise
                    self._set_writable(False, f"{type(exc).__name__}: {exc}")
            except OSError as exc:
                self._dirs.close()
                raise StorageUnavailableError(
                    f"FileStorage directory {self._root_str!r} is not usable: {exc}"
                ) from exc
            recreated, broken = self._dirs.prepare(_SHARDS)
            junk = self._rebuild_index()
            if junk or recreated or broken:
                log.warning(
                    "storage.file.junk_skipped",
                    path=self._root_str,
                    count=len(junk) + len(broken),
                    sample=junk[:3],
                    shards_recreated=recreated,
                    shards_unusable=broken,
                )
            self._opened = True
            log.info(
                "storage.file.open",
                path=self._root_str,
                pages=len(self._lru),
                bytes=self._total,
                writable=self._writable,
            )

    def _rebuild_index(self) -> list[str]:
        """Index the regular page files of every shard; return what was skipped as junk."""
        scan = self._dirs.scan(_SHARDS, _is_page_name, _TMP_SUFFIX)
        found = sorted((st.st_mtime_ns, n[: -len(_SUFFIX)], st.st_size) for _, n, st in scan.files)
        with self._lock:
            self._lru.clear()
            self._total = 0
            for _, name, size in found:
                self._lru[name] = size
                self._total += size
            victims = self._pick_victims_locked()
        self._unlink_victims(victims)
        if scan.stale:
            log.info("storage.file.stale_temp_removed", path=self._root_str, count=scan.stale)
        return scan.junk

    def close(self) -> None:
        """Mark the storage closed (idempotent); later calls raise ``StorageUnavailableError``.

        The directory descriptors are released now, or by the last call still running.
        """
        with self._open_lock:
            self._closed = True
            self._active += 1  # leave like a call: the last one out releases the descriptors
        self._leave()

    @property
    def writable(self) -> bool:
        """``False`` while the file system is full (read-only mode: reads served, puts fail)."""
        return self._writable

    def _set_writable(self, writable: bool, reason: str | None = None) -> None:
        with self._lock:
            changed = self._writable != writable
            self._writable = writable
        if changed and writable:
            log.info("storage.file.writable", path=self._root_str)
        elif changed:
            msg = "file system full: reads are served, puts fail until a write succeeds"
            log.warning("storage.file.read_only", path=self._root_str, reason=reason, detail=msg)

    def register_buffer(self, tensor: torch.Tensor) -> None:
        """No-op: file I/O needs no registration."""

    def statistics(self) -> StorageStats:
        """Frozen snapshot of the counters."""
        return self._stats.snapshot()

    def total_bytes(self) -> int:
        """Sum of the sizes of the stored files (what the capacity bounds)."""
        with self._lock:
            return self._total

    def lru_order(self) -> list[str]:
        """File names (hex, without suffix), least recently used first (tests / debugging)."""
        with self._lock:
            return list(self._lru)

    def path_of(self, key: str) -> Path:
        """The file that holds ``key`` (whether or not it exists)."""
        name = _file_name(key)
        return self.root / name[:2] / (name + _SUFFIX)

    @contextlib.contextmanager
    def _in_use(self) -> Iterator[None]:
        """Open if needed and keep the directory descriptors alive for the call (see close)."""
        if not self._opened:
            self.open()  # raises if closed
        with self._open_lock:
            if self._closed:
                raise StorageUnavailableError(f"FileStorage at {self.root} is closed")
            self._active += 1
        try:
            yield
        finally:
            self._leave()

    def _leave(self) -> None:
        with self._open_lock:
            self._active -= 1
            release = self._closed and not self._active
        if release:
            self._dirs.close()

    # -- queries -----------------------------------------------------------------------------

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Per key: present in the index.  Not an access for LRU.

        Raises:
            StorageKeyError: a malformed key.
            StorageUnavailableError: closed or unusable directory.
        """
        check_keys(keys)
        names = [_file_name(k) for k in keys]
        with self._in_use(), self._lock:
            return [n in self._lru for n in names]

    def leading_hits(self, keys: Sequence[str]) -> int:
        """Count of the leading run of present keys (raises as :meth:`exists`)."""
        return leading_run(self.exists(keys))

    # -- writes ------------------------------------------------------------------------------

    def put(self, keys: Sequence[str], buffers: Sequence[PageBuffer]) -> list[bool]:
        """Seal and store each slot; present keys are not rewritten (``True``, counted skipped).

        Raises:
            StorageKeyError: a malformed key.
            InvalidInputError: ``len(keys) != len(buffers)`` or a slot <= ``FRAME_OVERHEAD``.
            StorageUnavailableError: closed or unusable directory.
        """
        integrity.check_batch(keys, buffers)
        with self._in_use():
            return self._put(keys, buffers)

    def _put(self, keys: Sequence[str], buffers: Sequence[PageBuffer]) -> list[bool]:
        n = len(keys)
        results = [False] * n
        names = [_file_name(k) for k in keys]
        key_bytes = [k.encode("utf-8", "surrogatepass") for k in keys]
        first: dict[str, int] = {}  # absent name -> the index it is written from
        skipped = too_big = 0
        with self._lock:
            for i, name in enumerate(names):
                if name in self._lru:
                    self._lru.move_to_end(name)
                    results[i] = True
                    skipped += 1
                elif name not in first:
                    first[name] = i
        todo: list[int] = []
        for i in first.values():
            size = page_file.HEADER.size + len(key_bytes[i]) + buffers[i].nbytes
            if self.capacity_bytes is not None and size > self.capacity_bytes:
                too_big += 1
            else:
                todo.append(i)
        errors: list[tuple[str, str]] = []
        ok = written = no_space = 0
        writable: bool | None = None  # what the last write said about free space
        for chunk in _chunks(todo, buffers):
            integrity.seal_many([buffers[i] for i in chunk], [keys[i] for i in chunk])
            for i in chunk:
                name = names[i]
                with self._lock:
                    if name in self._lru:  # stored by another worker meanwhile
                        self._lru.move_to_end(name)
                        results[i] = True
                        skipped += 1
                        continue
                    in_place = self.fsync == "never" and name not in self._writing
                    if in_place:
                        self._writing.add(name)
                try:
                    size = self._write_file(key_bytes[i], name, buffers[i], in_place)
                except OSError as exc:
                    if in_place:
                        with self._lock:
                            self._writing.discard(name)
                    errors.append((keys[i], f"{type(exc).__name__}: {exc}"))
                    if exc.errno in safe_fs.NO_SPACE:
                        no_space += 1
                        writable = False
                    continue
                writable = True
                with self._lock:
                    if in_place:
                        self._writing.discard(name)
                    old = self._lru.pop(name, None)
                    if old is not None:
                        self._total -= old
                    self._lru[name] = size
                    self._total += size
                    victims = self._pick_victims_locked()
                self._unlink_victims(victims)
                ok += 1
                written += buffers[i].nbytes
                results[i] = True
        for i, name in enumerate(names):  # duplicates ride along with their first occurrence
            j = first.get(name, i)
            if j != i and results[j]:
                results[i] = True
                skipped += 1
        self._stats.add(
            puts=n,
            put_ok=ok,
            put_skipped=skipped,
            put_failed=n - ok - skipped,
            bytes_written=written,
        )
        if writable is not None:
            self._set_writable(writable, errors[-1][1] if errors else None)
        if too_big or len(errors) > no_space:  # a full disk is reported once, by read_only
            log.warning(
                "storage.file.put_failed",
                path=str(self.root),
                failed=len(errors),
                larger_than_capacity=too_big,
                first_error=errors[0][1] if errors else None,
                sample_keys=[k for k, _ in errors[:3]],
            )
        return results

    def _write_file(self, key_bytes: bytes, name: str, buf: PageBuffer, in_place: bool) -> int:
        """Write a sealed slot, in place or via a temporary file + rename (see module doc);
        return the file size.  On error nothing is left behind.  Never opens an existing name:
        a leftover of any kind (stale file, link, FIFO) is replaced by the rename."""
        dfd = self._dirs.get(name[:2])
        final = name + _SUFFIX
        header = page_file.header_for(key_bytes)
        fsync = self.fsync != "never"
        if in_place:
            try:
                return page_file.write_new(dfd, final, header, buf, fsync)
            except FileExistsError:
                pass
        tmp = f".{name}-{self._pid}-{threading.get_ident():x}-{next(self._seq)}{_TMP_SUFFIX}"
        total = page_file.write_new(dfd, tmp, header, buf, fsync)
        try:
            os.replace(tmp, final, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            safe_fs.unlink_quietly(tmp, dfd)
            raise
        if self.fsync == "always":
            os.fsync(dfd)
        return total

    def _pick_victims_locked(self) -> list[str]:
        victims: list[str] = []
        if self.capacity_bytes is None:
            return victims
        while self._total > self.capacity_bytes and len(self._lru) > 1:
            name, size = self._lru.popitem(last=False)
            self._total -= size
            victims.append(name)
        return victims

    def _unlink_page(self, name: str) -> None:
        """Delete the page file ``name`` (the name itself, never a link's target); quiet."""
        try:
            dfd = self._dirs.get(name[:2])
        except OSError:
            return
        safe_fs.unlink_quietly(name + _SUFFIX, dfd)

    def _unlink_victims(self, victims: list[str]) -> None:
        for name in victims:
            self._unlink_page(name)
        if victims:
            self._stats.add(evictions=len(victims), removed=len(victims))
            log.debug("storage.file.evicted", path=str(self.root), count=len(victims))

    def remove(self, keys: Sequence[str]) -> list[bool]:
        """Delete keys; per key ``True`` if it was present.

        Raises:
            StorageKeyError: a malformed key.
            StorageUnavailableError: closed or unusable directory.
        """
        check_keys(keys)
        with self._in_use():
            return self._remove(keys)

    def _remove(self, keys: Sequence[str]) -> list[bool]:
        results: list[bool] = []
        for key in keys:
            name = _file_name(key)
            results.append(self._forget(name))
            if results[-1]:
                self._unlink_page(name)
                self._stats.add(removed=1)
        return results

    # -- reads -------------------------------------------------------------------------------

    def get_into(self, keys: Sequence[str], buffers: Sequence[PageBuffer]) -> list[bool]:
        """Read each present key into its slot and verify it; corrupt pages are deleted.

        Raises:
            StorageKeyError: a malformed key.
            InvalidInputError: ``len(keys) != len(buffers)`` or a slot <= ``FRAME_OVERHEAD``.
            StorageUnavailableError: closed or unusable directory.
        """
        integrity.check_batch(keys, buffers)
        with self._in_use():
            return self._get_into(keys, buffers)

    def _get_into(self, keys: Sequence[str], buffers: Sequence[PageBuffer]) -> list[bool]:
        n = len(keys)
        results = [False] * n
        names = [_file_name(k) for k in keys]
        with self._lock:
            todo = [i for i, name in enumerate(names) if name in self._lru]
        misses = n - len(todo)
        hits = read_bytes = 0
        corrupt: list[tuple[str, integrity.Verdict]] = []
        io_errors: list[str] = []
        for chunk in _chunks(todo, buffers):
            read: list[int] = []  # read in full with the right header and size: checksum them
            for i in chunk:
                try:
                    verdict = self._read_file(keys[i], names[i], buffers[i])
                except FileNotFoundError:
                    self._forget(names[i])
                    misses += 1
                    continue
                except (safe_fs.NotRegularFileError, PermissionError):  # not a page: junk
                    self._drop(names[i], count=False)
                    misses += 1
                    continue
                except OSError as exc:
                    io_errors.append(f"{type(exc).__name__}: {exc}")
                    continue
                if verdict is None:
                    read.append(i)
                else:
                    corrupt.append((keys[i], verdict))
                    self._drop(names[i])
            verdicts = integrity.verify_many([buffers[i] for i in read], [keys[i] for i in read])
            good: list[str] = []
            for i, verdict in zip(read, verdicts, strict=True):
                if verdict is integrity.Verdict.OK:
                    results[i] = True
                    good.append(names[i])
                    hits += 1
                    read_bytes += buffers[i].nbytes
                else:
                    corrupt.append((keys[i], verdict))
                    self._drop(names[i])
            with self._lock:
                for name in good:
                    if name in self._lru:
                        self._lru.move_to_end(name)
        self._stats.add(
            gets=n,
            hits=hits,
            misses=misses,
            corrupt=len(corrupt),
            get_failed=len(io_errors),
            bytes_read=read_bytes,
        )
        integrity.log_failures(f"file:{self.root}", corrupt)
        if io_errors:
            log.warning(
                "storage.file.read_failed",
                path=str(self.root),
                count=len(io_errors),
                first_error=io_errors[0],
            )
        return results

    def _read_file(self, key: str, name: str, buf: PageBuffer) -> integrity.Verdict | None:
        """Read the file of ``key`` into ``buf`` (see :func:`.page_file.read_into`)."""
        key_bytes = key.encode("utf-8", "surrogatepass")
        return page_file.read_into(self._dirs.get(name[:2]), name + _SUFFIX, key_bytes, buf)

    def _drop(self, name: str, count: bool = True) -> None:
        """Forget and delete a corrupt page (or junk named like one, not counted as removed)
        so that a later put can store it again."""
        if self._forget(name):
            self._unlink_page(name)
            if count:
                self._stats.add(removed=1)

    def _forget(self, name: str) -> bool:
        """Drop ``name`` from the index; whether it was there."""
        with self._lock:
            size = self._lru.pop(name, None)
            if size is not None:
                self._total -= size
        return size is not None
