"""Chained page hashes.

``h_i = H(h_{i-1} || tokens of page i)`` with ``h_{-1}`` the namespace seed.  ``H`` is BLAKE2b
with an 8-byte digest, so hashes are stable across processes and Python versions (Python's
``hash()`` is salted per process and must never be used for keys: FAILURES.md).  Byte layout:
``h_{i-1}`` as 8 little-endian bytes, then each token id as a signed 64-bit little-endian word;
the digest's 8 bytes read as a little-endian unsigned integer are ``h_i``.

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

_DIGEST = 8
#: Largest token id a page hash encodes (ids are hashed as signed 64-bit words); the cache
#: rejects larger ids before any state changes.
MAX_TOKEN_ID = (1 << 63) - 1
# a fresh hasher to copy: ``copy()`` skips parsing the constructor's keyword arguments
_EMPTY = hashlib.blake2b(digest_size=_DIGEST)


def namespace_seed(tag: str) -> int:
    """The 64-bit seed of a namespace tag (the hash chain's ``h_{-1}``)."""
    return int.from_bytes(hashlib.blake2b(tag.encode(), digest_size=_DIGEST).digest(), "little")


def py_chain_hashes(prev: int, tokens: Sequence[int], page_size: int) -> list[int]:
    """:func:`chain_hashes` in pure Python (the fallback, and the reference tests compare with)."""
    if page_size < 1:
        raise InvalidInputError(f"page_size must be >= 1, got {page_size}")
    raw = array("q", tokens).tobytes()
    step = page_size * 8
    copy = _EMPTY.copy
    digest = prev.to_bytes(_DIGEST, "little")
    digests: list[bytes] = []
    append = digests.append
    for off in range(0, len(raw), step):
        h = copy()
        h.update(digest + raw[off : off + step])
        digest = h.digest()
        append(digest)
    # one conversion at the end instead of an int.from_bytes per page
    out = array("Q", b"".join(digests))
    if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
        out.byteswap()
    return out.tolist()


_EXT = optional_extension("aiocache_kv.tree._chainhash")
#: ``"c"`` where the C extension computes the hashes, else ``"python"``.
HASH_IMPL = "python" if _EXT is None else "c"

_impl: Callable[[int, Sequence[int], int], list[int]] = (
    py_chain_hashes if _EXT is None else _EXT.chain_hashes
)


def chain_hashes(prev: int, tokens: Sequence[int], page_size: int) -> list[int]:
    """Hashes of the pages of ``tokens`` (a whole number of pages), chained from ``prev``.

    Token ids must be in ``[0, MAX_TOKEN_ID]`` (the cache validates them first).  A short last
    page, if any, is hashed as it is.  The C function where the extension is built, else
    :func:`py_chain_hashes`; both compute the same values.

    Raises:
        InvalidInputError: ``page_size`` below 1.
    """
    if page_size < 1:
        raise InvalidInputError(f"page_size must be >= 1, got {page_size}")
    return _impl(prev, tokens, page_size)
