"""Benchmark of the storage tier (L3): backup and prefetch through ``HiCache`` vs the raw backend.

For each backend (``file``, ``mooncake``), page size (64 KiB .. 4 MiB of KV per page, all
layers) and batch (pages per storage call), the suite moves the same pages two ways in every
round and reports GB/s (payload bytes, 10^9) and the ratio cache / raw of the same round
(median over rounds; target >= 0.9):

* **raw** - the backend's own primitive, one thread, the calls in a plain loop:

  - Mooncake: ``MooncakeDistributedStore.batch_put_from`` / ``batch_get_into`` of ``batch``
    keys per call on a registered buffer, fresh keys every round (a put on an existing key is
    a no-op), through the *same* client (one segment, so placement is the same for both paths).
  - file: one file per page in a temporary directory, ``os.open`` + ``os.write`` (no fsync:
    ``FileStorage``'s default policy ``"never"``), then ``os.open`` + ``os.readv`` into the
    buffer; fresh file names every round.  Files have no batch call: batch only changes how
    the cache groups its calls.

  Raw objects are the size the cache stores (page + the 40-byte integrity trailer).

* **cache backup** - a ``write_through`` ``HiCache`` with ``storage=`` the backend.  One
  sequence of ``pages`` pages is inserted in steps of ``batch`` pages (each insert = one
  device->host copy = one backup put of ``batch`` pages).  The bench's copy engine runs the
  device->host copies but *holds their completions* (the write acks); the clock starts when
  the acks are delivered and stops when ``await cache.flush()`` returns, i.e. it measures from
  the write ack to the storage ack: ack bookkeeping, key derivation, dispatch to the storage
  workers, the integrity seal, the backend's existence check and the put - and none of the
  device->host copy, which ``bench transfer`` measures.

* **cache prefetch** - the tree is then emptied (evict device, then host: a cold node), and
  ``await cache.prefetch(tokens, policy="wait_complete")`` is timed: existence check of every
  page, host page reservation, reads in chunks of ``prefetch_batch_pages = batch`` pages,
  integrity verification and commit.  It must commit every page.

The cache uses its default 2 storage workers (so up to two calls overlap); raw is one thread.
A **seal** column gives the single-thread speed of the integrity checksum over the same pages
(``integrity.seal``), the main extra work of the cache path.  Pages written by a round are
removed (untimed) before the next; one untimed warm-up round first touches every buffer, file
and store segment page.

KV geometry: 4 layers x 8 KV heads x head_dim 128, float16 (16 KiB per token), so a 64 KiB page
is 4 tokens and a 4 MiB page 256 tokens.  The device pool holds ``pages`` pages and the host
pool ``2 * pages`` (a prefetch may reserve at most half of the host pool).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from aiocache_kv.bench.report import JSON, fmt_bytes, heading, median, ratio, table
from aiocache_kv.cache import HiCache
from aiocache_kv.config import CacheConfig
from aiocache_kv.errors import InvalidInputError, KVCacheError, StorageError
from aiocache_kv.logs import get_logger
from aiocache_kv.namespace import Namespace
from aiocache_kv.pools import available_host_bytes
from aiocache_kv.storage import FRAME_OVERHEAD, FileStorage, MooncakeStorage, PageBuffer
from aiocache_kv.storage.base import StorageBackend
from aiocache_kv.storage.integrity import seal
from aiocache_kv.storage.keys import storage_key
from aiocache_kv.transfer import CopyJob, ThreadCopyEngine
from aiocache_kv.transfer.engine import Done
from aiocache_kv.tree.hashing import chain_hashes, namespace_seed

log = get_logger(__name__)

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
LAYERS = 4
HEADS = 8
HEAD_DIM = 128
DTYPE = torch.float16
TOKEN_BYTES = LAYERS * 2 * HEADS * HEAD_DIM * 2  # 16 KiB
TARGET_RATIO = 0.9
BACKENDS = ("file", "mooncake")
#: the host pool of one measurement stays below this
MAX_HOST_POOL = 2 * GiB
#: keep this much memory free beyond what the suite allocates
HEADROOM = 2 * GiB
PATHS = ("raw_put", "cache_backup", "raw_get", "cache_prefetch", "seal")


@dataclass(frozen=True)
class StorageBenchOptions:
    """Knobs of the storage benchmark."""

    backends: tuple[str, ...] = BACKENDS
    page_kib: tuple[int, ...] = (64, 256, 1024, 4096)
    batches: tuple[int, ...] = (16, 128)
    mib: int = 128
    repeats: int = 3
    master: str | None = None
    metadata: str | None = None
    storage_dir: str | None = None
    explicit_backend: bool = False  #: a backend named on the command line must not be skipped


@dataclass
class _Plan:
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
class _Context:
    """What one backend's measurements share: where the store is, a run-unique key prefix."""

    kind: str
    run_id: str
    opts: StorageBenchOptions
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

    def submit(self, job: CopyJob, done: Done) -> None:
        """Run ``job`` on the worker; park its completion while holding."""
        if not self._holding:
            self._inner.submit(job, done)
            return

        def park(err: BaseException | None) -> None:
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

    def seal_all(self) -> float:
        """Seconds to seal every slot (the cache's checksum work), one thread."""
        if self._bufs is None:
            s = self.slot
            self._bufs = [
                PageBuffer.from_tensor(self.tensor[i * s : (i + 1) * s])
                for i in range(len(self.ptrs))
            ]
        bufs = self._bufs
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
    """One file per page: ``os.write`` then ``os.readv`` (blocking, no fsync)."""

    def __init__(self, root: Path, buf: _RawBuffer) -> None:
        self.root = root
        self.buf = buf
        root.mkdir(parents=True, exist_ok=True)

    def _paths(self, keys: list[str]) -> list[str]:
        return [os.path.join(self.root, k) for k in keys]

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


# ---------------------------------------------------------------------- through HiCache


def _config(plan: _Plan, storage: StorageBackend, namespace: str) -> CacheConfig:
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


def storage_keys(namespace: str, tenant: str, tokens: Sequence[int], page_size: int) -> list[str]:
    """The storage keys the cache uses for ``tokens`` in ``Namespace(namespace, tenant)``."""
    tag = Namespace(namespace, tenant).tag
    return [storage_key(tag, h) for h in chain_hashes(namespace_seed(tag), tokens, page_size)]


async def _cache_round(
    cache: HiCache, engine: HeldAckEngine, tokens: list[int], tenant: str, batch: int
) -> tuple[float, float]:
    """Insert ``tokens`` in steps of ``batch`` pages, time backup, then a cold prefetch."""
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
    t0 = time.perf_counter()
    engine.release()
    await cache.flush()
    backup = time.perf_counter() - t0
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
    t0 = time.perf_counter()
    res = await cache.prefetch(tokens, tenant=tenant, policy="wait_complete")
    prefetch = time.perf_counter() - t0
    if res.hit_tokens != n:
        raise StorageError(
            f"prefetch committed {res.hit_tokens} of {n} tokens "
            f"(status {res.status.value}, error {res.error})"
        )
    cache.evict(1 << 62, "host")
    return backup, prefetch


def _make_storage(ctx: _Context, plan: _Plan, root: Path | None) -> StorageBackend:
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


async def measure_config(ctx: _Context, plan: _Plan, repeats: int) -> dict[str, list[float]]:
    """One backend/page size/batch: a warm-up round, then ``repeats`` interleaved rounds."""
    secs: dict[str, list[float]] = {k: [] for k in PATHS}
    root: Path | None = None
    if ctx.kind == "file":
        root = Path(
            await asyncio.to_thread(
                tempfile.mkdtemp, "", "aiocache-kv-bench-", ctx.opts.storage_dir
            )
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
                raw = await asyncio.to_thread(_RawFile, root / "raw", buf)
            for rnd in range(repeats + 1):  # round 0: warm-up, not reported
                raw_keys = [f"akvbench-{ctx.run_id}-raw{rnd}-{i}" for i in range(plan.pages)]
                t_put = await asyncio.to_thread(raw.put, raw_keys)
                t_get = await asyncio.to_thread(raw.get, raw_keys)
                await asyncio.to_thread(raw.remove, raw_keys)
                t_seal = await asyncio.to_thread(buf.seal_all)
                tenant = f"r{rnd}"
                tokens = ctx.fresh_tokens(n)
                t_backup, t_prefetch = await _cache_round(cache, engine, tokens, tenant, plan.batch)
                keys = storage_keys(namespace, tenant, tokens, p)
                present = await asyncio.to_thread(storage.exists, keys)
                if not all(present):
                    raise StorageError(
                        f"bench key derivation disagrees with the cache: {sum(present)} of "
                        f"{len(keys)} keys found"
                    )
                await asyncio.to_thread(storage.remove, keys)
                if rnd:
                    for key, t in zip(
                        PATHS, (t_put, t_backup, t_get, t_prefetch, t_seal), strict=True
                    ):
                        secs[key].append(t)
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


# ---------------------------------------------------------------------- planning and driver


def _plans(opts: StorageBenchOptions, kind: str) -> tuple[list[_Plan], list[str]]:
    """Page counts per (page size, batch), scaled to fit memory; notes for what was cut."""
    plans: list[_Plan] = []
    notes: list[str] = []
    avail = available_host_bytes()
    for kib in opts.page_kib:
        if kib * KiB % TOKEN_BYTES:
            raise InvalidInputError(
                f"page size {kib} KiB is not a multiple of {TOKEN_BYTES // KiB} KiB"
            )
        for batch in opts.batches:
            slot = kib * KiB + FRAME_OVERHEAD
            pages = max(opts.mib * MiB // (kib * KiB), batch) // batch * batch
            # device 1x + host 2x + raw buffer 1x (+ Mooncake segment 2x)
            copies = 4 + (2 if kind == "mooncake" else 0)
            note = None
            while pages > batch and (
                2 * pages * slot > MAX_HOST_POOL or copies * pages * slot + HEADROOM > avail
            ):
                pages = max(batch, pages // 2 // batch * batch)
                note = f"{kib} KiB x batch {batch}: scaled down to {pages} pages to fit memory"
            if 2 * pages * slot > MAX_HOST_POOL or copies * pages * slot + HEADROOM > avail:
                notes.append(
                    f"{kib} KiB x batch {batch}: skipped, one batch ({fmt_bytes(batch * slot)}) "
                    f"does not fit the memory budget ({fmt_bytes(avail)} available)"
                )
                continue
            if note:
                notes.append(note)
            plans.append(_Plan(kib, batch, pages, note))
    return plans, notes


def _summarise(plan: _Plan, secs: dict[str, list[float]]) -> JSON:
    nbytes = plan.pages * plan.page_bytes
    gbs = {k: nbytes / median(v) for k, v in secs.items()}
    pairs = {"backup": ("raw_put", "cache_backup"), "prefetch": ("raw_get", "cache_prefetch")}
    per_round = {
        name: median([r / c for r, c in zip(secs[raw], secs[cached], strict=True)])
        for name, (raw, cached) in pairs.items()
    }
    return {
        "page_bytes": plan.page_bytes,
        "page_tokens": plan.page_bytes // TOKEN_BYTES,
        "batch": plan.batch,
        "pages": plan.pages,
        "bytes": nbytes,
        "gbs": gbs,
        "ratio": per_round,
        "ratio_of_medians": {
            name: ratio(gbs[cached], gbs[raw]) for name, (raw, cached) in pairs.items()
        },
        "spread": {  # (max - min) / median of each path's GB/s over the rounds
            k: (max(v) - min(v)) / median(v) if len(v) > 1 else 0.0 for k, v in secs.items()
        },
        "seconds": secs,
        **({"note": plan.note} if plan.note else {}),
    }


def _row(name: str, e: JSON) -> list[object]:
    g = e["gbs"]
    r = e["ratio"]

    def verdict(x: float) -> str:
        return "met" if x >= TARGET_RATIO else "below"

    return [
        f"{e['page_bytes'] // KiB} KiB",
        e["batch"],
        e["pages"],
        f"{g['raw_put'] / 1e9:.2f}",
        f"{g['cache_backup'] / 1e9:.2f}",
        f"{r['backup']:.2f} {verdict(r['backup'])}",
        f"{g['raw_get'] / 1e9:.2f}",
        f"{g['cache_prefetch'] / 1e9:.2f}",
        f"{r['prefetch']:.2f} {verdict(r['prefetch'])}",
        f"{g['seal'] / 1e9:.1f}",
        f"{100 * max(e['spread'].values()):.0f}%",
    ]


_HEADERS = [
    "page",
    "batch",
    "pages",
    "raw put",
    "cache backup",
    "ratio",
    "raw get",
    "cache prefetch",
    "ratio",
    "seal",
    "spread",
]


def _run_backend(ctx: _Context) -> JSON:
    plans, notes = _plans(ctx.opts, ctx.kind)
    out: JSON = {"configs": {}, "notes": notes}
    for note in notes:
        print(note)
        log.warning("storage_bench_scaled", note=note)
    rows: list[list[object]] = []
    for plan in plans:
        t0 = time.perf_counter()
        secs = asyncio.run(measure_config(ctx, plan, ctx.opts.repeats))
        gc.collect()
        entry = _summarise(plan, secs)
        entry["elapsed_s"] = time.perf_counter() - t0
        out["configs"][plan.name] = entry
        rows.append(_row(plan.name, entry))
        log.info(
            "storage_bench_config",
            backend=ctx.kind,
            config=plan.name,
            elapsed_s=round(entry["elapsed_s"], 2),
        )
    heading(
        f"{ctx.kind}: GB/s (payload, 10^9 B/s), median of {ctx.opts.repeats}; "
        f"ratio = cache / raw per round, median (target >= {TARGET_RATIO})"
    )
    table(_HEADERS, rows)
    return out


def _mooncake_context(ctx: _Context, opts: StorageBenchOptions) -> str | None:
    """Fill in master/metadata (given, or None for a loopback master); why it can't run."""
    from aiocache_kv.testing.mooncake_master import loopback_client_env, mooncake_available

    if opts.master is not None:
        try:
            import mooncake.store  # noqa: F401
        except ImportError as exc:
            return f"mooncake client not importable ({exc})"
        ctx.master = opts.master
        ctx.metadata = opts.metadata
        return None
    reason = mooncake_available()
    if reason is None:
        loopback_client_env()
        ctx.loopback = True
    return reason


def file_bench_dir(given: str | None) -> str | None:
    """Where the file backend's temp dirs go: ``given``, else ``/dev/shm`` (tmpfs) when
    writable, else the system temp dir (``None``).

    tmpfs by default because the suite compares the *code paths* (FileStorage vs plain
    syscalls on the same bytes): on the project's VM disk (ext4 with ``discard``), creating
    files right after deleting others stalls for seconds at random, which swamps both paths.
    Pass ``--storage-dir`` to measure a real disk.
    """
    if given is not None:
        return given
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        return shm
    return None


def run(opts: StorageBenchOptions) -> JSON:
    """Run the storage benchmark, print its tables and return the JSON-able results."""
    heading("bench storage: L3 backup / prefetch through HiCache vs the raw backend (same run)")
    t_start = time.perf_counter()
    print(
        f"KV geometry {LAYERS} layers x {HEADS} heads x {HEAD_DIM} dims, float16 "
        f"({fmt_bytes(TOKEN_BYTES)}/token); about {opts.mib} MiB (at least one batch) per "
        f"measurement; one warm-up round, then median of {opts.repeats}.\n"
        "raw: the backend primitive in one thread (Mooncake batch_put_from / batch_get_into "
        "on a registered buffer, same client; file: os.write / os.readv, one file per page, "
        "no fsync), fresh keys per round, objects of page + 40-byte trailer.\n"
        "cache backup: timed from the write acks (device->host copies already done, acks held "
        "by the bench's copy engine) to `await cache.flush()`: key derivation, dispatch, seal "
        "(checksum), exists check, put; 2 storage workers.\n"
        "cache prefetch: `await cache.prefetch(tokens, policy='wait_complete')` on an emptied "
        "tree: exists check, host reservation, reads of `batch` pages per call, verify, commit.\n"
        "seal: single-thread integrity checksum of the same pages (GB/s); spread: largest "
        "(max-min)/median over the rounds."
    )
    run_id = uuid.uuid4().hex[:8]
    results: JSON = {
        "geometry": {"layers": LAYERS, "kv_heads": HEADS, "head_dim": HEAD_DIM, "dtype": "float16"},
        "target_mib_per_measurement": opts.mib,
        "repeats": opts.repeats,
        "target_ratio": TARGET_RATIO,
        "method": {
            "raw": "backend primitive, one thread, fresh keys, registered buffer (Mooncake, same "
            "client as the cache) / os.write+os.readv one file per page, no fsync (file)",
            "cache_backup": "write ack delivered -> await cache.flush() (device->host copy "
            "excluded); 2 storage workers",
            "cache_prefetch": "await cache.prefetch(tokens, policy='wait_complete') on an "
            "emptied tree; prefetch_batch_pages = batch",
            "ratio": "cache GB/s / raw GB/s of the same round, median over rounds",
        },
        "backends": {},
        "errors": [],
    }
    if "file" in opts.backends:
        where = file_bench_dir(opts.storage_dir)
        opts = dataclasses.replace(opts, storage_dir=where)
        where = where or tempfile.gettempdir()
        tmpfs = " (tmpfs: measures the code path, not a disk)" if where == "/dev/shm" else ""
        print(f"file backend directory: {where}{tmpfs}")
        results["file_dir"] = where
    for kind in opts.backends:
        ctx = _Context(kind, run_id, opts)
        master = None
        try:
            if kind == "mooncake":
                reason = _mooncake_context(ctx, opts)
                if reason is not None:
                    if opts.explicit_backend:
                        raise StorageError(f"mooncake backend unavailable: {reason}")
                    print(f"\nmooncake: skipped ({reason})")
                    results["backends"][kind] = {"skipped": reason}
                    continue
                if ctx.loopback:
                    from aiocache_kv.testing.mooncake_master import LoopbackMaster

                    master = LoopbackMaster()
                    master.start()
                    ctx.master, ctx.metadata = master.rpc_addr, master.metadata_url
                    print(f"\nmooncake: started a loopback master at {master.rpc_addr}")
                else:
                    print(
                        f"\nmooncake: master {opts.master}; with other clients mounted, "
                        "placement is random across segments (raw and cache alike)"
                    )
            results["backends"][kind] = _run_backend(ctx)
        except (KVCacheError, OSError) as exc:
            msg = f"{kind}: {type(exc).__name__}: {exc}"
            print(f"\nstorage bench failed: {msg}")
            log.error("storage_bench_failed", backend=kind, error=str(exc))
            results["backends"][kind] = {"error": msg}
            results["errors"].append(msg)
        finally:
            if master is not None:
                master.terminate()
    results["elapsed_s"] = time.perf_counter() - t_start
    print(f"(storage bench took {results['elapsed_s']:.1f} s)")
    return results
