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


#: the most threads a worker pool or a worker's torch may be asked for (``copy_threads``,
#: ``storage_workers``, an ``EmbeddingCache``'s ``workers``, the serving engine's
#: ``model_threads``): far above any core count, far below what ``torch.set_num_threads``
#: overflows on (a C ``int``) or a process can start
MAX_THREADS = 1024


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
    # an int is finite however large (``math.isfinite`` and ``float`` overflow past 1.8e308;
    # the comparisons below are exact for ints of any size)
    if isinstance(value, float) and not math.isfinite(value):
        raise error(f"{name} must be a finite number, got {value!r}")
    low = minimum is not None and (value <= minimum if exclusive else value < minimum)
    if low or value > maximum:
        lo = "(-inf" if minimum is None else f"{'(' if exclusive else '['}{minimum}"
        raise error(f"{name} must be in {lo}, {maximum}], got {shown(value)}")
    try:
        return float(value)
    except OverflowError:  # an int past the float range under an infinite ``maximum``
        raise error(f"{name} must be a finite number, got {shown(value)}") from None


def shown(value: object) -> str:
    """``value``'s repr for a message, or its size for an int too long to print (``repr``
    refuses ints of more than 4300 digits)."""
    try:
        return repr(value)
    except ValueError:
        return f"an int of {value.bit_length()} bits" if isinstance(value, int) else "?"


def check_int(
    name: str,
    value: object,
    *,
    minimum: int = 0,
    maximum: int | None = None,
    error: type[InvalidInputError] = InvalidInputError,
) -> int:
    """``value`` if it is an ``int`` (not a ``bool``) of at least ``minimum`` and (unless
    ``maximum`` is ``None``) at most ``maximum``.

    Raises:
        InvalidInputError (or ``error``, e.g. ``ConfigError``): naming ``name`` and the value.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise error(f"{name} must be an int >= {minimum}, got {shown(value)}")
    if maximum is not None and value > maximum:
        raise error(f"{name} must be an int in [{minimum}, {maximum}], got {shown(value)}")
    return value


__all__ = ["MAX_SECONDS", "MAX_THREADS", "check_int", "check_real", "shown"]
