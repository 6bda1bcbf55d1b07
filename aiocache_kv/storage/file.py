"""``FileStorage``: the embedded default L3 backend, one file per page in a local directory.

Layout.  ``{root}/{nn}/{name}.kv`` where ``name`` is the hex BLAKE2b-160 of the UTF-8 key and
``nn`` its first two hex digits (256 shard directories made at open).  Whatever the key
(``"../../etc/passwd"``, ``"/abs"``, NUL bytes, 1 KiB of text) the file name is 40 hex digits,
so no key can escape the directory.  A file is ``b"AKVF" | u32 key_len | key | slot`` where the
slot is the framed page (payload + integrity trailer, see :mod:`.integrity`).  The stored key is
compared on read, so a hash collision or a misplaced file is a miss, and tests can list the
files and read back the raw keys.

Writes are atomic: the page is written to a temporary file in the same shard directory and
moved into place with ``os.replace``; readers see the old state or the whole new file.  Stale
temporary files (a crash mid-write) are deleted at open.

Durability (``fsync``):

* ``"never"`` (default): no fsync.  After a power loss a page may be missing or torn; a torn
  page fails the integrity check and is a miss.  Right for a cache.
* ``"data"``: fsync the temporary file before the rename: a page that is visible after a crash
  has its full content.
* ``"always"``: ``"data"`` plus fsync of the shard directory after the rename: a put that
  returned ``True`` survives a crash.

Capacity.  ``capacity_bytes`` bounds the sum of file sizes.  Eviction is LRU by access order
(a put or a verified ``get_into`` hit is an access; ``exists`` is not).  The order is kept in
memory and rebuilt from file modification times at open (accesses of an earlier run that were
reads are therefore not remembered).  A page larger than the capacity is refused (``False``).
A corrupt page is deleted when detected so that a later put can store it again.

One ``FileStorage`` (one process) owns a directory: it is the only writer and its in-memory
index decides hits.  All methods are thread-safe (an index lock; file I/O outside the lock).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import os
import struct
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import structlog
import torch

from aiocache_kv.errors import ConfigError, StorageUnavailableError
from aiocache_kv.storage import integrity
from aiocache_kv.storage.base import PageBuffer, StatsCounter, StorageStats, leading_run
from aiocache_kv.storage.keys import check_keys

__all__ = ["FileStorage", "FsyncPolicy"]

log = structlog.get_logger(__name__)

FsyncPolicy = Literal["never", "data", "always"]
_FSYNC_POLICIES = ("never", "data", "always")
_FILE_HEADER = struct.Struct("<4sI")
_FILE_MAGIC = b"AKVF"
_SUFFIX = ".kv"
_TMP_SUFFIX = ".tmp"
_NAME_LEN = 40  # hex digits of BLAKE2b-160


def _file_name(key: str) -> str:
    return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=20).hexdigest()


class FileStorage:
    """Pages as files under ``path``; see the module docstring for layout and policies.

    Construction only validates arguments (no I/O, safe on the event loop); :meth:`open`
    (called lazily by every method) creates the directory, checks it is writable and rebuilds
    the LRU index.
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
        self.capacity_bytes = capacity_bytes
        self.fsync: FsyncPolicy = fsync
        self._lock = threading.Lock()
        self._open_lock = threading.Lock()
        self._lru: collections.OrderedDict[str, int] = collections.OrderedDict()  # name -> size
        self._total = 0
        self._opened = False
        self._closed = False
        self._stats = StatsCounter()

    def __repr__(self) -> str:
        return (
            f"FileStorage(path={str(self.root)!r}, pages={len(self._lru)}, "
            f"bytes={self._total}, capacity_bytes={self.capacity_bytes}, fsync={self.fsync!r})"
        )

    # -- lifecycle ---------------------------------------------------------------------------

    def open(self) -> None:
        """Create the directory tree, probe writability, rebuild the index (idempotent).

        Raises:
            StorageUnavailableError: the storage was closed, or the directory cannot be created
                or written (permissions, a path under a regular file, read-only filesystem).
        """
        with self._open_lock:
            if self._closed:
                raise StorageUnavailableError(f"FileStorage at {self.root} is closed")
            if self._opened:
                return
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                fd, probe = tempfile.mkstemp(dir=self.root, prefix=".probe-", suffix=_TMP_SUFFIX)
                try:
                    os.write(fd, b"x")
                finally:
                    os.close(fd)
                    os.unlink(probe)
                for i in range(256):
                    (self.root / f"{i:02x}").mkdir(exist_ok=True)
            except OSError as exc:
                raise StorageUnavailableError(
                    f"FileStorage directory {str(self.root)!r} is not usable: {exc}"
                ) from exc
            self._rebuild_index()
            self._opened = True
            log.info(
                "storage.file.open", path=str(self.root), pages=len(self._lru), bytes=self._total
            )

    def _rebuild_index(self) -> None:
        found: list[tuple[int, str, int]] = []
        stale = 0
        for i in range(256):
            shard = self.root / f"{i:02x}"
            with os.scandir(shard) as it:
                for entry in it:
                    if entry.name.endswith(_TMP_SUFFIX):
                        with contextlib.suppress(OSError):
                            os.unlink(entry.path)
                        stale += 1
                        continue
                    stem = entry.name[: -len(_SUFFIX)]
                    if not entry.name.endswith(_SUFFIX) or len(stem) != _NAME_LEN:
                        continue
                    st = entry.stat()
                    found.append((st.st_mtime_ns, stem, st.st_size))
        found.sort()
        with self._lock:
            self._lru.clear()
            self._total = 0
            for _, name, size in found:
                self._lru[name] = size
                self._total += size
            victims = self._pick_victims_locked()
        self._unlink_victims(victims)
        if stale:
            log.info("storage.file.stale_temp_removed", path=str(self.root), count=stale)

    def close(self) -> None:
        """Mark the storage closed (idempotent); later calls raise ``StorageUnavailableError``."""
        with self._open_lock:
            self._closed = True

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

    def _ensure_open(self) -> None:
        if self._closed:
            raise StorageUnavailableError(f"FileStorage at {self.root} is closed")
        if not self._opened:
            self.open()

    # -- queries -----------------------------------------------------------------------------

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Per key: present in the index.  Not an access for LRU.

        Raises:
            StorageKeyError: a malformed key.
            StorageUnavailableError: closed or unusable directory.
        """
        check_keys(keys)
        self._ensure_open()
        names = [_file_name(k) for k in keys]
        with self._lock:
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
        self._ensure_open()
        results: list[bool] = []
        errors: list[tuple[str, str]] = []
        too_big = 0
        for key, buf in zip(keys, buffers, strict=True):
            name = _file_name(key)
            size = _FILE_HEADER.size + len(key.encode("utf-8", "surrogatepass")) + buf.nbytes
            with self._lock:
                if name in self._lru:
                    self._lru.move_to_end(name)
                    present = True
                else:
                    present = False
            if present:
                self._stats.add(puts=1, put_skipped=1)
                results.append(True)
                continue
            if self.capacity_bytes is not None and size > self.capacity_bytes:
                too_big += 1
                self._stats.add(puts=1, put_failed=1)
                results.append(False)
                continue
            try:
                self._write_file(key, name, buf)
            except OSError as exc:
                errors.append((key, f"{type(exc).__name__}: {exc}"))
                self._stats.add(puts=1, put_failed=1)
                results.append(False)
                continue
            with self._lock:
                old = self._lru.pop(name, None)
                if old is not None:
                    self._total -= old
                self._lru[name] = size
                self._total += size
                victims = self._pick_victims_locked()
            self._unlink_victims(victims)
            self._stats.add(puts=1, put_ok=1, bytes_written=buf.nbytes)
            results.append(True)
        if errors or too_big:
            log.warning(
                "storage.file.put_failed",
                path=str(self.root),
                failed=len(errors),
                larger_than_capacity=too_big,
                first_error=errors[0][1] if errors else None,
                sample_keys=[k for k, _ in errors[:3]],
            )
        return results

    def _write_file(self, key: str, name: str, buf: PageBuffer) -> None:
        integrity.seal(buf, key)
        shard = self.root / name[:2]
        key_bytes = key.encode("utf-8", "surrogatepass")
        fd, tmp = tempfile.mkstemp(dir=shard, prefix=f".{name}-", suffix=_TMP_SUFFIX)
        try:
            with os.fdopen(fd, "wb", buffering=0) as f:
                f.write(_FILE_HEADER.pack(_FILE_MAGIC, len(key_bytes)) + key_bytes)
                view = buf.view
                while view:
                    n = f.write(view)
                    if not n:
                        raise OSError(f"short write to {tmp}")
                    view = view[n:]
                if self.fsync != "never":
                    os.fsync(f.fileno())
            os.replace(tmp, shard / (name + _SUFFIX))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        if self.fsync == "always":
            dfd = os.open(shard, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    def _pick_victims_locked(self) -> list[str]:
        victims: list[str] = []
        if self.capacity_bytes is None:
            return victims
        while self._total > self.capacity_bytes and len(self._lru) > 1:
            name, size = self._lru.popitem(last=False)
            self._total -= size
            victims.append(name)
        return victims

    def _unlink_victims(self, victims: list[str]) -> None:
        for name in victims:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.root / name[:2] / (name + _SUFFIX))
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
        self._ensure_open()
        results: list[bool] = []
        for key in keys:
            name = _file_name(key)
            with self._lock:
                size = self._lru.pop(name, None)
                if size is not None:
                    self._total -= size
            if size is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.root / name[:2] / (name + _SUFFIX))
                self._stats.add(removed=1)
            results.append(size is not None)
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
        self._ensure_open()
        results: list[bool] = []
        corrupt: list[tuple[str, integrity.Verdict]] = []
        io_errors: list[str] = []
        for key, buf in zip(keys, buffers, strict=True):
            name = _file_name(key)
            with self._lock:
                present = name in self._lru
            if not present:
                self._stats.add(gets=1, misses=1)
                results.append(False)
                continue
            try:
                verdict = self._read_file(key, name, buf)
            except FileNotFoundError:
                self._forget(name)
                self._stats.add(gets=1, misses=1)
                results.append(False)
                continue
            except OSError as exc:
                io_errors.append(f"{type(exc).__name__}: {exc}")
                self._stats.add(gets=1, get_failed=1)
                results.append(False)
                continue
            if verdict is integrity.Verdict.OK:
                with self._lock:
                    if name in self._lru:
                        self._lru.move_to_end(name)
                self._stats.add(gets=1, hits=1, bytes_read=buf.nbytes)
                results.append(True)
            else:
                corrupt.append((key, verdict))
                self.remove([key])
                self._stats.add(gets=1, corrupt=1)
                results.append(False)
        integrity.log_failures(f"file:{self.root}", corrupt)
        if io_errors:
            log.warning(
                "storage.file.read_failed",
                path=str(self.root),
                count=len(io_errors),
                first_error=io_errors[0],
            )
        return results

    def _read_file(self, key: str, name: str, buf: PageBuffer) -> integrity.Verdict:
        path = self.root / name[:2] / (name + _SUFFIX)
        key_bytes = key.encode("utf-8", "surrogatepass")
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            header = f.read(_FILE_HEADER.size)
            if len(header) != _FILE_HEADER.size:
                return integrity.Verdict.BAD_LENGTH
            magic, key_len = _FILE_HEADER.unpack(header)
            if magic != _FILE_MAGIC:
                return integrity.Verdict.BAD_MAGIC
            if key_len != len(key_bytes) or f.read(key_len) != key_bytes:
                return integrity.Verdict.BAD_KEY
            if size - _FILE_HEADER.size - key_len != buf.nbytes:
                return integrity.Verdict.BAD_LENGTH
            view = buf.view
            got = 0
            while got < buf.nbytes:
                n = f.readinto(view[got:])
                if not n:
                    return integrity.Verdict.BAD_LENGTH  # truncated under us
                got += n
        return integrity.verify(buf, key)

    def _forget(self, name: str) -> None:
        with self._lock:
            size = self._lru.pop(name, None)
            if size is not None:
                self._total -= size
