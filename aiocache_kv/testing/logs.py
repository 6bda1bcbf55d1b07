"""``capture_logs``: the library's structured log events, as dicts, for assertions."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from aiocache_kv.logs import ROOT


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.events: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "event_dict", {"event": record.getMessage()})
        self.events.append({**fields, "log_level": record.levelname.lower()})


@contextlib.contextmanager
def capture_logs() -> Iterator[list[dict[str, Any]]]:
    """Collect every event the library logs inside the block (all levels), each a dict
    ``{"event": ..., "log_level": ..., **fields}`` like structlog's own ``capture_logs``."""
    logger = logging.getLogger(ROOT)
    handler = _Collect()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler.events
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


__all__ = ["capture_logs"]
