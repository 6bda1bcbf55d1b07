"""Chained page hashes: a page's identity.

``h_i = H(h_{i-1} || tokens of page i)`` with ``h_{-1}`` the namespace seed.  ``H`` is BLAKE2b
with a 32-byte digest (BLAKE2b-256), so hashes are stable across processes and Python versions
(Python's ``hash()`` is salted per process and must never be used for keys: FAILURES.md).  Byte
layout: ``h_{i-1}`` (32 bytes), then each token id as a signed 64-bit little-endian word; the
digest's 32 bytes (a ``bytes`` object) are ``h_i``.

``h_i`` names exactly the namespace and every token up to the end of page ``i``: finding two
prefixes with one hash takes about 2**128 work (a 64-bit hash fell to a birthday search in
about a minute).  Storage keys carry it in full, stored pages carry it in their trailer, KV
events publish it (``docs/ARCHITECTURE.md``, "Page identity").

Two implementations compute the same values: a C extension (``_chainhash``, built by
``pip install -e .`` where a C compiler is at hand) and a pure-Python one over :mod:`hashlib`,
used where the extension is missing.  :data:`HASH_IMPL` says which one runs.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Callable, Sequence

from aiocache_kv.errors import InvalidInputError
from aiocache_kv.extensions import optional_extension

_DIGEST = 32
#: Bytes of a page hash (and of a namespace seed).
HASH_BYTES = _DIGEST
#: Largest token id a page hash encodes (ids are hashed as signed 64-bit words); the cache
#: rejects larger ids before any state changes.
MAX_TOKEN_ID = (1 << 63) - 1
# a fresh hasher to copy: ``copy()`` skips parsing the constructor's keyword arguments
_EMPTY = hashlib.blake2b(digest_size=_DIGEST)


def namespace_seed(tag: str) -> bytes:
    """The 32-byte seed of a namespace tag (the hash chain's ``h_{-1}``)."""
    return hashlib.blake2b(tag.encode(), digest_size=_DIGEST).digest()


def _check_prev(prev: object) -> None:
    if type(prev) is not bytes or len(prev) != _DIGEST:
        raise InvalidInputError(
            f"prev must be {_DIGEST} bytes (a page hash or namespace seed), got {prev!r:.80}"
        )


def py_chain_hashes(prev: bytes, tokens: Sequence[int], page_size: int) -> list[bytes]:
    """:func:`chain_hashes` in pure Python (the fallback, and the reference tests compare with)."""
    if page_size < 1:
        raise InvalidInputError(f"page_size must be >= 1, got {page_size}")
    _check_prev(prev)
    words = array("q", tokens)
    if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
        words.byteswap()
    raw = words.tobytes()
    step = page_size * 8
    copy = _EMPTY.copy
    digest = prev
    digests: list[bytes] = []
    append = digests.append
    for off in range(0, len(raw), step):
        h = copy()
        h.update(digest + raw[off : off + step])
        digest = h.digest()
        append(digest)
    return digests


_EXT = optional_extension("aiocache_kv.tree._chainhash")
#: ``"c"`` where the C extension computes the hashes, else ``"python"``.
HASH_IMPL = "python" if _EXT is None else "c"

_impl: Callable[[bytes, Sequence[int], int], list[bytes]] = (
    py_chain_hashes if _EXT is None else _EXT.chain_hashes
)


def chain_hashes(prev: bytes, tokens: Sequence[int], page_size: int) -> list[bytes]:
    """Hashes (32 bytes each) of the pages of ``tokens``, chained from ``prev``.

    ``prev`` is the hash of the page before (or the namespace seed).  Token ids must be in
    ``[0, MAX_TOKEN_ID]`` (the cache validates them first).  A short last page, if any, is
    hashed as it is.  The C function where the extension is built, else
    :func:`py_chain_hashes`; both compute the same values.

    Raises:
        InvalidInputError: ``page_size`` below 1, or ``prev`` not 32 ``bytes``.
    """
    if page_size < 1:
        raise InvalidInputError(f"page_size must be >= 1, got {page_size}")
    _check_prev(prev)
    return _impl(prev, tokens, page_size)
