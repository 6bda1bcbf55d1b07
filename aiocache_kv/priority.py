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
"""

from __future__ import annotations

import os
import sys
import threading

from aiocache_kv.logs import get_logger

__all__ = ["lower_current_thread"]

log = get_logger(__name__)


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
