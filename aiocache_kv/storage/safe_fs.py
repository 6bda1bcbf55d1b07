"""No-follow, regular-files-only file access under one directory (used by ``FileStorage``).

Every name is resolved relative to a directory file descriptor, one component at a time, and
no symbolic link is ever followed: the root is opened with ``O_DIRECTORY | O_NOFOLLOW`` (its
parents may be links, the root itself may not), shard directories likewise relative to the
root's descriptor, files relative to their shard's descriptor with ``O_NOFOLLOW``.  A link
planted inside the tree, dangling or not, in place of a file or of a shard directory, is
therefore never written, read or deleted *through*: at worst the link itself is unlinked.

Files are opened with ``O_NONBLOCK`` (no effect on regular files) and checked with ``fstat``:
a FIFO, socket, device or directory in place of a file is :class:`NotRegularFileError`, never
a blocked ``open``.  New files are created with ``O_CREAT | O_EXCL``, so an existing name of
any kind (file, link, FIFO) is never opened for writing: the caller writes a fresh temporary
file and renames it over the name instead (``rename`` replaces a link or FIFO, not its target).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import stat
import threading
from collections.abc import Callable, Iterable

__all__ = [
    "CREATE_FLAGS",
    "NO_SPACE",
    "NotRegularFileError",
    "Scan",
    "ShardDirs",
    "open_regular",
    "unlink_quietly",
]

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC
#: create a new file; fails with ``FileExistsError`` on any existing name, link or not
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC
#: errnos of a full file system (blocks or quota)
NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})
#: ``open`` errnos that mean "not a regular file": ``O_NOFOLLOW`` on a link; a socket, or a
#: device without a driver
_NOT_REGULAR_ERRNOS = frozenset({errno.ELOOP, errno.ENXIO, errno.EMLINK})


class NotRegularFileError(OSError):
    """The name exists but is a symbolic link, FIFO, socket, device or directory."""


def open_regular(name: str, dir_fd: int) -> int:
    """Open ``name`` (one component, relative to ``dir_fd``) read-only, never following a link
    and never blocking; return the descriptor of a regular file.

    Raises:
        NotRegularFileError: ``name`` is a link, FIFO, socket, device or directory.
        OSError: any other failure (``FileNotFoundError`` when absent).
    """
    try:
        fd = os.open(name, READ_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in _NOT_REGULAR_ERRNOS:
            msg = f"not a regular file: {exc.strerror}"
            raise NotRegularFileError(exc.errno, msg, name) from exc
        raise
    try:
        mode = os.fstat(fd).st_mode
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise NotRegularFileError(errno.EINVAL, f"not a regular file (mode {mode:o})", name)
    return fd


def unlink_quietly(name: str, dir_fd: int | None) -> None:
    """Unlink ``name`` relative to ``dir_fd`` (the name itself, a link is not followed);
    ignore every error (absent, a directory, no shard)."""
    if dir_fd is None:
        return
    with contextlib.suppress(OSError):
        os.unlink(name, dir_fd=dir_fd)


@dataclasses.dataclass
class Scan:
    """What :meth:`ShardDirs.scan` found."""

    files: list[tuple[str, str, os.stat_result]]  # (shard, name, lstat) of wanted regular files
    junk: list[str]  # "shard/name" of wanted names that are not regular files; "shard/" unreadable
    stale: int  # temporary files deleted


class ShardDirs:
    """The root directory and its shard subdirectories as descriptors opened without following
    links.

    :meth:`open_root` opens the root; :meth:`get` opens a shard on first use and caches its
    descriptor (at most one per shard); :meth:`close` releases them all.  Thread-safe.  The
    owner must not call :meth:`close` while another thread may still use a descriptor.
    """

    def __init__(self, root: str) -> None:
        self._root = root
        self._lock = threading.Lock()
        self.root_fd: int | None = None
        self._fds: dict[str, int] = {}
        #: the descriptors of shards ``00``-``ff`` by number (``-EBADF``: not open yet)
        self._table = [-errno.EBADF] * 256

    def open_root(self) -> None:
        """Create the root (and parents) and open it; its parents may be links, it may not.

        Raises:
            OSError: it cannot be created or opened (a symbolic link: ``ENOTDIR`` or
                ``ELOOP`` with a message saying so; a regular file: ``ENOTDIR``).
        """
        os.makedirs(self._root, exist_ok=True)
        try:
            fd = os.open(self._root, DIR_FLAGS)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR) or not os.path.islink(self._root):
                raise
            real = os.path.realpath(self._root)
            msg = f"it is a symbolic link (pass the directory it points to, {real!r})"
            raise OSError(exc.errno, msg, self._root) from exc
        with self._lock:
            if self.root_fd is not None:
                os.close(self.root_fd)
            self.root_fd = fd

    def prepare(self, names: list[str]) -> tuple[list[str], list[str]]:
        """Make sure every shard in ``names`` is a real directory under the root.

        A shard that is missing is created; a symbolic link in place of a shard is unlinked
        (the link, never its target) and the directory created.  Return ``(recreated, broken)``:
        the shards recreated from a link, and those left unusable (a regular file in place of
        the shard, no space to create it, ...): operations on a broken shard fail per page.
        """
        root_fd = self._require_root()
        recreated: list[str] = []
        broken: list[str] = []
        for name in names:
            try:
                st = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            except OSError:
                broken.append(name)
                continue
            try:
                if st is not None and stat.S_ISLNK(st.st_mode):
                    os.unlink(name, dir_fd=root_fd)
                    recreated.append(name)
                    st = None
                if st is None:
                    os.mkdir(name, dir_fd=root_fd)
                elif not stat.S_ISDIR(st.st_mode):
                    broken.append(name)
            except FileExistsError:  # created meanwhile by someone else: checked at first use
                pass
            except OSError:
                broken.append(name)
        return recreated, broken

    def get(self, name: str) -> int:
        """The descriptor of shard ``name``, opened on first use without following a link.

        Raises:
            OSError: the shard is missing (``ENOENT``), a link or not a directory
                (``ENOTDIR``, ``ELOOP``).
        """
        fd = self._fds.get(name)
        if fd is not None:
            return fd
        root_fd = self._require_root()
        with self._lock:
            fd = self._fds.get(name)
            if fd is None:
                fd = os.open(name, DIR_FLAGS, dir_fd=root_fd)
                self._fds[name] = fd
                if len(name) == 2 and all(c in "0123456789abcdef" for c in name):
                    self._table[int(name, 16)] = fd
            return fd

    def table(self) -> list[int] | None:
        """The descriptors of shards ``00``-``ff`` by number, once every one is open (the
        same list each time: the caller must not change it), else ``None``."""
        table = self._table
        return table if len(self._fds) >= 256 and min(table) >= 0 else None

    def scan(self, shards: Iterable[str], want: Callable[[str], bool], stale_suffix: str) -> Scan:
        """List the shards without following links: regular files whose name ``want`` accepts,
        the wanted names that are anything else (junk, skipped), and delete the files whose
        name ends with ``stale_suffix``.  A shard that cannot be opened is skipped (see
        :meth:`prepare`); one that cannot be listed is junk."""
        out = Scan([], [], 0)
        for shard in shards:
            try:
                dfd = os.open(shard, DIR_FLAGS, dir_fd=self._require_root())
            except OSError:
                continue
            try:
                with os.scandir(dfd) as it:
                    for entry in it:
                        if entry.name.endswith(stale_suffix):
                            unlink_quietly(entry.name, dfd)
                            out.stale += 1
                        elif want(entry.name):
                            try:
                                if entry.is_file(follow_symlinks=False):
                                    st = entry.stat(follow_symlinks=False)
                                    out.files.append((shard, entry.name, st))
                                    continue
                            except OSError:
                                pass
                            out.junk.append(f"{shard}/{entry.name}")
            except OSError:
                out.junk.append(f"{shard}/")
            finally:
                os.close(dfd)
        return out

    def unlink_files(self, names: Iterable[str], suffix: str) -> None:
        """Unlink each ``name + suffix`` in its shard (the first two characters of the name),
        the name itself, no link followed; quiet (a missing shard or file is skipped)."""
        for name in names:
            try:
                dfd = self.get(name[:2])
            except OSError:
                continue
            unlink_quietly(name + suffix, dfd)

    def remove_stale(self, match: Callable[[str], object]) -> int:
        """Delete the regular files directly in the root whose name ``match`` accepts (the
        leftovers of a crash, e.g. between :meth:`probe_write`'s create and unlink); return
        how many.  Listed and unlinked relative to the root's descriptor, each entry's type
        read without following a link: a link (whatever it points to), a directory or any
        other kind of file of such a name stays, nothing below or outside the root is
        touched.  Quiet: a root that cannot be listed deletes nothing.
        """
        removed = 0
        try:
            dfd = os.open(".", DIR_FLAGS, dir_fd=self._require_root())
        except OSError:
            return 0
        try:
            with os.scandir(dfd) as it:
                for entry in it:
                    try:
                        if not match(entry.name) or not entry.is_file(follow_symlinks=False):
                            continue
                        os.unlink(entry.name, dir_fd=dfd)
                    except OSError:
                        continue
                    removed += 1
        except OSError:
            pass  # unreadable root: the probe decides whether it is usable
        finally:
            os.close(dfd)
        return removed

    def probe_write(self, name: str) -> None:
        """Create, write one byte to and delete ``name`` in the root.

        Raises:
            OSError: the root is not writable (``NO_SPACE`` errnos: it is full).
        """
        root_fd = self._require_root()
        fd = os.open(name, CREATE_FLAGS, 0o600, dir_fd=root_fd)
        try:
            os.write(fd, b"x")
        finally:
            os.close(fd)
            unlink_quietly(name, root_fd)

    def close(self) -> None:
        """Close every descriptor (idempotent)."""
        with self._lock:
            fds = list(self._fds.values())
            self._fds.clear()
            self._table = [-errno.EBADF] * 256
            if self.root_fd is not None:
                fds.append(self.root_fd)
                self.root_fd = None
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _require_root(self) -> int:
        fd = self.root_fd
        if fd is None:
            raise FileNotFoundError(errno.ENOENT, "storage root is not open", self._root)
        return fd
