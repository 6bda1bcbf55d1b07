"""The measured paths of ``aiocache-kv bench storage``: raw baselines and the cache's own.

:mod:`aiocache_kv.bench.storage` plans the measurements, runs them and reports; this module
holds what one measurement does (:func:`measure_config`): the raw backend primitives
(``_RawMooncake``, ``_RawFile`` over one ``_RawBuffer``), a ``write_through`` ``HiCache`` whose
copy engine holds the write acks (:class:`HeldAckEngine`) so the backup clock starts at the ack,
and the cold prefetch.  The method is described in :mod:`aiocache_kv.bench.storage`.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from aiocache_kv.cache import HiCache
from aiocache_kv.config import CacheConfig
from aiocache_kv.errors import StorageError
from aiocache_kv.namespace import Namespace
from aiocache_kv.storage import FRAME_OVERHEAD, FileStorage, MooncakeStorage, PageBuffer, page_file
from aiocache_kv.storage.base import StorageBackend
from aiocache_kv.storage.integrity import checksums, seal
from aiocache_kv.storage.key_layout import key_components
from aiocache_kv.storage.keys import storage_key
from aiocache_kv.transfer import CopyJob, ThreadCopyEngine
from aiocache_kv.transfer.engine import Done
from aiocache_kv.tree.hashing import chain_hashes, namespace_seed

__all__ = [
    "DTYPE",
    "HEADS",
    "HEAD_DIM",
    "LAYERS",
    "LOOP_CPU",
    "PATHS",
    "TOKEN_BYTES",
    "Context",
    "GiB",
    "HeldAckEngine",
    "KiB",
    "MiB",
    "Plan",
    "measure_config",
    "storage_keys",
]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
LAYERS = 4
HEADS = 8
HEAD_DIM = 128
DTYPE = torch.float16
TOKEN_BYTES = LAYERS * 2 * HEADS * HEAD_DIM * 2  # 16 KiB
#: timed per round; ``ceiling_*``: the raw call with one checksum pass over the same pages
#: running beside it (:func:`beside_checksum`); ``raw_*_awaited``: the same raw call as timed
#: on the event loop around ``asyncio.to_thread`` (what an asyncio caller of the raw client
#: waits: the thread hand-offs included, as the cache's times include its own)
PATHS = (
    "raw_put",
    "cache_backup",
    "raw_get",
    "cache_prefetch",
    "seal",
    "ceiling_put",
    "ceiling_get",
    "raw_put_awaited",
    "raw_get_awaited",
)
#: per round, beside :data:`PATHS` (not timed): CPU seconds of the event-loop thread
#: (``time.thread_time``) during the cache's backup and prefetch, what the loop-side
#: bookkeeping costs whatever the machine's load (``loop us/page`` in the report)
LOOP_CPU = ("loop_backup", "loop_prefetch")
#: the raw file baseline's files, in the cache's shard directories (``FileStorage`` never
#: reads a name that does not end in its own suffix)
RAW_SUFFIX = ".rawbench"


@dataclass
class Plan:
    """One measurement: page size, pages per storage call, pages moved per round."""

    page_kib: int
    batch: int
    pages: int
    note: str | None = None

    @property
    def page_bytes(self) -> int:
        return self.page_kib * KiB

    @property
    def slot_bytes(self) -> int:
        return self.page_bytes + FRAME_OVERHEAD

    @property
    def name(self) -> str:
        return f"{self.page_kib}KiB_b{self.batch}"


@dataclass
class Context:
    """What one backend's measurements share: where the store is, a run-unique key prefix."""

    kind: str
    run_id: str
    storage_dir: str | None = None  #: where the file backend's temp dirs go (None: system temp)
    master: str | None = None
    metadata: str | None = None
    loopback: bool = False
    tokens: list[int] = field(default_factory=lambda: [0])

    def fresh_tokens(self, n: int) -> list[int]:
        start = self.tokens[0]
        self.tokens[0] += n
        return list(range(start, start + n))


# ---------------------------------------------------------------------- held write acks


class HeldAckEngine:
    """Copy engine of the backup measurement: copies run on a worker thread as usual, but
    while holding, their completions (the write acks) are parked until :meth:`release`.

    So the device->host copies are done before the clock starts, and the clock covers only
    what happens from the write ack on.  ``submit`` / callbacks run on the loop thread.
    """

    def __init__(self) -> None:
        self._inner = ThreadCopyEngine("aiocache-kv-bench-copy")
        self._held: list[tuple[Done, BaseException | None]] = []
        self._holding = False
        self._want = 0
        self._ready: asyncio.Event | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the worker thread."""
        self._inner.start(loop)

    def hold(self, count: int) -> None:
        """Hold the next ``count`` completions."""
        self._holding = True
        self._want = count
        self._held = []
        self._ready = asyncio.Event()
        if count <= 0:
            self._ready.set()  # nothing to wait for

    def submit(self, job: CopyJob, done: Done) -> None:
        """Run ``job`` on the worker; park its completion while holding."""
        if not self._holding:
            self._inner.submit(job, done)
            return

        def park(err: BaseException | None) -> None:
            if not self._holding:  # released before this copy landed: deliver it now
                done(err)
                return
            self._held.append((done, err))
            if len(self._held) >= self._want and self._ready is not None:
                self._ready.set()

        self._inner.submit(job, park)

    async def wait_held(self) -> None:
        """Until ``count`` copies finished (their acks parked)."""
        assert self._ready is not None
        await self._ready.wait()

    def release(self) -> None:
        """Deliver every parked completion, in order, now (on the loop)."""
        self._holding = False
        held, self._held = self._held, []
        for done, err in held:
            done(err)

    async def aclose(self) -> None:
        """Deliver what is parked, then stop the worker."""
        self.release()
        await self._inner.aclose()


# ---------------------------------------------------------------------- raw baselines


class _RawBuffer:
    """``pages`` slots of ``slot`` bytes in one tensor (the raw paths' source/destination)."""

    def __init__(self, pages: int, slot: int) -> None:
        self.slot = slot
        self.tensor = torch.empty(pages * slot, dtype=torch.uint8)
        self.tensor.fill_(0x5A)  # first touch
        base = self.tensor.data_ptr()
        self.ptrs = [base + i * slot for i in range(pages)]
        self.sizes = [slot] * pages
        view = self.tensor.numpy().data.cast("B")
        self.views = [view[i * slot : (i + 1) * slot] for i in range(pages)]
        self._bufs: list[PageBuffer] | None = None

    def _page_bufs(self) -> list[PageBuffer]:
        if self._bufs is None:
            s = self.slot
            self._bufs = [
                PageBuffer.from_tensor(self.tensor[i * s : (i + 1) * s])
                for i in range(len(self.ptrs))
            ]
        return self._bufs

    def checksum_all(self) -> None:
        """One checksum pass over every slot's payload (what a seal or a verify reads)."""
        checksums(self._page_bufs(), self.slot - FRAME_OVERHEAD)

    def seal_all(self) -> float:
        """Seconds to seal every slot (the cache's checksum work), one thread."""
        bufs = self._page_bufs()
        t0 = time.perf_counter()
        for i, b in enumerate(bufs):
            seal(b, f"bench/{i:016x}/kv")
        return time.perf_counter() - t0


class _RawMooncake:
    """``batch_put_from`` / ``batch_get_into`` on the cache's own client (blocking)."""

    def __init__(self, client: Any, buf: _RawBuffer, batch: int) -> None:
        self.client = client
        self.buf = buf
        self.batch = batch
        rc = client.register_buffer(buf.tensor.data_ptr(), buf.tensor.numel())
        if rc != 0:
            raise StorageError(f"raw baseline: register_buffer failed with {rc}")

    def put(self, keys: list[str]) -> float:
        c, b, ptrs, sizes = self.client, self.batch, self.buf.ptrs, self.buf.sizes
        codes: list[list[int]] = []
        t0 = time.perf_counter()
        for a in range(0, len(keys), b):
            codes.append(c.batch_put_from(keys[a : a + b], ptrs[a : a + b], sizes[a : a + b]))
        elapsed = time.perf_counter() - t0
        bad = [x for cs in codes for x in cs if x != 0]
        if bad:
            raise StorageError(f"raw batch_put_from failed for {len(bad)} keys (codes {bad[:4]})")
        return elapsed

    def get(self, keys: list[str]) -> float:
        c, b, ptrs, sizes = self.client, self.batch, self.buf.ptrs, self.buf.sizes
        codes: list[list[int]] = []
        t0 = time.perf_counter()
        for a in range(0, len(keys), b):
            codes.append(c.batch_get_into(keys[a : a + b], ptrs[a : a + b], sizes[a : a + b]))
        elapsed = time.perf_counter() - t0
        bad = [x for cs in codes for x in cs if x != self.buf.slot]
        if bad:
            raise StorageError(f"raw batch_get_into failed for {len(bad)} keys (codes {bad[:4]})")
        return elapsed

    def remove(self, keys: list[str]) -> None:
        self.client.batch_remove(keys, True)

    def close(self) -> None:
        self.client.unregister_buffer(self.buf.tensor.data_ptr())


class _RawFile:
    """One file per page: ``os.write`` then ``os.readv`` (blocking, no fsync).

    The files go into the shard directories of the cache's ``FileStorage`` under ``root``
    (the shard its own layout would pick for the name, a suffix it never reads).  On tmpfs
    (the default) that changes nothing; on a disk (``--storage-dir``) creating a file costs
    what allocating its inode costs in the directory's part of the file system, which
    differs by far more than any code path here (seen on the project machine's ext4: 14 us
    against 250 us per ``open(O_CREAT)`` from one temporary directory to the next), so raw
    and cache share directories."""

    def __init__(self, root: Path, buf: _RawBuffer) -> None:
        self.root = root
        self.buf = buf
        if not root.is_dir():
            raise StorageError(f"raw file baseline: {root} is not the cache's storage directory")

    def _paths(self, keys: list[str]) -> list[str]:
        names = [page_file.file_name(k) for k in keys]
        return [os.path.join(self.root, n[:2], n + RAW_SUFFIX) for n in names]

    def put(self, keys: list[str]) -> float:
        paths = self._paths(keys)
        views = self.buf.views
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        t0 = time.perf_counter()
        for path, view in zip(paths, views, strict=False):
            fd = os.open(path, flags, 0o644)
            try:
                mv = view
                while mv:
                    mv = mv[os.write(fd, mv) :]
            finally:
                os.close(fd)
        return time.perf_counter() - t0

    def get(self, keys: list[str]) -> float:
        paths = self._paths(keys)
        views = self.buf.views
        t0 = time.perf_counter()
        for path, view in zip(paths, views, strict=False):
            fd = os.open(path, os.O_RDONLY)
            try:
                got = 0
                while got < len(view):
                    n = os.readv(fd, [view[got:]])
                    if not n:
                        raise StorageError(f"raw read of {path} was short")
                    got += n
            finally:
                os.close(fd)
        return time.perf_counter() - t0

    def remove(self, keys: list[str]) -> None:
        for path in self._paths(keys):
            os.unlink(path)

    def close(self) -> None:
        pass


def beside_checksum(call: Callable[[list[str]], float], keys: list[str], buf: _RawBuffer) -> float:
    """Seconds for ``call(keys)`` with one checksum pass over the same pages on another
    thread, started together (blocking).  The cache must make that pass (seal before a put,
    verify after a get); overlapped perfectly it costs no time, and where both are bound by
    memory bandwidth this is what they take together: raw / this bounds the cache's ratio."""
    t0 = time.perf_counter()
    worker = threading.Thread(target=buf.checksum_all, name="bench-checksum")
    worker.start()
    try:
        call(keys)
    finally:
        worker.join()
    return time.perf_counter() - t0


# ---------------------------------------------------------------------- through HiCache


def _config(plan: Plan, storage: StorageBackend, namespace: str) -> CacheConfig:
    return CacheConfig(
        page_size=plan.page_bytes // TOKEN_BYTES,
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_dim=HEAD_DIM,
        dtype=DTYPE,
        device="cpu",
        device_pages=plan.pages,
        host_pages=2 * plan.pages,  # a prefetch may reserve at most half of the host pool
        write_policy="write_through",
        prefetch_policy="wait_complete",
        prefetch_batch_pages=plan.batch,
        prefetch_threshold_tokens=0,
        storage=storage,
        storage_timeout=60.0,  # a slow shared machine must not turn a round into a timeout
        namespace=namespace,
        enable_kv_events=False,
        host_memory_reserve_bytes=0,  # the suite checks free memory itself
    )


def storage_keys(config: CacheConfig, tenant: str, tokens: Sequence[int]) -> list[str]:
    """The storage keys of the KV pages a cache with ``config`` stores for ``tokens`` of
    ``tenant`` (one rank alone)."""
    tag = Namespace(config.namespace, tenant).tag
    kv = key_components(config)[0]
    hashes = chain_hashes(namespace_seed(tag), tokens, config.page_size)
    return [storage_key(tag, h, kv) for h in hashes]


async def _cache_round(
    cache: HiCache, engine: HeldAckEngine, tokens: list[int], tenant: str, batch: int
) -> tuple[float, float, float, float]:
    """Insert ``tokens`` in steps of ``batch`` pages, time backup, then a cold prefetch:
    their seconds, then the loop thread's CPU seconds during each (this runs on the loop)."""
    p = cache.config.page_size
    n = len(tokens)
    pages = n // p
    steps = pages // batch
    slots = cache.alloc(n)
    engine.hold(steps)
    handles = [
        cache.insert(tokens[: (k + 1) * batch * p], slots[: (k + 1) * batch * p], tenant=tenant)
        for k in range(steps)
    ]
    await engine.wait_held()  # every device->host copy is done; the acks are parked
    before = cache.statistics()
    c0 = time.thread_time()
    t0 = time.perf_counter()
    engine.release()
    await cache.flush()
    backup = time.perf_counter() - t0
    backup_cpu = time.thread_time() - c0
    for h in handles:
        cache.release(h)
    after = cache.statistics()
    stored = after.backup_pages_ok - before.backup_pages_ok
    if stored != pages or after.write_through_done - before.write_through_done != steps:
        raise StorageError(
            f"backup stored {stored} of {pages} pages "
            f"({after.backup_pages_failed - before.backup_pages_failed} failed)"
        )
    cache.evict(1 << 62)
    cache.evict(1 << 62, "host")  # a cold node: nothing cached, everything in storage
    c0 = time.thread_time()
    t0 = time.perf_counter()
    res = await cache.prefetch(tokens, tenant=tenant, policy="wait_complete")
    prefetch = time.perf_counter() - t0
    prefetch_cpu = time.thread_time() - c0
    if res.hit_tokens != n:
        raise StorageError(
            f"prefetch committed {res.hit_tokens} of {n} tokens "
            f"(status {res.status.value}, error {res.error})"
        )
    cache.evict(1 << 62, "host")
    return backup, prefetch, backup_cpu, prefetch_cpu


def _make_storage(ctx: Context, plan: Plan, root: Path | None) -> StorageBackend:
    if ctx.kind == "file":
        assert root is not None
        return FileStorage(root / "cache")
    total = plan.pages * plan.slot_bytes
    return MooncakeStorage(
        master=ctx.master,
        metadata_server=ctx.metadata,
        local_hostname="127.0.0.1" if ctx.loopback else None,
        protocol="tcp",
        device_name="",
        # one measurement's pages live at a time (raw or cache); room for eviction slack
        global_segment_size=2 * total + 64 * MiB,
        local_buffer_size=16 * MiB,
    )


def _fill(views: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """A non-zero pattern in every device page (runs off the loop)."""
    for layer, (k, v) in enumerate(views):
        k.fill_(0.25 + layer)
        v.fill_(-0.5 - layer)


async def measure_config(ctx: Context, plan: Plan, repeats: int) -> dict[str, list[float]]:
    """One backend/page size/batch: a warm-up round, then ``repeats`` interleaved rounds;
    per round the seconds of every path in :data:`PATHS` and the loop CPU of :data:`LOOP_CPU`."""
    secs: dict[str, list[float]] = {k: [] for k in (*PATHS, *LOOP_CPU)}
    root: Path | None = None
    if ctx.kind == "file":
        root = Path(
            await asyncio.to_thread(tempfile.mkdtemp, "", "aiocache-kv-bench-", ctx.storage_dir)
        )
    storage = _make_storage(ctx, plan, root)
    namespace = f"bench-{ctx.run_id}"
    engine = HeldAckEngine()
    p = plan.page_bytes // TOKEN_BYTES
    n = plan.pages * p
    raw: _RawMooncake | _RawFile | None = None
    try:
        async with HiCache(_config(plan, storage, namespace), copy_engine=engine) as cache:
            views = [cache.device_kv(layer) for layer in range(LAYERS)]
            await asyncio.to_thread(_fill, views)
            del views
            buf = await asyncio.to_thread(_RawBuffer, plan.pages, plan.slot_bytes)
            if isinstance(storage, MooncakeStorage):
                raw = await asyncio.to_thread(_RawMooncake, storage.raw_client, buf, plan.batch)
            else:
                assert root is not None
                raw = await asyncio.to_thread(_RawFile, root / "cache", buf)
            for rnd in range(repeats + 1):  # round 0: warm-up, not reported
                raw_keys = [f"akvbench-{ctx.run_id}-raw{rnd}-{i}" for i in range(plan.pages)]
                a0 = time.perf_counter()
                t_put = await asyncio.to_thread(raw.put, raw_keys)
                a_put = time.perf_counter() - a0
                a0 = time.perf_counter()
                t_get = await asyncio.to_thread(raw.get, raw_keys)
                a_get = time.perf_counter() - a0
                await asyncio.to_thread(raw.remove, raw_keys)
                ceil_keys = [f"akvbench-{ctx.run_id}-ceil{rnd}-{i}" for i in range(plan.pages)]
                t_cput = await asyncio.to_thread(beside_checksum, raw.put, ceil_keys, buf)
                t_cget = await asyncio.to_thread(beside_checksum, raw.get, ceil_keys, buf)
                await asyncio.to_thread(raw.remove, ceil_keys)
                t_seal = await asyncio.to_thread(buf.seal_all)
                tenant = f"r{rnd}"
                tokens = ctx.fresh_tokens(n)
                t_backup, t_prefetch, cpu_backup, cpu_prefetch = await _cache_round(
                    cache, engine, tokens, tenant, plan.batch
                )
                keys = storage_keys(cache.config, tenant, tokens)
                present = await asyncio.to_thread(storage.exists, keys)
                if not all(present):
                    raise StorageError(
                        f"bench key derivation disagrees with the cache: {sum(present)} of "
                        f"{len(keys)} keys found"
                    )
                await asyncio.to_thread(storage.remove, keys)
                if rnd:
                    times = [t_put, t_backup, t_get, t_prefetch, t_seal, t_cput, t_cget]
                    times += [a_put, a_get]
                    for key, t in zip(PATHS, times, strict=True):
                        secs[key].append(t)
                    secs["loop_backup"].append(cpu_backup)
                    secs["loop_prefetch"].append(cpu_prefetch)
            st = cache.statistics()
            if st.storage_errors or st.backup_pages_failed:
                raise StorageError(
                    f"storage errors during the bench: {st.storage_errors} errors, "
                    f"{st.backup_pages_failed} pages failed"
                )
            if raw is not None:
                await asyncio.to_thread(raw.close)
                raw = None
    finally:
        if raw is not None:
            await asyncio.to_thread(raw.close)
        if root is not None:
            await asyncio.to_thread(shutil.rmtree, root, True)
    return secs
