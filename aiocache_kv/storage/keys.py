"""Storage key formatting: the one place where the namespace tag is applied.

A storage key is ``"{tag}/{page_hash:016x}/{component}"``.  The cache computes page hashes that
are already seeded by the namespace; the tag is added here, exactly once, at the storage
boundary, and a sidecar component (``"kv"``, ``"swa"``, ``"mamba"``, ...) comes after it.
Tags and components use a restricted charset without ``/`` so that :func:`parse_storage_key`
is unambiguous and a raw key can be checked for "exactly one tag".
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from aiocache_kv.errors import StorageKeyError

__all__ = [
    "MAX_COMPONENT_LEN",
    "MAX_KEY_LEN",
    "MAX_TAG_LEN",
    "ParsedKey",
    "check_keys",
    "parse_storage_key",
    "storage_key",
    "storage_keys",
]

MAX_TAG_LEN = 64
MAX_COMPONENT_LEN = 32
MAX_HASH_BITS = 256
#: Longest key a backend accepts (bytes of UTF-8); formatted keys are far shorter.
MAX_KEY_LEN = 1024

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_HASH_RE = re.compile(r"[0-9a-f]{16,64}")


@dataclasses.dataclass(frozen=True)
class ParsedKey:
    """The parts of a formatted storage key."""

    tag: str
    page_hash: int
    component: str


def _check_name(kind: str, value: object, max_len: int) -> str:
    if not isinstance(value, str):
        raise StorageKeyError(f"storage {kind} must be a str, got {type(value).__name__}")
    if not value:
        raise StorageKeyError(f"storage {kind} must not be empty")
    if len(value) > max_len:
        raise StorageKeyError(f"storage {kind} is {len(value)} chars, max {max_len}: {value!r:.80}")
    if _NAME_RE.fullmatch(value) is None:
        raise StorageKeyError(
            f"storage {kind} {value!r} must match [A-Za-z0-9][A-Za-z0-9._-]* (no '/')"
        )
    return value


def storage_key(tag: str, page_hash: int, component: str = "kv") -> str:
    """Format the storage key of one page component.

    Raises:
        StorageKeyError: ``tag``/``component`` empty, too long or outside the safe charset;
            ``page_hash`` not a non-negative ``int`` below ``2**256``.
    """
    _check_name("tag", tag, MAX_TAG_LEN)
    _check_name("component", component, MAX_COMPONENT_LEN)
    if isinstance(page_hash, bool) or not isinstance(page_hash, int):
        raise StorageKeyError(f"page_hash must be an int, got {type(page_hash).__name__}")
    if page_hash < 0 or page_hash >= 1 << MAX_HASH_BITS:
        raise StorageKeyError(f"page_hash must be in [0, 2**{MAX_HASH_BITS}), got {page_hash}")
    return f"{tag}/{page_hash:016x}/{component}"


def storage_keys(tag: str, page_hashes: list[int], component: str = "kv") -> list[str]:
    """:func:`storage_key` of every hash (one call per prompt: the names are checked once).

    Raises:
        StorageKeyError: as :func:`storage_key`, for the first hash at fault.
    """
    _check_name("tag", tag, MAX_TAG_LEN)
    _check_name("component", component, MAX_COMPONENT_LEN)
    if page_hashes and not (
        all(type(h) is int for h in page_hashes)
        and min(page_hashes) >= 0
        and max(page_hashes) < 1 << MAX_HASH_BITS
    ):
        for h in page_hashes:
            storage_key(tag, h, component)  # raises for the first bad one
    return [f"{tag}/{h:016x}/{component}" for h in page_hashes]


def parse_storage_key(key: str) -> ParsedKey:
    """Split a key made by :func:`storage_key` back into its parts.

    Raises:
        StorageKeyError: ``key`` is not exactly ``tag/hash/component`` in the formatted shape
            (e.g. a key carrying two tags).
    """
    if not isinstance(key, str):
        raise StorageKeyError(f"storage key must be a str, got {type(key).__name__}")
    parts = key.split("/")
    if len(parts) != 3:
        raise StorageKeyError(f"storage key {key!r:.120} must have 3 '/'-separated parts")
    tag, hex_hash, component = parts
    _check_name("tag", tag, MAX_TAG_LEN)
    _check_name("component", component, MAX_COMPONENT_LEN)
    if _HASH_RE.fullmatch(hex_hash) is None or (len(hex_hash) > 16 and hex_hash[0] == "0"):
        raise StorageKeyError(f"storage key {key!r:.120} has a malformed page hash {hex_hash!r}")
    return ParsedKey(tag=tag, page_hash=int(hex_hash, 16), component=component)


def check_keys(keys: Sequence[str]) -> None:
    """Validate raw keys handed to a backend: each a non-empty ``str`` of bounded length.

    Backends accept any such string (the file backend maps it to a safe file name); only the
    type, emptiness and length are checked here.

    Raises:
        StorageKeyError: a key is not a ``str``, is empty, or longer than :data:`MAX_KEY_LEN`
            UTF-8 bytes.
    """
    for key in keys:
        if not isinstance(key, str):
            raise StorageKeyError(f"storage key must be a str, got {type(key).__name__}")
        if not key:
            raise StorageKeyError("storage key must not be empty")
        if len(key) > MAX_KEY_LEN or len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_LEN:
            raise StorageKeyError(f"storage key is longer than {MAX_KEY_LEN} bytes: {key!r:.80}")
