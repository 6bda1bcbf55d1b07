"""The defaults of ``aiocache-kv demo``'s workload options: one table that the demo reads and
the command line shows (no heavy imports, so ``--help`` stays fast)."""

from __future__ import annotations

from typing import Any

#: option -> default (``aiocache-kv demo --help`` prints these)
DEFAULTS: dict[str, Any] = {
    "page_size": 16,
    # by the last turn the four histories (45 pages) outgrow the device pool: part of some
    # prefix is served from host whatever order the batch ran in
    "device_pages": 40,
    "host_pages": 96,
    "seed": 0,
    "conversations": 4,
    "turns": 4,
    "new_tokens": 12,
    "system_tokens": 160,
    "storage": "file",
    "max_batch_tokens": 256,
}
