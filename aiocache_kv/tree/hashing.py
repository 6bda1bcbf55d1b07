"""Chained page hashes.

``h_i = H(h_{i-1} || tokens of page i)`` with ``h_{-1}`` the namespace seed.  ``H`` is BLAKE2b
with an 8-byte digest, so hashes are stable across processes and Python versions (Python's
``hash()`` is salted per process and must never be used for keys: FAILURES.md).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

import numpy as np

_DIGEST = 8
#: Largest token id a page hash encodes (ids are hashed as signed 64-bit words); the cache
#: rejects larger ids before any state changes.
MAX_TOKEN_ID = (1 << 63) - 1


def namespace_seed(tag: str) -> int:
    """The 64-bit seed of a namespace tag (the hash chain's ``h_{-1}``)."""
    return int.from_bytes(hashlib.blake2b(tag.encode(), digest_size=_DIGEST).digest(), "little")


def chain_hashes(prev: int, tokens: Sequence[int], page_size: int) -> list[int]:
    """Hashes of the pages of ``tokens`` (a whole number of pages), chained from ``prev``.

    Token ids must be in ``[0, MAX_TOKEN_ID]`` (the cache validates them first).  The chain
    stays in bytes (each digest feeds the next page's hash directly) and the digests become
    ints in one numpy pass at the end: about 20% less per page than converting each one.
    """
    raw = array("q", tokens).tobytes()
    step = page_size * 8
    blake = hashlib.blake2b
    digest = prev.to_bytes(_DIGEST, "little")
    digests: list[bytes] = []
    append = digests.append
    for off in range(0, len(raw), step):
        digest = blake(digest + raw[off : off + step], digest_size=_DIGEST).digest()
        append(digest)
    out: list[int] = np.frombuffer(b"".join(digests), dtype="<u8").tolist()
    return out
