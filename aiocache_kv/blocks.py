"""What routers and late-joining consumers need to see the cache's blocks from outside.

:func:`page_hashes` computes, from token ids alone, the block hashes the cache publishes in
``BlockStored.block_hashes``, so a router can look prompts up in an index built from events.
:class:`BlockInfo` is one entry of :meth:`HiCache.snapshot`, the full list of cached blocks a
consumer that joined late (or missed batches) resyncs from.

The hash function: pages are ``page_size`` tokens; ``h_0 = seed`` and
``h_i = BLAKE2b-64(h_{i-1} as 8 little-endian bytes || the page's token ids as int64
little-endian)``, read as an unsigned little-endian int.  The seed is
``BLAKE2b-64(namespace tag)`` where the tag names (model, tenant, LoRA) injectively (see
:mod:`aiocache_kv.namespace`), so the same tokens under another tenant or adapter hash apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from aiocache_kv.errors import InvalidInputError
from aiocache_kv.namespace import namespace_of
from aiocache_kv.tree.hashing import chain_hashes, namespace_seed
from aiocache_kv.validate import check_names, check_tokens


def page_hashes(
    tokens: Sequence[int] | torch.Tensor,
    *,
    model: str,
    page_size: int,
    tenant: str | None = None,
    lora: str | None = None,
) -> list[int]:
    """Block hashes of the whole pages of ``tokens`` (an unaligned tail has none), exactly as
    a cache with ``CacheConfig(namespace=model, page_size=page_size)`` publishes them.

    Raises:
        InvalidTypeError / InvalidInputError: bad tokens, names, model or page size.
    """
    if type(page_size) is not int or page_size < 1:
        raise InvalidInputError(f"page_size must be an int >= 1, got {page_size!r}")
    toks = check_tokens(tokens)
    ns = namespace_of(model, *check_names(tenant, lora))
    n = len(toks) // page_size * page_size
    return chain_hashes(namespace_seed(ns.tag), toks[:n], page_size) if n else []


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """One cached block (page) in :meth:`HiCache.snapshot`."""

    block_hash: int
    parent_block_hash: int | None  #: ``None`` for a namespace's first page
    token_ids: tuple[int, ...]
    tiers: tuple[str, ...]  #: media holding it now, of ``GPU``, ``CPU``, ``STORAGE``
    lora_name: str | None
    namespace_tag: str  #: the storage tag (a digest: the tenant salt is not revealed)


__all__ = ["BlockInfo", "page_hashes"]
