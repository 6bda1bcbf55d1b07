"""Storage key formatting: the one place where the namespace tag is applied.

A storage key is ``"{tag}/{page_hash.hex()}/{component}"``: the page hash in full (32 bytes, 64
lowercase hex digits: the chained BLAKE2b-256 of :mod:`aiocache_kv.tree.hashing`, so two
prefixes share a key only by a 2**128-work collision).  The cache computes page hashes that
are already seeded by the namespace; the tag is added here, exactly once, at the storage
boundary, and a sidecar component (``"kv"``, ``"swa"``, ``"mamba"``, ...) comes after it.
The stored page's trailer binds the same hash again (``storage/integrity.py``), so a page is
served only for the prefix it was computed from even if two keys ever met.
Tags and components use a restricted charset without ``/`` so that :func:`parse_storage_key`
is unambiguous and a raw key can be checked for "exactly one tag".
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Sequence

from aiocache_kv.errors import StorageKeyError
from aiocache_kv.fastcheck import hex_keys

__all__ = [
    "MAX_COMPONENT_LEN",
    "MAX_KEY_LEN",
    "MAX_TAG_LEN",
    "ParsedKey",
    "check_keys",
    "check_tag",
    "parse_storage_key",
    "storage_key",
    "storage_keys",
]

MAX_TAG_LEN = 64
MAX_COMPONENT_LEN = 48
#: Bytes of the page hash a key carries (64 hex digits).
KEY_HASH_BYTES = 32
#: Longest key a backend accepts (bytes of UTF-8); formatted keys are far shorter.
MAX_KEY_LEN = 1024

#: a ``str`` key of at most this many chars is within MAX_KEY_LEN bytes (UTF-8: <= 4 a char)
_SHORT = MAX_KEY_LEN // 4

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_HASH_RE = re.compile(r"[0-9a-f]{64}")


@dataclasses.dataclass(frozen=True)
class ParsedKey:
    """The parts of a formatted storage key."""

    tag: str
    page_hash: bytes
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


def _bad_hash(page_hash: object) -> StorageKeyError:
    return StorageKeyError(
        f"page_hash must be {KEY_HASH_BYTES} bytes, got {page_hash!r:.80}"
        + ("" if isinstance(page_hash, bytes) else f" ({type(page_hash).__name__})")
    )


def check_tag(tag: object) -> str:
    """``tag`` if it is a namespace tag as :func:`storage_key` accepts it (for removing every
    key ``"{tag}/..."``).

    Raises:
        StorageKeyError: ``tag`` not a ``str``, empty, too long or outside the safe charset.
    """
    return _check_name("tag", tag, MAX_TAG_LEN)


def storage_key(tag: str, page_hash: bytes, component: str = "kv") -> str:
    """Format the storage key of one page component.

    Raises:
        StorageKeyError: ``tag``/``component`` empty, too long or outside the safe charset;
            ``page_hash`` not ``bytes`` of :data:`KEY_HASH_BYTES`.
    """
    return storage_keys(tag, [page_hash], component)[0]


@functools.lru_cache(maxsize=1024)
def _affixes(tag: str, component: str) -> tuple[str, str]:
    """What goes before and after the hash in a key of ``tag`` and ``component`` (exact
    ``str``: checked once, then remembered; a failed check raises and is not)."""
    _check_name("tag", tag, MAX_TAG_LEN)
    _check_name("component", component, MAX_COMPONENT_LEN)
    return f"{tag}/", f"/{component}"


def storage_keys(tag: str, page_hashes: list[bytes], component: str = "kv") -> list[str]:
    """:func:`storage_key` of every hash (one call per prompt: the names are checked once;
    the keys are made in one C loop where ``_fastcheck`` is built).

    Raises:
        StorageKeyError: as :func:`storage_key`, for the first hash at fault.
    """
    if type(tag) is str and type(component) is str:
        pre, post = _affixes(tag, component)
    else:  # (a str subclass, or not a str: checked, never remembered)
        _check_name("tag", tag, MAX_TAG_LEN)
        _check_name("component", component, MAX_COMPONENT_LEN)
        pre, post = f"{tag}/", f"/{component}"
    hashes = page_hashes if type(page_hashes) is list else list(page_hashes)
    keys = hex_keys(pre, hashes, post, KEY_HASH_BYTES)
    if isinstance(keys, int):
        raise _bad_hash(hashes[keys])
    return keys


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
    if _HASH_RE.fullmatch(hex_hash) is None:
        raise StorageKeyError(f"storage key {key!r:.120} has a malformed page hash {hex_hash!r}")
    return ParsedKey(tag=tag, page_hash=bytes.fromhex(hex_hash), component=component)


def check_keys(keys: Sequence[str]) -> None:
    """Validate raw keys handed to a backend: each a non-empty ``str`` of bounded length.

    Backends accept any such string (the file backend maps it to a safe file name); only the
    type, emptiness and length are checked here.

    Raises:
        StorageKeyError: a key is not a ``str``, is empty, or longer than :data:`MAX_KEY_LEN`
            UTF-8 bytes.
    """
    # fast path (every put_chain checks its parents): a plain str of at most MAX_KEY_LEN / 4
    # chars cannot be longer than MAX_KEY_LEN UTF-8 bytes (4 at most per char)
    if all(type(k) is str and 0 < len(k) <= _SHORT for k in keys):
        return
    for key in keys:
        if not isinstance(key, str):
            raise StorageKeyError(f"storage key must be a str, got {type(key).__name__}")
        if not key:
            raise StorageKeyError("storage key must not be empty")
        if len(key) > MAX_KEY_LEN or len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_LEN:
            raise StorageKeyError(f"storage key is longer than {MAX_KEY_LEN} bytes: {key!r:.80}")
