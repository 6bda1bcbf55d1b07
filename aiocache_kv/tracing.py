"""Optional OpenTelemetry spans around the cache's slow steps: prefetch, load-back, backup.

With ``opentelemetry-api`` installed (``pip install aiocache_kv[tracing]``) each of these is a
span of the tracer ``aiocache_kv``, a child of whatever span is current where the step starts
(the request's, when the serving loop traces requests), so a request's trace shows where its
cache time went: ``aiocache_kv.prefetch`` (storage -> host), ``aiocache_kv.load_back`` (host ->
device), ``aiocache_kv.backup`` (host -> storage: a background task started when a
write-through lands, so its span is a root of its own).  Attributes are prefixed
``aiocache_kv.``: tokens or pages, hits, the outcome.  Without the package, or without a
tracer provider configured, no span is made: the cost is a context manager.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType
from typing import Any, Protocol

_otel: ModuleType | None
try:
    from opentelemetry import trace as _otel
except ImportError:  # the optional extra is not installed
    _otel = None

__all__ = ["SpanLike", "enabled", "span"]

_TRACER_NAME = "aiocache_kv"
_tracer: Any = None


class SpanLike(Protocol):
    """The part of an OpenTelemetry span the cache uses."""

    def set_attribute(self, key: str, value: Any) -> Any: ...


class _NoSpan:
    def set_attribute(self, key: str, value: Any) -> None:
        """Nothing to record."""


_NO_SPAN = _NoSpan()


def enabled() -> bool:
    """Whether ``opentelemetry-api`` is importable (spans are then created)."""
    return _otel is not None


@contextlib.contextmanager
def span(name: str, **attributes: int | str) -> Iterator[SpanLike]:
    """A span named ``name`` with ``attributes`` (keys get the ``aiocache_kv.`` prefix), current
    for the body; an exception escaping the body is recorded and marks it as an error."""
    if _otel is None or type(_otel.get_tracer_provider()) is _otel.ProxyTracerProvider:
        # no provider configured (yet): nothing would be recorded, so no span is made (a
        # non-recording one costs ~7 us, on the loop, per backup and prefetch)
        yield _NO_SPAN
        return
    global _tracer
    tracer = _tracer
    if tracer is None:  # a proxy until the application sets a provider: safe to keep
        tracer = _tracer = _otel.get_tracer(_TRACER_NAME)
    attrs = {f"aiocache_kv.{k}": v for k, v in attributes.items()}
    with tracer.start_as_current_span(name, attributes=attrs) as sp:
        yield sp
