"""The one lifecycle of the library's long-lived objects (caches, the embedding cache)."""

from __future__ import annotations

import enum


class Lifecycle(enum.Enum):
    """Where a cache is in its life; methods other than ``start``/``aclose`` need RUNNING."""

    NEW = "new"  #: built, not started: use ``async with`` or ``await start()``
    STARTING = "starting"
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"


__all__ = ["Lifecycle"]
