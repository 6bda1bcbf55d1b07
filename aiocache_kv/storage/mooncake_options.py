"""Checks of :class:`~aiocache_kv.storage.mooncake.MooncakeStorage`'s constructor options.

Each is checked at construction (no I/O), so a wrong type or an out-of-range number is a
:class:`~aiocache_kv.errors.ConfigError` naming it there, not a bare ``TypeError`` or an
overflow in the C++ client at :meth:`~aiocache_kv.storage.mooncake.MooncakeStorage.open`.
"""

from __future__ import annotations

from aiocache_kv.errors import ConfigError
from aiocache_kv.numeric import check_int, shown
from aiocache_kv.storage.sizes import env_first, parse_size

__all__ = [
    "MAX_RPC_TIMEOUT_MS",
    "MAX_SIZE_BYTES",
    "MIN_GLOBAL_SEGMENT",
    "addresses",
    "flag",
    "rpc_timeout_ms",
    "segment_sizes",
    "size",
    "text",
]

_DEFAULT_MASTER = "127.0.0.1:50051"
_DEFAULT_METADATA = "http://127.0.0.1:8080/metadata"
_DEFAULT_HOSTNAME = "127.0.0.1"
_DEFAULT_GLOBAL_SEGMENT = 1 << 30
#: the smallest non-zero segment the Mooncake client mounts
MIN_GLOBAL_SEGMENT = 16 << 20
_DEFAULT_LOCAL_BUFFER = 16 << 20

#: the longest ``rpc_timeout_ms``: the client reads ``MC_RPC_TIMEOUT_MS`` as a C ``int32``
MAX_RPC_TIMEOUT_MS = (1 << 31) - 1
#: the largest segment or buffer size, in bytes (the client's ``size_t``/``int64`` sizes)
MAX_SIZE_BYTES = (1 << 63) - 1


def text(name: str, value: object, envs: tuple[str, ...], default: str) -> str:
    """A string option: ``value`` if non-empty, else the first set variable of ``envs``,
    else ``default``.

    Raises:
        ConfigError: ``value`` is neither a ``str`` nor ``None``.
    """
    if value is not None and type(value) is not str:
        raise ConfigError(f"{name} must be a str or None, got {type(value).__name__} {value!r}")
    return value or env_first(*envs) or default


def size(name: str, value: int | str | None, envs: tuple[str, ...], default: int) -> int:
    """A size option in bytes (an int or a string such as ``"4gb"``; ``None``: the first set
    variable of ``envs``, else ``default``), at most :data:`MAX_SIZE_BYTES`.

    Raises:
        ConfigError: not a size, negative, or above :data:`MAX_SIZE_BYTES`.
    """
    got = parse_size(env_first(*envs) or default if value is None else value, name)
    if got > MAX_SIZE_BYTES:
        raise ConfigError(f"{name} must be at most {MAX_SIZE_BYTES} bytes, got {shown(got)}")
    return got


def rpc_timeout_ms(value: object) -> int | None:
    """``rpc_timeout_ms``: ``None`` (the client's default) or an int in
    ``[1, MAX_RPC_TIMEOUT_MS]``.

    Raises:
        ConfigError: anything else (naming the value).
    """
    if value is None:
        return None
    return check_int(
        "rpc_timeout_ms", value, minimum=1, maximum=MAX_RPC_TIMEOUT_MS, error=ConfigError
    )


def flag(name: str, value: object) -> bool:
    """A ``bool`` option (not a truthy string such as ``"no"``).

    Raises:
        ConfigError: ``value`` is not a ``bool``.
    """
    if type(value) is not bool:
        raise ConfigError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def addresses(
    master: object,
    metadata_server: object,
    local_hostname: object,
    protocol: object,
    device: object,
) -> tuple[str, str, str, str, str]:
    """``(master, metadata_server, local_hostname, protocol, device_name)``, each given or
    from the environment (the module docstring of :mod:`.mooncake`) or its default.

    Raises:
        ConfigError: one is neither a ``str`` nor ``None``, or ``master`` is not host:port.
    """
    out = (
        text("master", master, ("MOONCAKE_MASTER",), _DEFAULT_MASTER),
        text(
            "metadata_server",
            metadata_server,
            ("MOONCAKE_TE_META_DATA_SERVER", "MOONCAKE_METADATA_SERVER"),
            _DEFAULT_METADATA,
        ),
        text("local_hostname", local_hostname, ("MOONCAKE_LOCAL_HOSTNAME",), _DEFAULT_HOSTNAME),
        text("protocol", protocol, ("MOONCAKE_PROTOCOL",), "tcp"),
        # an explicit "" is no device, not "read the environment"
        text("device_name", device, () if device is not None else ("MOONCAKE_DEVICE",), ""),
    )
    if ":" not in out[0]:
        raise ConfigError(f"master must be host:port, got {out[0]!r}")
    return out


def segment_sizes(
    global_segment_size: int | str | None, local_buffer_size: int | str | None
) -> tuple[int, int]:
    """``(global_segment_size, local_buffer_size)`` in bytes (:func:`size`).

    Raises:
        ConfigError: as :func:`size`, or a segment of less than :data:`MIN_GLOBAL_SEGMENT`
            that is not 0 (less fails the client's ``setup`` with -600).
    """
    gss = size(
        "global_segment_size",
        global_segment_size,
        ("MOONCAKE_GLOBAL_SEGMENT_SIZE",),
        _DEFAULT_GLOBAL_SEGMENT,
    )
    lbs = size(
        "local_buffer_size",
        local_buffer_size,
        ("MOONCAKE_LOCAL_BUFFER_SIZE",),
        _DEFAULT_LOCAL_BUFFER,
    )
    if 0 < gss < MIN_GLOBAL_SEGMENT:
        raise ConfigError(
            f"global_segment_size must be 0 or at least {MIN_GLOBAL_SEGMENT} bytes (16 MiB, "
            f"Mooncake's smallest segment), got {gss}"
        )
    return gss, lbs
