"""Numeric options and arguments: real, finite, in range, never ``bool``.

A NaN that becomes a deadline breaks the event loop's timer heap (every comparison with it is
false, so the heap's order is lost and timers due now wait behind ones due later: an unrelated
``asyncio.sleep(0.01)`` took 10 s), and an infinite one makes a wait unbounded.  So every
number that can become a deadline, a delay, a size or a count is checked where the caller
passes it (a config at construction, an argument at the call), before any state changes, and
the typed error names the offending value.
"""

from __future__ import annotations

import math
import threading

from aiocache_kv.errors import InvalidInputError

#: the longest wait, in seconds, that every timer accepts (``threading``'s waits raise
#: ``OverflowError`` above it)
MAX_SECONDS = threading.TIMEOUT_MAX


def check_real(
    name: str,
    value: object,
    *,
    minimum: float | None = 0.0,
    exclusive: bool = False,
    maximum: float = MAX_SECONDS,
    error: type[InvalidInputError] = InvalidInputError,
) -> float:
    """``value`` as a float: an int or float (not a ``bool``), finite, at least ``minimum``
    (above it with ``exclusive``; ``None``: no lower bound) and at most ``maximum``.

    Raises:
        InvalidInputError (or ``error``, e.g. ``ConfigError``): naming ``name`` and the value.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise error(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise error(f"{name} must be a finite number, got {value!r}")
    low = minimum is not None and (value <= minimum if exclusive else value < minimum)
    if low or value > maximum:
        lo = "(-inf" if minimum is None else f"{'(' if exclusive else '['}{minimum}"
        raise error(f"{name} must be in {lo}, {maximum}], got {value!r}")
    return float(value)


def check_int(
    name: str,
    value: object,
    *,
    minimum: int = 0,
    error: type[InvalidInputError] = InvalidInputError,
) -> int:
    """``value`` if it is an ``int`` (not a ``bool``) of at least ``minimum``.

    Raises:
        InvalidInputError (or ``error``, e.g. ``ConfigError``): naming ``name`` and the value.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise error(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


__all__ = ["MAX_SECONDS", "check_int", "check_real"]
