"""KV events in vLLM's schema (``vllm/distributed/kv_events.py``).

``medium`` names the tier: ``GPU`` for the device pool (even when it lives on the CPU), ``CPU``
for the host pool, ``STORAGE`` for L3 (vLLM's ``MEDIUM_GPU``/``MEDIUM_CPU``/``MEDIUM_STORAGE``).
One :class:`BlockStored` per stored run of pages, ``block_hashes`` one per page,
``parent_block_hash`` the hash of the page before the run (``None`` for a run that starts the
sequence).  A block hash is the page's full identity: 32 ``bytes``, the chained BLAKE2b-256 of
:mod:`aiocache_kv.tree.hashing` (vLLM's ``ExternalBlockHash`` is ``bytes | int``; its SHA-256
hashes are bytes too), so a consumer keyed on it never merges two prefixes.

The namespace of the pages rides on :class:`BlockStored`: ``lora_name`` is the namespace's LoRA
adapter, ``lora_id`` the int :func:`lora_id_of` derives from that name, and ``cache_salt`` the
namespace's tenant salt.  The publisher turns them into vLLM's per-block ``extra_keys``
(the tenant only when asked to: see :class:`~aiocache_kv.events.ZmqEventPublisher`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aiocache_kv.namespace import Namespace


def lora_id_of(lora_name: str) -> int | None:
    """The ``lora_id`` published for the adapter ``lora_name`` (``None`` for no adapter).

    vLLM publishes its server-assigned integer adapter id there (deprecated in favour of
    ``lora_name``).  This cache knows adapters only by name, so the id is derived from it: the
    first 8 bytes of ``blake2b(name, person=b"aiocache-lora")`` read big-endian, shifted right by
    one bit - an int in ``[1, 2**63)`` that is the same in every process and release (0 is
    mapped to 1: vLLM's adapter ids are positive).  Two adapters share an id only by a 63-bit
    hash collision; consumers should key on ``lora_name``.
    """
    if not lora_name:
        return None
    raw = lora_name.encode("utf-8", "surrogatepass")  # (the namespace's own encoding)
    digest = hashlib.blake2b(raw, digest_size=8, person=b"aiocache-lora")
    return (int.from_bytes(digest.digest(), "big") >> 1) or 1


def namespace_fields(ns: Namespace) -> dict[str, Any]:
    """The :class:`BlockStored` fields that describe a page's namespace ``ns``."""
    return {
        "lora_name": ns.lora or None,
        "lora_id": lora_id_of(ns.lora),
        "cache_salt": ns.tenant or None,
    }


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A run of pages became resident in ``medium``."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    medium: str
    lora_id: int | None = None
    lora_name: str | None = None
    """The LoRA adapter the pages were computed with (``None``: the base model)."""
    cache_salt: str | None = None
    """The tenant salt of the pages' namespace (``None``: no tenant)."""


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Pages left ``medium``."""

    block_hashes: list[bytes]
    medium: str


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every block of every medium was dropped."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
