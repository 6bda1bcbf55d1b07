"""``FileStorage``: the embedded default L3 backend, one file per page in a local directory.

Layout.  ``{root}/{nn}/{name}.kv`` where ``name`` is the hex BLAKE2b-160 of the UTF-8 key and
``nn`` its first two hex digits (256 shard directories made at open).  Whatever the key
(``"../../etc/passwd"``, ``"/abs"``, NUL bytes, 1 KiB of text) the file name is 40 hex digits,
so no key can escape the directory.  A file holds its key, its parent's name and the framed
page (format: :mod:`.page_file`).  The stored key is compared on read, so a hash collision or a
misplaced file is a miss.

Writes are atomic for readers (a page enters the index only once its file is complete) and
durable as ``fsync`` asks (``"never"``, the default: written in place, no fsync, right for a
cache; ``"data"``; ``"always"``): see :mod:`.page_file`.

Capacity.  ``capacity_bytes`` bounds the sum of file sizes.  ``"auto"`` (the default) derives
the bound from the file system at open: at most :data:`AUTO_FRACTION` of its size, and always
leaving :data:`AUTO_RESERVE` of its size free for everything else, but never below what the
directory already holds (a node restarted on a full disk evicts nothing and serves what is
there).  ``None`` is unbounded.  Eviction is chain-aware (:mod:`.page_index`): a page records
the page it depends on (``put_chain``), and chain ends (pages no stored page depends on) go
first, least recently used among them, so what survives stays reachable by a prefetch.  A put
or a verified ``get_into`` hit is an access (a hit refreshes its ancestors too); ``exists`` is
not.  The order and the chains are rebuilt at open from modification times and the parents
recorded in the files.  A page larger than the capacity is refused (``False``); a page evicted
again by the put that wrote it reports ``False``; every other evicted key is reported once by
:meth:`FileStorage.take_evicted`.  A corrupt page is deleted when detected so that a later put
can store it again (unless it was stored again since the read: see ``get_into``); a page
indexed at another size than a put writes (torn by a crash, another slot size) is rewritten
by that put.

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
index decides hits.  Two live nodes share KV through Mooncake Store, not one directory; a
directory is shared across restarts (a fresh node indexes what the last one wrote).  All
methods are thread-safe (an index lock; file I/O outside the lock).  It holds one descriptor
for the root and one per shard directory it has used, released by :meth:`FileStorage.close`
(or when it is garbage-collected).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import re
import shutil
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
from aiocache_kv.storage.file_quota import tag_of_key
from aiocache_kv.storage.file_writes import FileWrites
from aiocache_kv.storage.keys import MAX_KEY_LEN, check_keys, check_tag
from aiocache_kv.storage.page_file import (
    SUFFIX,
    TMP_SUFFIX,
    chunks,
    file_name,
    is_page_name,
)
from aiocache_kv.storage.page_index import PageIndex

__all__ = ["AUTO_FRACTION", "AUTO_RESERVE", "FileStorage", "FsyncPolicy"]

log = get_logger(__name__)

FsyncPolicy = Literal["never", "data", "always"]
_FSYNC_POLICIES = ("never", "data", "always")
_SHARDS = [f"{i:02x}" for i in range(256)]
#: ``capacity_bytes="auto"``: at most this fraction of the file system's size ...
AUTO_FRACTION = 0.5
#: ... and always leave this fraction of it free
AUTO_RESERVE = 0.1
#: evicted keys kept for :meth:`FileStorage.take_evicted` (the oldest go first when nobody asks)
_EVICTED_KEPT = 1 << 16
#: the open probe's file in the root: ``.probe-{pid}-{instance:x}-{seq}.tmp`` (see open)
_PROBE = re.compile(r"\.probe-[0-9]+-[0-9a-f]+-[0-9]+" + re.escape(TMP_SUFFIX))


class FileStorage(FileWrites):
    """Pages as files under ``path``; see the module docstring for layout and policies.

    Construction only validates arguments (no I/O, safe on the event loop); :meth:`open`
    (called lazily by every method) creates the directory, checks it is writable and rebuilds
    the LRU index.  :attr:`writable` is ``False`` while the file system is full.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int | Literal["auto"] | None = "auto",
        fsync: FsyncPolicy = "never",
    ) -> None:
        """Raises:
        ConfigError: ``path`` not a non-empty ``str`` or ``os.PathLike`` of one (an empty
            path would mean the working directory) or holding a NUL, ``capacity_bytes`` not
            a positive int, ``"auto"`` or ``None``, or an unknown ``fsync`` policy.
        """
        root = path if isinstance(path, str) else None
        if isinstance(path, os.PathLike):
            spelled = os.fspath(path)
            root = spelled if isinstance(spelled, str) else None
        if root is None or not root or "\0" in root:
            raise ConfigError(
                f"path must be a non-empty str or os.PathLike without NUL, "
                f"got {type(path).__name__} {path!r}"
            )
        if (
            capacity_bytes is not None
            and capacity_bytes != "auto"
            and (
                isinstance(capacity_bytes, bool)
                or not isinstance(capacity_bytes, int)
                or capacity_bytes <= 0
            )
        ):
            raise ConfigError(
                f"capacity_bytes must be a positive int, 'auto' or None, got {capacity_bytes!r}"
            )
        if fsync not in _FSYNC_POLICIES:
            raise ConfigError(f"fsync must be one of {_FSYNC_POLICIES}, got {fsync!r}")
        self.root = Path(path)
        self._root_str = os.fspath(self.root)
        self._pid = os.getpid()
        self._seq = itertools.count()
        self._auto = capacity_bytes == "auto"
        #: the bound in bytes (``None``: unbounded, or ``"auto"`` before :meth:`open`)
        self.capacity_bytes: int | None = None if capacity_bytes == "auto" else capacity_bytes
        self.fsync: FsyncPolicy = fsync
        self._lock = threading.Lock()
        self._open_lock = threading.Lock()
        self._index = PageIndex()  # name -> size, parent, recency: see page_index
        #: names a put is writing (not indexed yet) and names dropped from the index whose
        #: files are not unlinked yet: a put of any of them waits (``_settled``) until that
        #: write or unlink ended, so one name has one writer and no unlink hits a new page
        self._writing: set[str] = set()
        self._deleting: set[str] = set()
        self._settled = threading.Condition(self._lock)
        self._evicted: collections.deque[str] = collections.deque(maxlen=_EVICTED_KEPT)
        self._opened = False
        self._closed = False
        self._active = 0  # calls using the directory descriptors (close releases them at 0)
        self._writable = True
        self._dirs = safe_fs.ShardDirs(self._root_str)
        weakref.finalize(self, self._dirs.close)
        self._stats = StatsCounter()

    def __repr__(self) -> str:
        return (
            f"FileStorage(path={str(self.root)!r}, pages={len(self._index)}, "
            f"bytes={self._index.total}, capacity_bytes={self.capacity_bytes}, "
            f"fsync={self.fsync!r})"
        )

    # -- lifecycle ---------------------------------------------------------------------------

    def open(self) -> None:
        """Create the directory tree, probe writability, rebuild the index (idempotent).

        Junk in the directory (links, FIFOs, directories named like pages, a shard that is not
        a directory) is skipped with one ``storage.file.junk_skipped`` warning; a full file
        system opens read-only (see :attr:`writable`).  Temporary files a crash left behind
        are deleted: those in the shards (a put's) and the regular files in the root named
        like the write probe (``.probe-<pid>-<hex>-<n>.tmp``; a link or directory of that name
        stays, no link is followed).

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
                probes = self._dirs.remove_stale(_PROBE.fullmatch)  # a crash mid-probe
                try:
                    # unique among the instances of this process on the same directory too
                    probe = f".probe-{self._pid}-{id(self):x}-{next(self._seq)}{TMP_SUFFIX}"
                    self._dirs.probe_write(probe)
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
            junk = self._rebuild_index(probes)
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
                pages=len(self._index),
                bytes=self._index.total,
                capacity_bytes=self.capacity_bytes,
                writable=self._writable,
            )

    def _rebuild_index(self, probes: int = 0) -> list[str]:
        """Index the regular page files of every shard with the parents their headers record,
        oldest first; resolve an ``"auto"`` capacity; return what was skipped as junk
        (``probes``: stale probe files :meth:`open` removed, logged with the temporary files)."""
        scan = self._dirs.scan(_SHARDS, is_page_name, TMP_SUFFIX)
        found = sorted((st.st_mtime_ns, n, st.st_size) for _, n, st in scan.files)
        index = PageIndex()
        for _, fname, size in found:
            name = fname[: -len(SUFFIX)]
            try:
                key, parent = page_file.read_header(self._dirs.get(name[:2]), fname, MAX_KEY_LEN)
            except OSError:
                key, parent = None, None  # unreadable now: its first read decides
            index.add(name, size, parent, None if key is None else tag_of_key(key))
        if self._auto:
            self.capacity_bytes = self._auto_capacity(index.total)
        with self._lock:
            self._index = index
            victims = self._pick_victims_locked()
        self._unlink_victims(victims)
        if scan.stale or probes:
            log.info(
                "storage.file.stale_temp_removed",
                path=self._root_str,
                count=scan.stale + probes,
                probes=probes,
            )
        return scan.junk

    def _auto_capacity(self, stored: int) -> int:
        """The ``"auto"`` bound: see the module docstring."""
        usage = shutil.disk_usage(self._root_str)
        room = min(usage.total * AUTO_FRACTION, stored + usage.free - usage.total * AUTO_RESERVE)
        return max(stored, int(room), 1)

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
            return self._index.total

    def lru_order(self) -> list[str]:
        """File names (``page_file.file_name`` of the keys), least recently used first."""
        with self._lock:
            return self._index.names()

    def check_index(self) -> None:
        """Assert the index's chain counts and total agree with its entries (tests)."""
        with self._lock:
            self._index.check()

    def take_evicted(self) -> list[str]:
        """The keys evicted for capacity since the last call, oldest first, each once (at most
        the last 65,536 when nobody asks).  Pages a put evicted again before it returned are
        not here: that put reported them ``False``."""
        with self._lock:
            out = list(self._evicted)
            self._evicted.clear()
        return out

    def path_of(self, key: str) -> Path:
        """The file that holds ``key`` (whether or not it exists)."""
        name = file_name(key)
        return self.root / name[:2] / (name + SUFFIX)

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
        names = page_file.names_of([k.encode("utf-8", "surrogatepass") for k in keys])
        with self._in_use(), self._lock:
            return [n in self._index for n in names]

    def leading_hits(self, keys: Sequence[str]) -> int:
        """Count of the leading run of present keys (raises as :meth:`exists`)."""
        return leading_run(self.exists(keys))

    def _unlink_page(self, name: str) -> None:
        """Delete the page file ``name`` (the name itself, never a link's target), dropped
        from the index by ``_forget`` or ``_pick_victims_locked``; quiet."""
        self._unlink_pages([name])

    def _unlink_pages(self, names: list[str]) -> None:
        try:
            self._dirs.unlink_files(names, SUFFIX)
        finally:
            with self._lock:
                self._deleting.difference_update(names)
                self._settled.notify_all()

    def _unlink_victims(self, victims: list[str], report: list[str] | None = None) -> None:
        """Delete evicted pages; the keys of ``report`` (default: all) are read from their
        headers first and kept for :meth:`take_evicted`."""
        gone: list[str] = []
        try:
            for name in victims if report is None else report:
                try:
                    key, _ = page_file.read_header(
                        self._dirs.get(name[:2]), name + SUFFIX, MAX_KEY_LEN
                    )
                except OSError:
                    key = None  # gone or junk meanwhile: nothing this cache can name
                if key is not None and file_name(key) == name:  # else damaged: not its key
                    gone.append(key)
        finally:  # the names are marked being deleted until this ran, whatever happened
            self._unlink_pages(victims)
        if gone:
            with self._lock:
                self._evicted.extend(gone)
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

    def remove_tag(self, tag: str) -> int:
        """Delete every page whose key is ``"{tag}/..."`` (a namespace's, whoever wrote it):
        each indexed file's header names its key.  Files are unlinked by name in their shard
        (never through a link); a page a put is still writing is not indexed yet and stays.
        Returns the pages deleted.

        Raises:
            StorageKeyError: ``tag`` is not a valid tag.
            StorageUnavailableError: closed or unusable directory.
        """
        prefix = check_tag(tag) + "/"
        with self._in_use():
            with self._lock:
                names = self._index.names()
            doomed: list[str] = []
            for name in names:
                try:
                    key, _ = page_file.read_header(
                        self._dirs.get(name[:2]), name + SUFFIX, MAX_KEY_LEN
                    )
                except OSError:
                    continue  # gone meanwhile, or junk: its first read decides
                if key is not None and key.startswith(prefix) and file_name(key) == name:
                    doomed.append(key)
            removed = sum(self._remove(doomed))
        log.info("storage.file.tag_removed", path=self._root_str, tag=tag, pages=removed)
        return removed

    def _remove(self, keys: Sequence[str]) -> list[bool]:
        results: list[bool] = []
        for key in keys:
            name = file_name(key)
            results.append(self._forget(name))
            if results[-1]:
                self._unlink_page(name)
                self._stats.add(removed=1)
        return results

    # -- reads -------------------------------------------------------------------------------

    def get_into(
        self,
        keys: Sequence[str],
        buffers: Sequence[PageBuffer],
        identities: Sequence[bytes] | None = None,
    ) -> list[bool]:
        """Read each present key into its slot and verify it (against ``identities``, see
        :mod:`.integrity`); corrupt pages and pages of another identity are deleted, and a
        page found gone is forgotten.  Files are read outside the index lock: what a read
        found is applied only if the key's index entry is still the one seen before the
        read, so a page removed and stored again meanwhile stays indexed and on disk (the
        read is a miss).

        Raises:
            StorageKeyError: a malformed key.
            InvalidInputError: ``len(keys) != len(buffers)``, a slot <= ``FRAME_OVERHEAD``, or
                a malformed identity.
            StorageUnavailableError: closed or unusable directory.
        """
        integrity.check_batch(keys, buffers)
        idents = integrity.identities_for(keys, identities)
        with self._in_use():
            return self._get_into(keys, buffers, idents)

    def _get_into(
        self, keys: Sequence[str], buffers: Sequence[PageBuffer], idents: list[bytes]
    ) -> list[bool]:
        n = len(keys)
        results = [False] * n
        names = page_file.names_of([k.encode("utf-8", "surrogatepass") for k in keys])
        with self._lock:  # the entry each read is planned against (see _forget)
            seen = list(map(self._index.generation, names))
        todo = [i for i in range(n) if seen[i] is not None]
        misses = n - len(todo)
        hits = read_bytes = 0
        corrupt: list[tuple[str, integrity.Verdict]] = []
        io_errors: list[str] = []
        for chunk in chunks(todo, buffers):
            got = page_file.read_chunk(
                self._dirs.get, keys, names, buffers, idents, chunk, self._dirs.table()
            )
            for i in got.gone:  # deleted behind our back: nothing left to unlink
                self._forget(names[i], unlinking=False, seen=seen[i])
            for i in got.junk:  # not a page: forgotten and deleted, not counted as removed
                self._drop(names[i], seen[i], count=False)
            for i, verdict in got.corrupt:
                corrupt.append((keys[i], verdict))
                self._drop(names[i], seen[i])
            misses += len(got.gone) + len(got.junk)
            io_errors += got.io_errors
            for i in got.good:
                results[i] = True
                read_bytes += buffers[i].nbytes
            hits += len(got.good)
            with self._lock:
                self._index.touch_run([names[i] for i in got.good])  # a hit keeps its chain
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

    def _drop(self, name: str, seen: int | None, count: bool = True) -> None:
        """Forget and delete a corrupt page (or junk named like one, not counted as removed)
        so that a later put can store it again; only if the index still holds entry ``seen``
        (``_forget``): a page stored again since the read stays, file and entry."""
        if self._forget(name, seen=seen):
            self._unlink_page(name)
            if count:
                self._stats.add(removed=1)

    def _forget(self, name: str, *, unlinking: bool = True, seen: int | None = None) -> bool:
        """Drop ``name`` from the index; whether it was there.  With ``unlinking`` the caller
        deletes the file next (``_unlink_page``): puts of the name wait until it has.

        With ``seen`` (a read's verdict, applied after reading outside the lock) only the
        entry of that generation (``PageIndex.generation``, taken when the read was planned)
        is dropped: if the page was removed, evicted or stored again meanwhile, the file on
        disk is not the one the read found (each such change, in this process, replaced the
        entry or marked the name, see ``_writing``/``_deleting``), so nothing is done."""
        with self._lock:
            if seen is not None and self._index.generation(name) != seen:
                return False
            if self._index.remove(name) is None:
                return False
            if unlinking:  # a mark nobody clears would stall every later put of the name
                self._deleting.add(name)
            return True
