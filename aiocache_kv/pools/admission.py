"""Host memory admission: refuse to start when the host pools would not fit."""

from __future__ import annotations

from aiocache_kv.errors import HostMemoryError


def available_host_bytes() -> int:
    """``MemAvailable`` from ``/proc/meminfo`` (falls back to physical pages where absent)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def admit_host_bytes(requested: int, reserve: int, available: int | None = None) -> None:
    """Check that ``requested`` host bytes fit in available memory minus ``reserve``.

    Raises:
        HostMemoryError: naming the requested, available and reserved bytes.
    """
    avail = available_host_bytes() if available is None else available
    if requested > avail - reserve:
        raise HostMemoryError(
            f"host pools need {requested} bytes ({requested / 2**30:.2f} GiB) but only "
            f"{avail} bytes ({avail / 2**30:.2f} GiB) are available and {reserve} bytes "
            f"({reserve / 2**30:.2f} GiB) are reserved; lower host_pages or "
            "host_memory_reserve_bytes"
        )
