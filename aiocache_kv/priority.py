"""Background threads yield the CPU to the event loop.

A serving loop's latency is what a request feels; a copy or storage worker's is not.  On a
machine with few cores, a worker that saturates them (torch's intra-op threads copying KV,
the seal of a storage batch) delays the loop's wake-ups by whole scheduler slices: measured
on 2 cores, 1 GiB written through gave loop-lag p99 of 1.3-4.2 ms at the default priority
and 0.8-1.0 ms with the copy worker at nice +10, at the same bandwidth (niceness only
matters while the CPU is contended).

Linux keeps the nice value per thread and a thread inherits it at creation, so a worker
that lowers its own priority first also lowers the OpenMP threads torch starts from it.
Elsewhere ``setpriority`` would apply to the whole process, so it is not called.

Stronger, and the default (``CacheConfig.worker_idle``): the copies themselves on idle
helpers.  The copy worker stays at nice +10 and hands each CPU page copy over
:data:`IDLE_INLINE_BYTES` to C threads that put themselves under ``SCHED_IDLE``
(``storage/_idlerun.h``): they take a core only when no other thread wants it, so the loop
and the model always preempt them, and they hold neither the GIL nor a lock the worker waits
on, so a preempted helper stalls nobody (a whole worker thread under ``SCHED_IDLE`` would:
preempted while it holds the GIL, it keeps the loop waiting until a core is free).  A copy
not finished by its deadline (:data:`RELIEF_S`, or its size at 0.5 GB/s: the helpers starve,
every core busy with other work) the worker finishes itself, at its own priority; reliefs in
a row shorten the deadline and then have the process copy at once for 0.1-1.6 s at a time,
so a saturated machine copies about as fast as at nice +10.  Measured on 2 cores with the
engine's batch full and 1 GiB written through (``bench lag``): loop-lag p99 0.63-0.70 ms
against 1.47-2.72 ms with the worker copying itself at nice +10.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import NamedTuple

from aiocache_kv.extensions import optional_extension
from aiocache_kv.logs import get_logger

__all__ = [
    "IDLE_INLINE_BYTES",
    "RELIEF_S",
    "IdleCopies",
    "copy_on_idle_helpers",
    "forget_idle_starvation",
    "idle_copies",
    "idle_helpers_ready",
    "idle_relief_ns",
    "lower_current_thread",
]

log = get_logger(__name__)

_EXT = optional_extension("aiocache_kv.storage._blocksum")


def lower_current_thread(increment: int) -> bool:
    """Raise the calling thread's nice value by ``increment`` (Linux only; ``0`` does
    nothing).  Returns whether the priority was changed; a refusal is logged, not raised
    (lowering priority is never needed for correctness)."""
    if increment <= 0 or sys.platform != "linux":
        return False
    tid = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, current + increment))
    except OSError as exc:
        log.warning("worker_priority_unchanged", error=str(exc), increment=increment)
        return False
    return True


#: seconds after which the copy worker relieves idle helpers that have not finished its copy
#: (at least; a large copy gets as long as it takes at 0.5 GB/s), shortened while they keep
#: starving (``storage/_idlerun.h``)
RELIEF_S = 0.005

#: a copy this small runs on the copy worker itself even with idle helpers (the C runner's
#: threshold: two wake-ups cost about as much as copying it)
IDLE_INLINE_BYTES: int = getattr(_EXT, "IDLE_INLINE_BYTES", 1 << 20)

_copier = threading.local()


def copy_on_idle_helpers(relief_s: float | None) -> None:
    """From now on, the CPU page copies over :data:`IDLE_INLINE_BYTES` the calling thread runs
    in C go to idle helpers; it relieves them of a copy not finished ``relief_s`` seconds
    after it started, or later for a large one (``None``: the thread copies itself, as torch
    would).  A copy worker's setting, like torch's thread count."""
    _copier.relief_ns = 0 if relief_s is None else max(1, round(relief_s * 1e9))


def idle_helpers_ready() -> bool:
    """Whether a copy now would run on idle helpers: ``False`` while the process copies at
    once because its helpers starved (``True`` without the C extension: nothing to hold)."""
    ready = getattr(_EXT, "idle_ready", None)
    return True if ready is None else bool(ready())


def forget_idle_starvation() -> None:
    """Start the idle helpers' adaptation afresh: full deadlines, no hold to copies at once
    (for tests and benchmark arms that must not inherit an earlier one's busy machine)."""
    forget = getattr(_EXT, "idle_forget", None)
    if forget is not None:
        forget()


def idle_relief_ns() -> int:
    """The calling thread's :func:`copy_on_idle_helpers` setting in nanoseconds (0: off)."""
    relief: int = getattr(_copier, "relief_ns", 0)
    return relief


class IdleCopies(NamedTuple):
    """Copies run on idle helpers since the process started (all threads)."""

    copies: int
    relieved: int  #: of them, relieved by their worker (not done by their deadline)
    relieved_chunks: int  #: chunks the workers copied themselves


def idle_copies() -> IdleCopies:
    """The process's :class:`IdleCopies` counters (zeros without the C extension)."""
    stats = getattr(_EXT, "idle_stats", None)
    return IdleCopies(*stats()) if stats is not None else IdleCopies(0, 0, 0)
