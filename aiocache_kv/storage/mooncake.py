"""``MooncakeStorage``: the distributed L3 backend over ``mooncake.store.MooncakeDistributedStore``.

Configuration.  Every constructor argument left as ``None`` comes from the environment, using
the names SGLang's Mooncake backend reads (so one deployment config serves both):

* ``master``: ``MOONCAKE_MASTER``, default ``127.0.0.1:50051``
* ``metadata_server``: ``MOONCAKE_TE_META_DATA_SERVER``, then the legacy
  ``MOONCAKE_METADATA_SERVER``, default ``http://127.0.0.1:8080/metadata``; ``local_hostname``:
  ``MOONCAKE_LOCAL_HOSTNAME``, default ``127.0.0.1``; ``protocol``: ``MOONCAKE_PROTOCOL``,
  default ``tcp``; ``device_name``: ``MOONCAKE_DEVICE``, default ``""``
* ``global_segment_size``: ``MOONCAKE_GLOBAL_SEGMENT_SIZE``, default 1 GiB; 0 (this client
  mounts no memory, it only uses other clients' segments) or >= 16 MiB (less fails ``setup``
  with -600); ``local_buffer_size``: ``MOONCAKE_LOCAL_BUFFER_SIZE``, default 16 MiB

Sizes: an int or a string with a unit (``"4gb"``, ``"512MB"``, ``"64k"``; binary units).  The
client's own ``MC_*`` variables are read by the C++ client at :meth:`open`: ``MC_RPC_TIMEOUT_MS``
bounds every call to a hung master (default 30 s; set it, or pass ``rpc_timeout_ms``, written
into ``os.environ`` before ``setup``), and ``MC_LOG_LEVEL`` defaults to ``ERROR`` here (set it
to see the client's INFO lines).  ``MC_TCP_BIND_ADDRESS`` is the address the client publishes
(unset and ``local_hostname`` an IP literal: :meth:`open` sets it to that, so loopback stays
on loopback).  ``MC_STORE_CLIENT_SETUP_RETRIES`` bounds ``setup`` when no master answers.

Semantics.  ``put`` seals every slot (trailer written into it, batched checksums, the page's
identity bound) and sends it zero-copy with ``batch_put_from``.  A Mooncake put on a key the
store already holds returns 0 and keeps the old value without moving any bytes, so by default
(``check_existing=False``) no existence check precedes it: a present key costs the same one
master round trip as the check would, and the cache only backs up pages storage lacks.  The
price is in the counters: a key the store already had counts as ``put_ok`` (and its slot in
``bytes_written``), and only a key repeated inside the batch as ``put_skipped``.
``check_existing=True`` asks ``batch_is_exist`` first (sealing the first chunk while it is in
flight) and does not send present keys, which keeps those counters exact.  A batch of several
chunks (:data:`PIPELINE_BYTES`) is pipelined: chunk k is sent on a helper thread while chunk
k + 1 is sealed (:mod:`.mooncake_pipeline`); ``get_into`` verifies chunk k while chunk k + 1
is read (with :attr:`defer_checksum`, only the trailers: :mod:`.deferred`).  Return codes:
``-704`` = missing (a miss); ``-900``/``-901``/``-800`` = unavailable (master dead, master
hung, data holder dead); ``-200`` = no space: the failed keys are retried once after
``no_space_retry_delay`` seconds (the master evicts meanwhile), then reported as failures per
key.  When *every* key of a batch fails as unavailable the call raises
:class:`~aiocache_kv.errors.StorageUnavailableError`; otherwise each key gets its own result.
A page that fails the integrity check or was computed from other tokens
(``BAD_IDENTITY``), or whose object is larger/smaller than the slot (``-600`` / short read),
is a miss, counted as corrupt, and removed from the store so a later put can replace it.
"""

from __future__ import annotations

import concurrent.futures
import ipaddress
import operator
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from aiocache_kv.errors import (
    ConfigError,
    MooncakeNotInstalledError,
    StorageError,
    StorageUnavailableError,
)
from aiocache_kv.logs import get_logger
from aiocache_kv.numeric import check_real
from aiocache_kv.storage import integrity
from aiocache_kv.storage import mooncake_options as opts
from aiocache_kv.storage.base import (
    PageBuffer,
    StatsCounter,
    StorageStats,
    byte_chunks,
    leading_run,
)
from aiocache_kv.storage.keys import check_keys
from aiocache_kv.storage.mooncake_pipeline import (
    PIPELINE_BYTES,
    pipelined_get,
    pipelined_put,
    put_chunks,
)
from aiocache_kv.storage.mooncake_tags import MooncakeTags
from aiocache_kv.storage.sizes import parse_size

__all__ = [
    "CODE_MISSING",
    "CODE_NO_SPACE",
    "UNAVAILABLE_CODES",
    "MooncakeNotInstalledError",
    "MooncakeStorage",
    "parse_size",
]

log = get_logger(__name__)

CODE_NO_SPACE = -200
CODE_BUFFER_SIZE = -600
CODE_MISSING = -704
UNAVAILABLE_CODES = frozenset({-900, -901, -800})

#: the smallest non-zero segment the Mooncake client mounts
MIN_GLOBAL_SEGMENT = opts.MIN_GLOBAL_SEGMENT

#: helper threads for RPCs overlapped with the checksum (one per concurrent put is enough)
_HELPER_THREADS = 4


class MooncakeStorage(MooncakeTags):
    """L3 pages in a Mooncake Store cluster; see the module docstring for config and codes.
    Construction validates the configuration only (no I/O, safe on the event loop).
    :meth:`open` (called lazily by every method, run it via ``StorageIO``) imports mooncake and
    connects; it blocks for the client's setup (~1 s; far longer with no master unless
    ``MC_STORE_CLIENT_SETUP_RETRIES`` is small).
    """

    defer_checksum = False  #: reads into buffers with a checksum row check only the trailer
    #: a read of a missing key costs what asking costs (-704 per key), so the storage tier
    #: reads a prefetch's run beside its existence check, not after it (``prefetch.py``)
    read_ahead = True

    def __init__(
        self,
        master: str | None = None,
        metadata_server: str | None = None,
        local_hostname: str | None = None,
        protocol: str | None = None,
        device_name: str | None = None,
        global_segment_size: int | str | None = None,
        local_buffer_size: int | str | None = None,
        *,
        rpc_timeout_ms: int | None = None,
        no_space_retry_delay: float = 0.02,
        check_existing: bool = False,
    ) -> None:
        """Raises:
        ConfigError: an address, protocol or device not a ``str`` (or ``None``), ``master``
            not host:port, a size malformed or above 2**63-1 bytes, ``rpc_timeout_ms`` not an
            int in [1, 2**31-1], a delay not finite and >= 0, or ``check_existing`` not a bool
            (:mod:`.mooncake_options`).
        """
        (
            self.master,
            self.metadata_server,
            self.local_hostname,
            self.protocol,
            self.device_name,
        ) = opts.addresses(master, metadata_server, local_hostname, protocol, device_name)
        self.global_segment_size, self.local_buffer_size = opts.segment_sizes(
            global_segment_size, local_buffer_size
        )
        self.rpc_timeout_ms = opts.rpc_timeout_ms(rpc_timeout_ms)
        check_real("no_space_retry_delay", no_space_retry_delay, error=ConfigError)
        self.no_space_retry_delay = no_space_retry_delay
        self.check_existing = opts.flag("check_existing", check_existing)
        self._store: Any = None
        self._open_lock = threading.Lock()
        self._closed = False
        self._registered: list[tuple[int, int]] = []  # (start, end) of registered buffers
        self._reg_lock = threading.Lock()
        self._warned_unregistered = False
        self._stats = StatsCounter()
        self._helper: concurrent.futures.ThreadPoolExecutor | None = None
        self._helper_lock = threading.Lock()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("open" if self._store is not None else "new")
        return (
            f"MooncakeStorage(master={self.master!r}, metadata_server={self.metadata_server!r}, "
            f"protocol={self.protocol!r}, state={state}, registered={len(self._registered)})"
        )

    # -- lifecycle ---------------------------------------------------------------------------

    def open(self) -> None:
        """Import mooncake and connect (idempotent).

        Raises:
            MooncakeNotInstalledError: ``mooncake.store`` cannot be imported.
            StorageUnavailableError: closed, or ``setup`` failed (master/metadata unreachable).
        """
        with self._open_lock:
            if self._closed:
                raise StorageUnavailableError("MooncakeStorage is closed")
            if self._store is not None:
                return
            # the client logs every call's INFO/WARNING lines by default, which look like
            # failures in a healthy run; quiet them unless the user chose a level
            os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
            try:
                from mooncake.store import MooncakeDistributedStore
            except ImportError as exc:
                raise MooncakeNotInstalledError(
                    "MooncakeStorage needs the mooncake client: pip install "
                    "'aiocache_kv[mooncake]' (CUDA build) or 'aiocache_kv[mooncake-cpu]' "
                    "(CPU only); "
                    f"import failed: {exc}"
                ) from exc
            if self.rpc_timeout_ms is not None:
                os.environ["MC_RPC_TIMEOUT_MS"] = str(self.rpc_timeout_ms)
            host = (
                self.local_hostname.rsplit(":", 1)[0]
                if self.local_hostname.count(":") == 1
                else self.local_hostname
            )
            try:
                ipaddress.ip_address(host)
                os.environ.setdefault("MC_TCP_BIND_ADDRESS", host)
            except ValueError:
                pass
            store = MooncakeDistributedStore()
            t0 = time.monotonic()
            rc = store.setup(
                self.local_hostname,
                self.metadata_server,
                self.global_segment_size,
                self.local_buffer_size,
                self.protocol,
                self.device_name,
                self.master,
            )
            if rc != 0:
                raise StorageUnavailableError(
                    f"mooncake setup failed with {rc} (master={self.master!r}, "
                    f"metadata_server={self.metadata_server!r}, local_hostname="
                    f"{self.local_hostname!r}, protocol={self.protocol!r})"
                )
            self._store = store
            log.info(
                "storage.mooncake.open",
                master=self.master,
                hostname=store.get_hostname(),
                setup_s=round(time.monotonic() - t0, 3),
            )

    def close(self) -> None:
        """Unregister buffers and close the client (idempotent; takes ~2 s; drops this
        client's segment, i.e. every object stored in it)."""
        with self._open_lock:
            if self._closed:
                return
            self._closed = True
            store, self._store = self._store, None
        with self._helper_lock:
            helper, self._helper = self._helper, None
        if helper is not None:
            helper.shutdown(wait=False)
        if store is None:
            return
        with self._reg_lock:
            regs, self._registered = self._registered, []
        for start, _ in regs:
            store.unregister_buffer(start)
        store.close()
        log.info("storage.mooncake.closed", master=self.master)

    @property
    def raw_client(self) -> Any:
        """The underlying ``MooncakeDistributedStore`` (opens it; tests and diagnostics)."""
        return self._client()

    def _client(self) -> Any:
        if self._closed:
            raise StorageUnavailableError("MooncakeStorage is closed")
        if self._store is None:
            self.open()
        return self._store

    def register_buffer(self, tensor: torch.Tensor) -> None:
        """Register a host tensor's memory once for zero-copy transfers (idempotent).

        Raises:
            InvalidInputError: not a contiguous CPU tensor.
            StorageError: the client refused the registration (e.g. -600, overlapping range).
        """
        buf = PageBuffer.from_tensor(tensor.view(-1).view(torch.uint8))
        store = self._client()
        with self._reg_lock:
            if (buf.ptr, buf.ptr + buf.nbytes) in self._registered:
                return
            rc = store.register_buffer(buf.ptr, buf.nbytes)
            if rc != 0:
                raise StorageError(
                    f"mooncake register_buffer(0x{buf.ptr:x}, {buf.nbytes}) failed with {rc}"
                )
            # replaced, never changed in place: a reader takes it without the lock
            self._registered = [*self._registered, (buf.ptr, buf.ptr + buf.nbytes)]

    def _check_registered(self, ptrs: Sequence[int], sizes: Sequence[int]) -> None:
        """Count (and warn once about) the buffers ``ptrs[i], sizes[i]`` outside every
        registered region (they still work, through a bounce copy)."""
        regs = self._registered
        if ptrs:  # common case: one registered region (the host pool) holds the whole batch
            lo = min(ptrs)
            hi = max(map(operator.add, ptrs, sizes))
            if any(s <= lo and hi <= e for s, e in regs):
                return
        outside = sum(
            1
            for p, n in zip(ptrs, sizes, strict=True)
            if not any(s <= p and p + n <= e for s, e in regs)
        )
        if outside:
            self._stats.add(unregistered_buffers=outside)
            if not self._warned_unregistered:
                self._warned_unregistered = True
                log.warning("storage.mooncake.unregistered_buffers", count=outside)

    def statistics(self) -> StorageStats:
        """Frozen snapshot of the counters."""
        return self._stats.snapshot()

    def _submit(self, fn: Any, *args: Any) -> concurrent.futures.Future[Any] | None:
        """Run ``fn(*args)`` on a helper thread (RPCs overlapped with the checksum); ``None``
        when closed (the caller then runs it inline)."""
        with self._helper_lock:
            if self._closed:
                return None
            if self._helper is None:
                self._helper = concurrent.futures.ThreadPoolExecutor(
                    _HELPER_THREADS, thread_name_prefix="aiocache-kv-mooncake-rpc"
                )
            try:
                return self._helper.submit(fn, *args)
            except RuntimeError:  # shut down
                return None

    # -- calls -------------------------------------------------------------------------------

    def _call(self, what: str, fn: Any, *args: Any) -> list[int]:
        try:
            codes = list(fn(*args))
        except Exception as exc:  # the binding raises on bad arguments / internal errors
            raise StorageError(f"mooncake {what} raised {type(exc).__name__}: {exc}") from exc
        n = len(args[0])
        if len(codes) != n:
            log.error("storage.mooncake.short_result", call=what, expected=n, got=len(codes))
            codes = (codes + [-1] * n)[:n]  # never truncate silently: missing = failed
        return codes

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Per key: present in the store (grants Mooncake's read lease).

        Raises:
            StorageKeyError: a malformed key.
            StorageUnavailableError: the store answered with an error for every key.
        """
        check_keys(keys)
        if not keys:
            return []
        store = self._client()
        codes = self._call("batch_is_exist", store.batch_is_exist, list(keys))
        if all(c < 0 for c in codes):
            raise StorageUnavailableError(
                f"mooncake batch_is_exist failed for all {len(keys)} keys"
            )
        return [c == 1 for c in codes]

    def leading_hits(self, keys: Sequence[str]) -> int:
        """Count of the leading run of present keys (raises as :meth:`exists`)."""
        return leading_run(self.exists(keys))

    def put(
        self,
        keys: Sequence[str],
        buffers: Sequence[PageBuffer],
        identities: Sequence[bytes] | None = None,
    ) -> list[bool]:
        """Seal (binding ``identities``, see :mod:`.integrity`) and store slots zero-copy; see
        module doc for codes, retries and ``check_existing``.

        Raises:
            StorageKeyError, InvalidInputError: malformed batch (nothing sent).
            StorageUnavailableError: every key failed as unavailable.
            StorageError: the client raised.
        """
        integrity.check_batch(keys, buffers)
        idents = integrity.identities_for(keys, identities)
        n = len(keys)
        if n == 0:
            return []
        store = self._client()
        self._stats.add(puts=n)
        first: dict[str, int] = {}  # key -> index it is sent from (duplicates ride along)
        for i, key in enumerate(keys):
            first.setdefault(key, i)
        distinct = sorted(first.values())
        # sealed while the existence check is in flight: the first chunk, or every page at
        # once when their seals only write trailers
        chunks = put_chunks(distinct, buffers, PIPELINE_BYTES)
        results = [False] * n
        sealed = 0  # chunks sealed before the pipeline starts
        todo: set[int] | None = None  # indices to send (None: every distinct one)
        if self.check_existing:
            pending = self._submit(self._call, "batch_is_exist", store.batch_is_exist, list(keys))
            if pending is not None:
                # seal while the check is in flight: the cache backs up only what storage
                # lacks, so the work is rarely wasted
                first_chunk = chunks[0]
                integrity.seal_checked(
                    [buffers[i] for i in first_chunk],
                    [keys[i] for i in first_chunk],
                    [idents[i] for i in first_chunk],
                )
                sealed = 1
                exist = pending.result()
            else:
                exist = self._call("batch_is_exist", store.batch_is_exist, list(keys))
            if all(c < 0 for c in exist):
                self._stats.add(put_failed=n, unavailable=n)
                raise StorageUnavailableError(f"mooncake batch_is_exist failed for all {n} keys")
            first = {}
            for i, key in enumerate(keys):
                if exist[i] == 1:
                    results[i] = True
                else:
                    first.setdefault(key, i)
            todo = set(first.values())
        skipped = sum(results)
        sent = list(first.values())
        self._check_registered([buffers[i].ptr for i in sent], [buffers[i].nbytes for i in sent])

        def send(idx: list[int]) -> list[int]:
            return self._batch("batch_put_from", store.batch_put_from, idx, keys, buffers)

        codes = pipelined_put(
            chunks, keys, buffers, idents, send, self._submit, sealed=sealed, todo=todo
        )
        late = [i for i in first.values() if i not in codes]  # the check saw a repeat differently
        if late:
            integrity.seal_checked(
                [buffers[i] for i in late], [keys[i] for i in late], [idents[i] for i in late]
            )
            codes.update(zip(late, send(late), strict=True))
        if todo is None and len(first) == n and all(c == 0 for c in codes.values()):
            # every key distinct, sent and stored (the common case): the loop below in short
            self._stats.add(put_ok=n, bytes_written=sum(b.nbytes for b in buffers))
            return [True] * n
        retries = 0
        attempt = [i for i in first.values() if codes[i] == CODE_NO_SPACE]
        if attempt:
            retries = len(attempt)
            time.sleep(self.no_space_retry_delay)
            codes.update(zip(attempt, send(attempt), strict=True))
        ok = failed = unavailable = 0
        sent_bytes = 0
        failures: dict[int, int] = {}
        for i, key in enumerate(keys):
            if results[i]:
                continue
            code = codes[first[key]]
            if code == 0:
                results[i] = True
                if first[key] == i:
                    ok += 1
                    sent_bytes += buffers[i].nbytes
                else:
                    skipped += 1
            else:
                failed += 1
                failures[code] = failures.get(code, 0) + 1
                if code in UNAVAILABLE_CODES:
                    unavailable += 1
        self._stats.add(
            put_ok=ok,
            put_skipped=skipped,
            put_failed=failed,
            put_retries=retries,
            unavailable=unavailable,
            bytes_written=sent_bytes,
        )
        if failed:
            log.warning("storage.mooncake.put_failed", failed=failed, of=n, codes=failures)
        if unavailable == n:
            raise StorageUnavailableError(
                f"mooncake put failed for all {n} keys (codes {failures})"
            )
        return results

    def _batch(
        self, what: str, fn: Any, idx: list[int], keys: Sequence[str], bufs: Sequence[PageBuffer]
    ) -> list[int]:
        """``fn`` (``batch_put_from`` / ``batch_get_into``, named ``what``) of the pages ``idx``."""
        sel = [bufs[i] for i in idx]
        return self._call(
            what, fn, [keys[i] for i in idx], [b.ptr for b in sel], [b.nbytes for b in sel]
        )

    def get_into(
        self,
        keys: Sequence[str],
        buffers: Sequence[PageBuffer],
        identities: Sequence[bytes] | None = None,
    ) -> list[bool]:
        """Read slots zero-copy and verify them (against ``identities``, see :mod:`.integrity`);
        corrupt pages and pages of another identity are misses and are removed.

        Raises:
            StorageKeyError, InvalidInputError: malformed batch (nothing read).
            StorageUnavailableError: every key failed as unavailable.
            StorageError: the client raised.
        """
        integrity.check_batch(keys, buffers)
        idents = integrity.identities_for(keys, identities)
        n = len(keys)
        if n == 0:
            return []
        store = self._client()
        ptrs = [b.ptr for b in buffers]
        sizes = [b.nbytes for b in buffers]
        self._check_registered(ptrs, sizes)
        chunks = byte_chunks(list(range(n)), sizes, PIPELINE_BYTES)
        every = list(keys)

        def get(idx: list[int]) -> list[int]:
            if len(idx) == n:  # the whole batch (chunks keep order): the lists as they are
                return self._call("batch_get_into", store.batch_get_into, every, ptrs, sizes)
            return self._batch("batch_get_into", store.batch_get_into, idx, keys, buffers)

        sub, defer = self._submit, self.defer_checksum
        codes, read, verdicts = pipelined_get(chunks, keys, buffers, idents, get, sub, defer)
        ok = integrity.Verdict.OK
        if len(read) == n and all(v is ok for v in verdicts):  # every page read and intact
            self._stats.add(gets=n, hits=n, bytes_read=sum(codes))
            return [True] * n
        results = [False] * n
        hits = misses = failed = unavailable = 0
        read_bytes = 0
        corrupt: list[tuple[str, integrity.Verdict]] = []
        failures: dict[int, int] = {}
        for i, verdict in zip(read, verdicts, strict=True):
            if verdict is integrity.Verdict.OK:
                results[i] = True
                hits += 1
                read_bytes += codes[i]
            else:
                corrupt.append((keys[i], verdict))
        for key, code in zip(keys, codes, strict=True):
            if code > 0:
                continue
            if code == CODE_MISSING:
                misses += 1
            elif code == CODE_BUFFER_SIZE:
                corrupt.append((key, integrity.Verdict.BAD_LENGTH))
            else:
                failed += 1
                failures[code] = failures.get(code, 0) + 1
                if code in UNAVAILABLE_CODES:
                    unavailable += 1
        self._stats.add(
            gets=n,
            hits=hits,
            misses=misses,
            corrupt=len(corrupt),
            get_failed=failed,
            unavailable=unavailable,
            bytes_read=read_bytes,
        )
        integrity.log_failures("mooncake", corrupt)
        if corrupt:
            bad = sorted({k for k, _ in corrupt})
            removed = self._call("batch_remove", store.batch_remove, bad, True)
            self._stats.add(removed=sum(1 for c in removed if c == 0))
        if failed:
            log.warning("storage.mooncake.get_failed", failed=failed, of=n, codes=failures)
        if unavailable == n:
            raise StorageUnavailableError(
                f"mooncake get failed for all {n} keys (codes {failures})"
            )
        return results

    def remove(self, keys: Sequence[str]) -> list[bool]:
        """Force-remove keys (ignores read leases); per key ``True`` if it was removed.

        Raises:
            StorageKeyError: a malformed key.
            StorageError: the client raised.
        """
        check_keys(keys)
        if not keys:
            return []
        store = self._client()
        codes = self._call("batch_remove", store.batch_remove, list(keys), True)
        removed = sum(1 for c in codes if c == 0)
        self._stats.add(removed=removed)
        return [c == 0 for c in codes]
