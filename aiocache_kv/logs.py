"""Library logging: structured events through stdlib ``logging``, silent until configured.

Every module logs with ``log = get_logger(__name__)`` and ``log.info("event_name", key=value)``.
The events go to the stdlib logger of the module (under ``aiocache_kv``), rendered as
``event_name key=value ...``; a ``NullHandler`` on ``aiocache_kv`` keeps the library quiet
unless the application configures ``logging`` (or structlog on top of it).  A disabled level
costs one ``isEnabledFor`` check.  The CLI, the demo and the examples call
:func:`configure_console` to print concise lines on stderr.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import structlog

ROOT = "aiocache_kv"
logging.getLogger(ROOT).addHandler(logging.NullHandler())


def _to_stdlib(
    _: Any, __: str, event_dict: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Render ``event key=value ...`` as the message; keep the fields on the record
    (``record.event_dict``) for handlers that want them structured."""
    fields = " ".join(f"{k}={v!r}" for k, v in event_dict.items() if k != "event")
    msg = f"{event_dict.get('event', '')} {fields}".rstrip()
    return (msg,), {"extra": {"event_dict": dict(event_dict)}}


_PROCESSORS: list[Any] = [
    structlog.stdlib.filter_by_level,
    structlog.processors.format_exc_info,
    _to_stdlib,
]


def get_logger(name: str) -> Any:
    """A structured logger writing to the stdlib logger ``name`` (independent of any global
    structlog configuration the application may have)."""
    return structlog.wrap_logger(
        logging.getLogger(name),
        processors=_PROCESSORS,
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )


def configure_console(level: str = "info", stream: TextIO | None = None) -> None:
    """Print the library's (and the tools') logs at ``level`` and above as short lines on
    ``stream`` (default stderr).  For programs, not for the library itself."""
    handler = _ConsoleHandler(stream)
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)-7s %(message)s", datefmt="%H:%M:%S")
    )
    root = logging.getLogger(ROOT)
    for old in [h for h in root.handlers if isinstance(h, _ConsoleHandler)]:
        root.removeHandler(old)  # configuring twice replaces, never duplicates lines
    root.addHandler(handler)
    root.setLevel(level.upper())


class _ConsoleHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler :func:`configure_console` installs (so it can replace its own).

    Without a stream it writes to whatever ``sys.stderr`` is at the time of each record, so
    a progress bar that redirects stderr (``rich``) prints log lines above itself."""

    def __init__(self, stream: TextIO | None) -> None:
        super().__init__(stream if stream is not None else sys.stderr)
        self.follow_stderr = stream is None

    def emit(self, record: logging.LogRecord) -> None:
        if self.follow_stderr:
            self.stream = sys.stderr
        super().emit(record)


__all__ = ["ROOT", "configure_console", "get_logger"]
