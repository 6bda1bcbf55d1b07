"""Sizes and settings read from configuration: ``"4gb"``-style sizes, first-set variables."""

from __future__ import annotations

import os
import re

from aiocache_kv.errors import ConfigError

__all__ = ["env_first", "parse_size"]

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(value: int | str, name: str = "size") -> int:
    """Parse ``4096``, ``"4096"``, ``"16mb"``, ``"4GiB"`` into bytes (binary units).

    Raises:
        ConfigError: not a non-negative int or a recognised size string.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be a size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{name} must be >= 0, got {value}")
        return value
    match = _SIZE_RE.match(str(value))
    if match is None:
        raise ConfigError(f"{name} must be bytes or a size like '4gb', got {value!r}")
    return int(match.group(1)) * _UNITS[match.group(2).lower()]


def env_first(*names: str) -> str | None:
    """The first of the environment variables ``names`` that is set and non-empty."""
    for name in names:
        value = os.environ.get(name)
        if value:
            return value
    return None
