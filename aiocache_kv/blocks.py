"""What routers and late-joining consumers need to see the cache's blocks from outside.

:func:`page_hashes` computes, from token ids alone, the block hashes the cache publishes in
``BlockStored.block_hashes``, so a router can look prompts up in an index built from events.
:class:`BlockInfo` is one entry of :meth:`HiCache.snapshot`, the full list of cached blocks a
consumer that joined late (or missed batches) resyncs from.

The hash function: pages are ``page_size`` tokens; ``h_0 = seed`` and
``h_i = BLAKE2b-256(h_{i-1} (32 bytes) || the page's token ids as int64 little-endian)``, 32
bytes.  The seed is ``BLAKE2b-256(namespace tag)`` where the tag names (model, tenant, LoRA)
injectively (see :mod:`aiocache_kv.namespace`), so the same tokens under another tenant or
adapter hash apart.  The hash is the page's identity (``docs/ARCHITECTURE.md``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from aiocache_kv.errors import InvalidInputError, InvalidTypeError
from aiocache_kv.namespace import Namespace, namespace_of
from aiocache_kv.numeric import shown
from aiocache_kv.tree.hashing import chain_hashes, namespace_seed
from aiocache_kv.validate import check_names, check_tokens

#: the largest ``page_size`` :func:`page_hashes` takes (a page is far smaller in any cache)
MAX_PAGE_SIZE = (1 << 31) - 1


def page_hashes(
    tokens: Sequence[int] | torch.Tensor,
    *,
    page_size: int,
    model: str | None = None,
    tenant: str | None = None,
    lora: str | None = None,
    namespace: Namespace | None = None,
) -> list[bytes]:
    """The block hashes a cache publishes (``BlockStored.block_hashes``) for ``tokens``.

    One hash per whole page, from the first page on: an unaligned tail is not hashed (the
    cache does not cache it either).  Pass either ``model`` (the cache's
    ``CacheConfig.namespace``) with the ``tenant`` and ``lora`` given to ``insert`` /
    ``match_prefix``, or a :class:`Namespace`.

    Returns a list of 32-byte ``bytes``, one per page: each is that page's identity (the
    namespace and every token up to the end of the page), the value the cache publishes in
    ``BlockStored.block_hashes``, puts into the page's storage key (as 64 hex digits) and
    binds into the stored page's trailer.  The hash function (stable across processes,
    versions and machines)::

        seed = BLAKE2b-256(Namespace(model, tenant or "", lora or "").tag as UTF-8)
        h[-1] = seed
        h[i] = BLAKE2b-256(h[i-1] (32 bytes)
                           || tokens[i*page_size:(i+1)*page_size], each as int64 little-endian)

    where BLAKE2b-256 is unkeyed BLAKE2b with a 32-byte digest (``hashlib.blake2b(data,
    digest_size=32).digest()``).  Equivalently ``chain_hashes(namespace_seed(ns.tag),
    tokens[:n], page_size)`` from :mod:`aiocache_kv.tree.hashing`.  Hashes of a longer prompt
    extend those of its prefix.  A router that needs an integer may take a prefix of the bytes
    as a routing hint, but only the full 32 bytes are an identity: a 64-bit value falls to a
    birthday search in minutes.

    Raises:
        InvalidTypeError: tokens are not a list/tuple/1-D integer CPU tensor of ints (e.g.
            a numpy array or ``None``), or tenant/lora are neither ``str`` nor ``None``.
        InvalidInputError: a token outside ``[0, 2**63)``, a ``page_size`` not an int in
            ``[1, MAX_PAGE_SIZE]`` (2**31-1), an empty model, or not exactly one of
            ``model`` / ``namespace``.
    """
    if type(page_size) is not int or not 1 <= page_size <= MAX_PAGE_SIZE:
        raise InvalidInputError(
            f"page_size must be an int in [1, {MAX_PAGE_SIZE}], got {shown(page_size)}"
        )
    if namespace is not None:
        if model is not None or tenant is not None or lora is not None:
            raise InvalidInputError("pass either namespace or model/tenant/lora, not both")
        if not isinstance(namespace, Namespace):
            raise InvalidTypeError(f"namespace must be a Namespace, got {namespace!r}")
        ns = namespace
    elif model is None:
        raise InvalidInputError("page_hashes needs model= (CacheConfig.namespace) or namespace=")
    else:
        ns = namespace_of(model, *check_names(tenant, lora))
    # the form first (a numpy array, None or 0 is not "no tokens"), then emptiness
    if isinstance(tokens, torch.Tensor):
        kind = tokens.dtype
        empty = tokens.dim() == 1 and tokens.numel() == 0
        empty = empty and not kind.is_floating_point and not kind.is_complex and kind != torch.bool
    elif isinstance(tokens, (list, tuple)):
        empty = len(tokens) == 0
    else:
        raise InvalidTypeError(
            f"tokens must be a list/tuple of ints or a 1-D integer tensor, "
            f"got {type(tokens).__name__}"
        )
    if empty:
        return []  # no whole page (check_tokens rejects empty input: the cache needs tokens)
    toks = check_tokens(tokens)
    n = len(toks) // page_size * page_size
    if n == 0:  # no whole page (and no page-sized buffer for the hasher to allocate)
        return []
    return chain_hashes(namespace_seed(ns.tag), toks[:n], page_size)


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """One cached block (page) in :meth:`HiCache.snapshot`."""

    block_hash: bytes  #: the page's identity (32 bytes, see :func:`page_hashes`)
    parent_block_hash: bytes | None  #: ``None`` for a namespace's first page
    token_ids: tuple[int, ...]
    tiers: tuple[str, ...]  #: media holding it now, of ``GPU``, ``CPU``, ``STORAGE``
    lora_name: str | None
    namespace_tag: str  #: the storage tag (a digest: the tenant salt is not revealed)


__all__ = ["MAX_PAGE_SIZE", "BlockInfo", "page_hashes"]
