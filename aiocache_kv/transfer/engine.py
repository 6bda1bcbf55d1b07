"""Copy engines: run device<->host page copies off the event loop and report back on it.

An engine owns the *how* of a copy; the cache owns every piece of state.  ``submit`` is called
on the loop thread; the engine runs the copy elsewhere and calls ``done(error)`` back on the
loop thread with ``loop.call_soon_threadsafe``.  It never touches a future or the tree.

* :class:`ThreadCopyEngine` - CPU: one worker thread runs the copies in submission order.
* :class:`CudaCopyEngine` - CUDA: copies are enqueued on a dedicated copy stream (after it
  waits for the compute stream), one CUDA event is recorded per job, and a waiter thread
  synchronizes on that event before reporting, so a consumer never sees unsynced KV.

On CUDA a job moves whole host slots through device staging blocks (:mod:`.staged`): a
strided host view would make torch copy through pageable memory on the loop's thread.

A device->host job given the host pool's checksum table (``CopyJob.sums``) records each
page's block-Fletcher checksum while it copies (:mod:`aiocache_kv.storage.presum`): on CPU in
the same C pass as the copy; on CUDA on the device, from the staging block, into a small
device tensor the waiter thread reads and records after the event.  Either way the sums are
written before the completion is handed to the loop.

A host->device job given ``expect`` (pages a Mooncake prefetch read without verifying their
payload, :mod:`aiocache_kv.storage.deferred`) sums those source pages and compares: on CPU in
the same C pass as the copy (block by block; without the extension, before a torch copy of
the pages before the first failure); on CUDA on the device from the staging block (what
reached the device), compared on the waiter thread after the event.  The first failure's
position goes in ``CopyJob.bad``.
"""

from __future__ import annotations

import asyncio
import enum
import queue
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from aiocache_kv.logs import get_logger
from aiocache_kv.priority import RELIEF_S, copy_on_idle_helpers, lower_current_thread
from aiocache_kv.storage.deferred import copy_to_device, first_bad, first_mismatch
from aiocache_kv.storage.presum import copy_to_host, sum_slots
from aiocache_kv.transfer.copy import copy_page_first, device_to_host, host_to_device
from aiocache_kv.transfer.staged import PinnedIds, slot_rows, stage_to_device, stage_to_host

log = get_logger(__name__)

Done = Callable[[BaseException | None], None]


class Direction(enum.Enum):
    """Which way a copy goes."""

    D2H = "device_to_host"
    H2D = "host_to_device"


@dataclass(frozen=True, slots=True)
class CopyJob:
    """One batched copy: ``src`` pages of one pool into ``dst`` pages of the other."""

    direction: Direction
    device: torch.Tensor  #: ``[layers, 2, pages, elems]``
    host: torch.Tensor  #: ``[pages, layers, 2, elems]``
    src: torch.Tensor
    dst: torch.Tensor
    #: sidecar components: ``(device buffer, host buffer)`` pairs, both page-first
    sidecars: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
    #: the host pool's ``[pages, slot_bytes]`` bytes and per-page checksum table: a D2H copy
    #: records each destination page's checksum there (see the module doc)
    host_raw: torch.Tensor | None = None
    sums: np.ndarray[Any, Any] | None = None
    #: a H2D copy of host pages that came from storage unverified: per ``src`` page the
    #: trailer's ``(S1, S2, bytes)`` (``bytes`` 0: verified already), checked against the
    #: bytes copied (:mod:`aiocache_kv.storage.deferred`); needs ``host_raw``
    expect: np.ndarray[Any, Any] | None = None
    #: written by the worker before the completion reaches the loop: the position in ``src``
    #: of the first page that failed that check (nothing from there on was copied on CPU;
    #: on CUDA it was, and those device pages must be freed unread)
    bad: list[int] = field(default_factory=list)
    #: a CUDA copy's ``(S1, S2)`` per ``src`` position, taken on the device from the staging
    #: blocks (:mod:`.staged`): int64 ``[pages, 2]`` device tensors, one per chunk, read on
    #: the waiter thread after the event (empty: no device sums, the waiter sums on the CPU)
    device_sums: list[torch.Tensor] = field(default_factory=list)
    #: on CUDA, copy through device staging blocks (False: torch's copies of the host views
    #: and CPU sums on the waiter thread, the path before staging; ``bench cuda`` compares)
    staged: bool = True

    @property
    def nbytes(self) -> int:
        """Bytes this job moves."""
        per_page = self.host[0].numel() * self.host.element_size()
        per_page += sum(h[0].numel() * h.element_size() for _, h in self.sidecars)
        return self.src.numel() * per_page

    def run(self, *, non_blocking: bool = False, ids: PinnedIds | None = None) -> None:
        """Do the copy on the calling thread (or enqueue it on the current CUDA stream;
        ``ids``: the engine's pinned ring for page ids going to the device)."""
        nb = non_blocking
        if nb and self.staged and self._enqueue_staged(ids):
            return
        if self.direction is Direction.D2H:
            if not (
                not nb
                and self.host_raw is not None
                and copy_to_host(
                    self.device, self.host_raw, self._page_bytes, self.src, self.dst, self.sums
                )
            ):
                device_to_host(self.device, self.host, self.src, self.dst, non_blocking=nb)
            for dev, host in self.sidecars:
                copy_page_first(dev, host, self.src, self.dst, non_blocking=nb)
        else:
            src, dst = self.src, self.dst
            fused = None
            if not nb and self.expect is not None and self.host_raw is not None:
                # CPU: verified block by block in the copy itself (storage/deferred.py)
                fused = copy_to_device(
                    self.host_raw, self._page_bytes, self.device, src, dst, self.expect
                )
            if fused is not None:
                if fused >= 0:
                    self.bad.append(fused)
                    src, dst = src[:fused], dst[:fused]
            else:
                if not nb and self._check():  # verify first, copy only what verified
                    src, dst = src[: self.bad[0]], dst[: self.bad[0]]
                host_to_device(self.host, self.device, src, dst, non_blocking=nb)
            for dev, host in self.sidecars:
                copy_page_first(host, dev, src, dst, non_blocking=nb)

    def _enqueue_staged(self, ring: PinnedIds | None) -> bool:
        """Enqueue a CUDA copy through device staging blocks of whole host slots (and take
        the checksums there); False: a host layout it does not take, nothing was done."""
        pools = [(self.device.permute(2, 0, 1, 3), self.host)]
        pools += [(dev, host) for dev, host in self.sidecars]
        rows = [slot_rows(host) for _, host in pools]
        if any(r is None for r in rows):
            return False
        want = (
            self.sums is not None and self.host_raw is not None
            if self.direction is Direction.D2H
            else self.expect is not None and self.host_raw is not None
        )
        sums = want and self._page_bytes % 8 == 0
        for i, ((dev, host), row) in enumerate(zip(pools, rows, strict=True)):
            assert row is not None
            if self.direction is Direction.D2H:
                got = stage_to_host(
                    dev, host, row, self.src, self.dst, sums=sums and i == 0, ring=ring
                )
            else:
                got = stage_to_device(
                    host, row, dev, self.src, self.dst, sums=sums and i == 0, ring=ring
                )
            self.device_sums.extend(got)
        return True

    def _check(self) -> bool:
        """Verify the unverified source pages of a H2D copy; whether one failed (recorded)."""
        if self.expect is None or self.host_raw is None:
            return False
        bad = first_bad(self.host_raw, self._page_bytes, self.src.numpy(), self.expect)
        if bad < 0:
            return False
        self.bad.append(bad)
        return True

    @property
    def _page_bytes(self) -> int:
        return self.host[0].numel() * self.host.element_size()

    def _read_device_sums(self) -> np.ndarray[Any, Any]:
        """The device sums as one int64 ``[pages, 2]`` array (after the event: a small
        synchronous read on the waiter thread, the copy is done)."""
        return np.concatenate([t.cpu().numpy() for t in self.device_sums])

    def after_event(self) -> None:
        """On a CUDA copy's waiter thread, once its event completed: record the checksums of
        the host pages a device->host copy wrote (pinned memory, just written)."""
        if self.direction is Direction.D2H and self.host_raw is not None and self.sums is not None:
            if self.device_sums:  # taken on the device: record them
                dst = self.dst.numpy()
                self.sums[dst, :2] = self._read_device_sums().view(np.uint64)
                self.sums[dst, 2] = self._page_bytes
            else:
                sum_slots(self.host_raw, self._page_bytes, self.dst, self.sums)
        elif self.direction is Direction.H2D:
            if self.device_sums and self.expect is not None:
                got = self._read_device_sums()
                bad = first_mismatch(got, self._page_bytes, self.expect)
                if bad >= 0:
                    self.bad.append(bad)
            else:
                self._check()  # the pinned source pages, as copied


class CopyEngine(Protocol):
    """Where copies run.  ``submit`` and ``aclose`` are called on the loop thread."""

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Bind to ``loop`` (completions are delivered there)."""

    def submit(self, job: CopyJob, done: Done) -> None:
        """Start ``job``; ``done(None | error)`` runs later on the loop thread."""

    async def aclose(self) -> None:
        """Finish queued jobs and stop workers."""


class _Job(Protocol):
    def run(self, *, non_blocking: bool = False) -> None: ...


class ThreadCopyEngine:
    """CPU engine: a worker thread does the copies, in order.

    ``threads`` caps torch's intra-op threads *for the worker only* (OpenMP keeps the setting
    per thread; the model's threads are untouched).  ``None`` keeps torch's default.  ``nice``
    lowers the worker's CPU priority (and that of the OpenMP threads it starts) so the event
    loop wins a contended core (:mod:`aiocache_kv.priority`).  Measured on 2 cores, 1 GiB
    written through, loop-lag p99: default threads at nice 0 1.3-4.2 ms, at nice +10
    0.8-1.0 ms at the same bandwidth; 1 thread ~1-1.5 ms at 0.65x the bandwidth.  ``idle``
    runs its CPU page copies on idle helpers it relieves when they starve
    (:mod:`aiocache_kv.priority`).
    """

    def __init__(
        self,
        name: str = "aiocache-kv-copy",
        *,
        threads: int | None = None,
        nice: int = 0,
        idle: bool = False,
    ) -> None:
        self._name = name
        self._threads = threads
        self._nice = nice
        self._idle = idle
        self._queue: queue.SimpleQueue[tuple[_Job, Done] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the worker thread; completions go to ``loop``."""
        # the thread holds neither the engine nor a finished job, so a cache dropped unclosed
        # is collected (ending its claim on a storage backend), and with it the engine, whose
        # finalizer stops the thread
        setup = (self._name, self._threads, self._nice, self._idle)
        self._thread = threading.Thread(
            target=_work, args=(self._queue, loop, *setup), name=self._name, daemon=True
        )
        self._thread.start()
        weakref.finalize(self, self._queue.put, None)

    def submit(self, job: _Job, done: Done) -> None:
        """Queue ``job`` for the worker."""
        assert self._thread is not None, "engine not started"
        self._queue.put((job, done))

    async def aclose(self) -> None:
        """Let queued jobs finish, then join the worker (off the loop)."""
        if self._thread is None:
            return
        self._queue.put(None)
        await asyncio.to_thread(self._thread.join)
        self._thread = None


def _work(
    jobs: queue.SimpleQueue[tuple[_Job, Done] | None],
    loop: asyncio.AbstractEventLoop,
    name: str,
    threads: int | None,
    nice: int,
    idle: bool,
) -> None:
    """A :class:`ThreadCopyEngine`'s worker thread: run the jobs in order, each completion
    handed to ``loop``; ``None`` stops it."""
    # a setup that raises fails every job (none runs), rather than killing the worker
    # and leaving each copy's completion, and whoever awaits it, waiting forever
    broken: BaseException | None = None
    try:
        # first: the OpenMP threads started below inherit the priority
        lower_current_thread(nice)
        copy_on_idle_helpers(RELIEF_S if idle else None)
        if threads is not None:
            torch.set_num_threads(threads)
    except Exception as exc:
        log.error("copy_worker_setup_failed", worker=name, error=repr(exc))
        broken = exc
    while True:
        item = jobs.get()
        if item is None:
            return
        job, done = item
        err: BaseException | None = broken
        if broken is None:
            try:
                job.run()
            except BaseException as exc:  # delivered to the loop, never swallowed
                err = exc
        try:
            loop.call_soon_threadsafe(done, err)
        except RuntimeError:  # loop closed: nobody is waiting any more
            log.warning("copy completion dropped: event loop closed")
        del item, job, done, err  # nothing of a finished job stays alive while waiting


class CudaCopyEngine:
    """CUDA engine: one copy stream, one event per job, a waiter thread per engine."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._index = 0  # the device's index, resolved at start
        self._stream: torch.cuda.Stream | None = None
        self._waiter = ThreadCopyEngine("aiocache-kv-cuda-wait")
        self._ids = PinnedIds()  # page ids going to the device (scattered pages)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Create the copy stream and start the waiter thread."""
        # an explicit index: torch resolves a bare "cuda" through is_available() on every
        # current_stream() call (~10 us on the loop per copy instead of ~4)
        index = self._device.index
        self._index = torch.cuda.current_device() if index is None else index
        self._stream = torch.cuda.Stream(device=self._index)  # type: ignore[no-untyped-call]
        self._waiter.start(loop)

    def submit(self, job: CopyJob, done: Done) -> None:
        """Enqueue ``job`` on the copy stream and hand its event to the waiter thread."""
        stream = self._stream
        assert stream is not None, "engine not started"
        stream.wait_stream(torch.cuda.current_stream(self._index))
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        error: BaseException | None = None
        try:
            with torch.cuda.stream(stream):
                job.run(non_blocking=True, ids=self._ids)
        except BaseException as exc:  # (an allocation failing midway, say)
            error = exc
        try:
            # after whatever the job enqueued before it failed: its error is reported only
            # once those copies are done with the pages (rule 2), never while they run
            event.record(stream)
        except BaseException as exc:
            done(error or exc)
            return
        self._waiter.submit(_EventWait(event, job, error), done)

    async def aclose(self) -> None:
        """Wait for every recorded event, then stop the waiter."""
        await self._waiter.aclose()


@dataclass(frozen=True, slots=True)
class _EventWait:
    """A waiter-thread job: block until the copy's CUDA event has completed."""

    event: torch.cuda.Event
    job: CopyJob
    error: BaseException | None = None  #: the job failed while enqueuing: reported after

    def run(self, *, non_blocking: bool = False) -> None:
        self.event.synchronize()
        if self.error is not None:
            raise self.error
        self.job.after_event()  # before the completion reaches the loop


def default_engine(
    device: torch.device, threads: int | None = None, nice: int = 0, idle: bool = False
) -> CopyEngine:
    """The engine for ``device``: CUDA streams on GPUs, a worker thread otherwise."""
    if device.type == "cuda":
        return CudaCopyEngine(device)
    return ThreadCopyEngine(threads=threads, nice=nice, idle=idle)
