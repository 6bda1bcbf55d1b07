"""The write path of :class:`~aiocache_kv.storage.file.FileStorage`: ``put``/``put_chain``.

:class:`FileWrites` is the base of ``FileStorage`` holding what a put does: seal each group of
pages (~4 MiB) right before its writes, create the files (in place, one group in one
``page_file.write_named`` call, the GIL released once where ``_pageio`` is built; through a
temporary file and a rename where a name is taken or ``fsync`` asks), then, under the index
lock once per group, index the pages and evict for room (chain ends first: a page this same
put wrote and had to evict again reports ``False``, and so do the pages after it in its
chain).  The capacity can be exceeded by one group while it is written.  A key is present
(skipped) only if its indexed size is the size this put writes: a page torn by a crash or of
another slot size is rewritten (``FileWrites._present_locked``).  Layout, policies and
the rest of the class: :mod:`aiocache_kv.storage.file`.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import threading
from collections.abc import Sequence
from pathlib import Path

from aiocache_kv.errors import InvalidInputError
from aiocache_kv.logs import get_logger
from aiocache_kv.storage import integrity, page_file, safe_fs
from aiocache_kv.storage.base import PageBuffer, StatsCounter
from aiocache_kv.storage.file_quota import FileQuotas
from aiocache_kv.storage.keys import check_keys
from aiocache_kv.storage.page_file import SUFFIX, TMP_SUFFIX, chunks, file_name
from aiocache_kv.storage.page_index import PageIndex

__all__ = ["FileWrites"]

log = get_logger("aiocache_kv.storage.file")


class FileWrites(FileQuotas):
    """Puts of a :class:`~aiocache_kv.storage.file.FileStorage` (its base; state set there)."""

    fsync: str
    capacity_bytes: int | None
    _lock: threading.Lock
    _index: PageIndex
    _writing: set[str]  # names a put is writing (not indexed yet)
    _deleting: set[str]  # names out of the index whose files are still being unlinked
    _settled: threading.Condition  # on ``_lock``: notified when writes or unlinks end
    _dirs: safe_fs.ShardDirs
    _stats: StatsCounter
    _pid: int
    _seq: itertools.count[int]
    root: Path

    def _in_use(self) -> contextlib.AbstractContextManager[None]:
        raise NotImplementedError

    def _unlink_victims(self, victims: list[str], report: list[str] | None = None) -> None:
        raise NotImplementedError

    def _set_writable(self, writable: bool, reason: str | None = None) -> None:
        raise NotImplementedError

    # -- writes ------------------------------------------------------------------------------

    def put(
        self,
        keys: Sequence[str],
        buffers: Sequence[PageBuffer],
        identities: Sequence[bytes] | None = None,
    ) -> list[bool]:
        """Seal (binding ``identities``, see :mod:`.integrity`) and store each slot; present
        keys are not rewritten (``True``, counted skipped).  Pages stored this way record no
        parent: see :meth:`put_chain`.

        A key counts as present only if its indexed file has the size this put writes
        (header, key, slot); one of another size (torn by a crash before a restart, or stored
        with another slot size) is rewritten through a temporary file and a rename (if that
        fails: ``False``, and the old file is deleted).  A file changed behind the storage's
        back while it runs is not looked at by a put (no system call per present key): its
        first read drops it, and the next put stores it again.

        Raises:
            StorageKeyError: a malformed key.
            InvalidInputError: ``len(keys) != len(buffers)``, a slot <= ``FRAME_OVERHEAD``, or
                a malformed identity.
            StorageUnavailableError: closed or unusable directory.
        """
        integrity.check_batch(keys, buffers)
        idents = integrity.identities_for(keys, identities)
        with self._in_use():
            return self._put(keys, buffers, None, idents)

    def put_chain(
        self,
        keys: Sequence[str],
        buffers: Sequence[PageBuffer],
        parents: Sequence[str | None],
        identities: Sequence[bytes] | None = None,
    ) -> list[bool]:
        """:meth:`put`, with ``parents[i]`` the key page ``i`` depends on (``None``: a chain
        start), recorded in the file and used by eviction (chain ends first).  A page the same
        call had to evict again reports ``False``, and so do the pages after it in its chain.
        Present keys as in :meth:`put` (a page of another size is rewritten).

        Raises:
            StorageKeyError: a malformed key or parent.
            InvalidInputError: lengths differ, a slot <= ``FRAME_OVERHEAD``, or a malformed
                identity.
            StorageUnavailableError: closed or unusable directory.
        """
        integrity.check_batch(keys, buffers)
        if len(parents) != len(keys):
            raise InvalidInputError(f"{len(parents)} parents for {len(keys)} keys")
        check_keys([p for p in parents if p is not None])
        idents = integrity.identities_for(keys, identities)
        with self._in_use():
            return self._put(keys, buffers, parents, idents)

    def _put(
        self,
        keys: Sequence[str],
        buffers: Sequence[PageBuffer],
        parent_keys: Sequence[str | None] | None,
        idents: list[bytes],
    ) -> list[bool]:
        n = len(keys)
        results = [False] * n
        key_bytes = [k.encode("utf-8", "surrogatepass") for k in keys]
        names = page_file.names_of(key_bytes)
        parents: list[str | None]  # the name of the page each depends on
        if parent_keys is None:
            parents = [None] * n
        else:  # a chain's parents are mostly its own keys: their names are made already
            made = dict(zip(keys, names, strict=True))
            parents = [None if p is None else made.get(p) or file_name(p) for p in parent_keys]
        # the size of each file as this put writes it: a present page of another size is not
        # this page (torn by a crash, another slot size) and is rewritten (see _present_locked)
        head = page_file.HEADER.size
        sizes = [head + len(kb) + b.nbytes for kb, b in zip(key_bytes, buffers, strict=True)]
        writing = self._writing
        size_of = self._index.size
        with self._lock:
            present = self._index.present(names, sizes)  # (touched: a put of one is a use)
        for i in present:
            results[i] = True
        skipped = len(present)
        first: dict[str, int]  # absent name -> the index it is written from
        if skipped:
            absent = [i for i, there in enumerate(results) if not there]
            back = absent[::-1]
            first = dict(zip([names[i] for i in back], back, strict=True))
        else:  # (in C: the last write of a name wins, so walking backwards keeps the first)
            first = dict(zip(reversed(names), range(n - 1, -1, -1), strict=True))
        todo = list(range(n)) if len(first) == n else sorted(first.values())
        too_big = 0
        cap = self.capacity_bytes
        if cap is not None and todo and max(sizes) > cap:
            fit = [i for i in todo if sizes[i] <= cap]
            too_big, todo = len(todo) - len(fit), fit
        errors: list[tuple[str, str]] = []
        written: dict[str, int] = {}  # name -> index, written by this call
        dropped: set[str] = set()  # written by this call and evicted again
        nbytes = no_space = 0
        writable: bool | None = None  # what the last write said about free space
        for chunk in chunks(todo, buffers):
            integrity.seal_checked(  # put/put_chain checked the whole batch
                [buffers[i] for i in chunk], [keys[i] for i in chunk], [idents[i] for i in chunk]
            )
            group: list[int] = []  # created in place, in one batch
            single: list[int] = []  # through a temporary file, page by page
            replaced: set[str] = set()  # indexed at another size: dropped, rewritten
            mine = {names[i] for i in chunk}
            with self._lock:
                # rare: another put writes one of these names, or an eviction unlinks one
                while not (mine.isdisjoint(self._writing) and mine.isdisjoint(self._deleting)):
                    self._settled.wait()
                never = self.fsync == "never"
                for i in chunk:
                    name = names[i]
                    if parents[i] in dropped:  # unreachable: its parent went for room already
                        dropped.add(name)
                    elif size_of(name) is not None and self._present_locked(
                        name, sizes[i], replaced
                    ):  # stored meanwhile
                        results[i] = True
                        skipped += 1
                    else:
                        writing.add(name)
                        (group if never and name not in replaced else single).append(i)
            marked = [names[i] for i in group + single]  # ours to write: unmarked below
            try:
                done = self._write_chunk(group, single, names, key_bytes, buffers, parents)
            except BaseException:  # not an I/O failure (those are per page): no name stays
                self._unlink_unindexed(replaced)  # marked as being written by a put that is
                with self._lock:  # gone, and no file of a dropped entry stays
                    self._writing.difference_update(marked)
                    self._settled.notify_all()
                raise
            if replaced:
                self._unlink_unindexed(
                    {names[i] for i in chunk if isinstance(done.get(i), OSError)} & replaced
                )
            added: list[tuple[str, int, str | None, str | None]] = []
            for i in chunk:
                got = done.get(i)
                if got is None:
                    continue
                if isinstance(got, OSError):
                    errors.append((keys[i], f"{type(got).__name__}: {got}"))
                    if got.errno in safe_fs.NO_SPACE:
                        no_space += 1
                        writable = False
                    continue
                writable = True
                # (tag_of_key inline: the namespace tag is what comes before the first "/")
                added.append((names[i], got, parents[i], keys[i].partition("/")[0]))
                written[names[i]] = i
                nbytes += buffers[i].nbytes
                results[i] = True
            with self._lock:  # the group enters the index under one lock hold
                self._writing.difference_update(marked)
                self._settled.notify_all()
                self._index.add_many(added)
                victims = self._pick_victims_locked()  # chain ends first: this chunk's last
            for v in victims:
                if v in written:
                    results[written[v]] = False
                    dropped.add(v)
            self._unlink_victims(victims, report=[v for v in victims if v not in written])
        ok = len(written) - len(dropped.intersection(written))
        if skipped + len(first) < n:  # duplicates ride along with their first occurrence
            for i, name in enumerate(names):
                j = first.get(name, i)
                if j != i and results[j] and not results[i]:
                    results[i] = True
                    skipped += 1
        self._stats.add(
            puts=n,
            put_ok=ok,
            put_skipped=skipped,
            put_failed=n - ok - skipped,
            bytes_written=nbytes,
        )
        if writable is not None:
            self._set_writable(writable, errors[-1][1] if errors else None)
        if too_big or dropped or len(errors) > no_space:  # a full disk: logged by read_only
            log.warning(
                "storage.file.put_failed",
                path=str(self.root),
                failed=len(errors),
                larger_than_capacity=too_big,
                evicted_at_once=len(dropped),
                first_error=errors[0][1] if errors else None,
                sample_keys=[k for k, _ in errors[:3]],
            )
        return results

    def _present_locked(self, name: str, size: int, replaced: set[str]) -> bool:
        """Whether ``name`` is stored as a file of ``size`` bytes, what this put would write
        (then it is touched: a put of a present page is an access).  An entry of another size
        is not this page: a file torn by a crash (zero-length, truncated: its size comes
        from the scan at open) or of another slot size.  It is dropped from the index and
        added to ``replaced``; the caller rewrites the name through a temporary file and a
        rename (atomic for readers) and unlinks it if that fails.  Not detected here, to
        keep a put of present pages free of system calls: a file changed behind the cache's
        back while it runs (replaced by a link, FIFO or directory, truncated, overwritten):
        its first read finds it and drops it, and the next put stores it again."""
        stored = self._index.size(name)
        if stored == size:
            self._index.touch(name)
            return True
        if stored is not None:
            self._index.remove(name)
            replaced.add(name)
        return False

    def _unlink_unindexed(self, names: set[str]) -> None:
        """Unlink the files of ``names``: dropped from the index by ``_present_locked``,
        still marked as being written by this put (no other put or unlink touches them)
        and not rewritten, so what is on disk under the name is the old, wrong file."""
        self._dirs.unlink_files(names, SUFFIX)

    def _write_chunk(
        self,
        group: list[int],
        single: list[int],
        names: list[str],
        key_bytes: list[bytes],
        buffers: Sequence[PageBuffer],
        parents: list[str | None],
    ) -> dict[int, int | OSError]:
        """Write pages ``group`` in place in one batch and ``single`` (plus the group's names
        that turned out taken) through temporary files; each page's size or failure."""
        done = self._write_group(group, names, key_bytes, buffers, parents)
        for i, res in list(done.items()):
            if isinstance(res, OSError) and res.errno == errno.EEXIST:
                del done[i]  # a leftover of some kind: replaced by a rename below
                single.append(i)
        for i in single:
            try:
                done[i] = self._write_file(key_bytes[i], names[i], buffers[i], False, parents[i])
            except OSError as exc:
                done[i] = exc
        return done

    def _write_group(
        self,
        group: list[int],
        names: list[str],
        key_bytes: list[bytes],
        buffers: Sequence[PageBuffer],
        parents: list[str | None],
    ) -> dict[int, int | OSError]:
        """Create pages ``group`` in place; each page's file size, or why it failed
        (``FileExistsError``: the name is taken, nothing was touched; an unusable shard
        fails its pages only)."""
        fds = self._dirs.table()  # (once every shard is open: no step per page here)
        if fds is None:
            fds = [-errno.EBADF] * 256
            for shard in {names[i][:2] for i in group}:
                try:
                    fds[int(shard, 16)] = self._dirs.get(shard)
                except OSError as exc:
                    fds[int(shard, 16)] = -(exc.errno or errno.EIO)
        sizes = page_file.write_named(
            fds,
            [names[i] for i in group],
            [key_bytes[i] for i in group],
            [parents[i] for i in group],
            [buffers[i].view for i in group],
        )
        return {
            i: size if size >= 0 else OSError(-size, os.strerror(-size), names[i])
            for i, size in zip(group, sizes, strict=True)
        }

    def _write_file(
        self, key_bytes: bytes, name: str, buf: PageBuffer, in_place: bool, parent: str | None
    ) -> int:
        tmp = f".{name}-{self._pid}-{threading.get_ident():x}-{next(self._seq)}{TMP_SUFFIX}"
        header = page_file.header_for(key_bytes, parent)
        dfd = self._dirs.get(name[:2])
        return page_file.write_page(dfd, name, header, buf, in_place, self.fsync, tmp)

    def _pick_victims_locked(self) -> list[str]:
        """Pages to evict for room, dropped from the index and marked being deleted (the
        caller unlinks them)."""
        victims = self._quota_victims_locked()  # tenants over their budgets (file_quota.py)
        if self.capacity_bytes is not None:
            victims += self._index.pick_victims(self.capacity_bytes)
        self._deleting.update(victims)
        return victims
