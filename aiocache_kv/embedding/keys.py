"""Caller content hashes -> local identities and storage keys.

The caller hashes each multimodal item by its *content* (e.g. sha256 of the image bytes) and
passes the hash as ``str`` or ``bytes``.  A ``str`` means its UTF-8 bytes, so ``"ab12"`` and
``b"ab12"`` are the same item.  The storage key is ``storage_key(namespace, H, "emb-<d>")`` where
``H`` is the 256-bit BLAKE2b digest (person ``akv-emb``) of those bytes: deterministic in every
process (never Python's ``hash()``), injective in practice for inputs of any length (no
truncation, so two hashes that share a prefix never share a key), and the namespace tag is
applied exactly once, here.  ``<d>`` is the code of the entry's dtype (``layout.DTYPE_CODES``):
a cache of another dtype reads other keys, a miss, instead of fetching an object (and evicting
entries to make room for it) only to refuse it at its header.

The caller's hash *is* the entry's identity: the cache never sees the item itself, so it
cannot tell two items apart that the caller hashed alike.  Use a collision-resistant content
digest (SHA-256, BLAKE2b-256 or wider, of the item's canonical bytes); a short or fast
non-cryptographic hash lets one client's item be served for another's.  Only the length and
type are checked here.  The stored entry's trailer binds its key (``storage/integrity.py``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from aiocache_kv.embedding.layout import DTYPE_CODES
from aiocache_kv.errors import InvalidInputError, InvalidTypeError
from aiocache_kv.storage.keys import storage_key

__all__ = ["COMPONENT", "MAX_HASH_BYTES", "batch_items", "canonical_hashes", "embedding_key"]

COMPONENT = "emb"
MAX_HASH_BYTES = 1024


def canonical_hashes(hashes: Sequence[str | bytes]) -> list[bytes]:
    """Validate caller hashes and return them as ``bytes``.

    Raises:
        InvalidTypeError: ``hashes`` is not a sequence (``None``, an int, ...) or is a bare
            ``str``/``bytes`` (not a sequence of hashes), or an item is not ``str``/``bytes``.
        InvalidInputError: an item is empty or longer than :data:`MAX_HASH_BYTES` bytes.
    """
    out: list[bytes] = []
    for i, h in enumerate(batch_items("hashes", hashes, "str/bytes")):
        if isinstance(h, bytes):
            b = h
        elif isinstance(h, str):
            b = h.encode("utf-8", "surrogatepass")
        else:
            raise InvalidTypeError(f"hashes[{i}] must be str or bytes, got {type(h).__name__}")
        if not b:
            raise InvalidInputError(f"hashes[{i}] is empty")
        if len(b) > MAX_HASH_BYTES:
            raise InvalidInputError(
                f"hashes[{i}] is {len(b)} bytes, max {MAX_HASH_BYTES}: {b[:32]!r}..."
            )
        out.append(b)
    return out


def batch_items(name: str, value: object, of: str) -> list[object]:
    """The items of the batch argument ``name`` as a list (a one-shot iterable is consumed).

    Raises:
        InvalidTypeError: ``value`` is not iterable, or is a ``str``/``bytes``-like value
            (one item, not a sequence of them); the message names ``name`` and the type.
    """
    if isinstance(value, (str, bytes, bytearray, memoryview)):
        raise InvalidTypeError(
            f"{name} must be a sequence of {of}, got a single {type(value).__name__}"
        )
    try:
        items = iter(value)  # type: ignore[call-overload]
    except TypeError:
        raise InvalidTypeError(
            f"{name} must be a sequence of {of}, got {type(value).__name__}: {value!r:.80}"
        ) from None
    return list(items)


def embedding_key(namespace: str, h: bytes, dtype: torch.dtype | None = None) -> str:
    """Storage key of the entry with canonical hash ``h`` in ``namespace`` holding ``dtype``
    (``None``: the bare ``emb`` component, no dtype; the cache always gives its dtype).

    Raises:
        StorageKeyError: ``namespace`` is not a valid storage tag.
        InvalidInputError: a ``dtype`` the cache does not store.
    """
    digest = hashlib.blake2b(h, digest_size=32, person=b"akv-emb").digest()
    if dtype is None:
        return storage_key(namespace, digest, COMPONENT)
    code = DTYPE_CODES.get(dtype)
    if code is None:
        raise InvalidInputError(f"no embedding dtype {dtype!r}; use one of {list(DTYPE_CODES)}")
    return storage_key(namespace, digest, f"{COMPONENT}-{code}")
