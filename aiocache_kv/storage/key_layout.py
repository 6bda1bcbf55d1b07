"""What a stored page's key says about its bytes: the layout they were computed in.

Two deployments may name one namespace (``CacheConfig.namespace`` defaults to ``"default"``)
over one store and differ in their model's KV layout: layers, KV heads, head size, dtype.  A
page's hash binds its namespace and tokens, not that layout, so without more a cache laid out
otherwise would read the other's page as its own KV whenever the page sizes in bytes agree
(4 layers x 1 head x 8 in fp16 and 2 layers x 2 heads x 4 in fp32 are both 64 bytes a
token) and the model would attend over reinterpreted bytes.  A sidecar component is the same:
an SWA pool and a Mamba pool of one name and page size.

So each pool's key component ends in a 64-bit digest of its layout: for the KV pool the page
size, layers, KV heads, head size and dtype; for a sidecar its hit policy, page shape and
dtype (not its window: a page's bytes do not depend on how many pages a match needs).  Caches
laid out otherwise read other keys, a miss; the trailer's key binding makes a page copied
under another layout's key a miss too.  The namespace tag, the page hashes and so the KV
events are unchanged: a router computes the same hashes whatever the layout.

A layout is chosen by whoever deploys, not by a client, so the digest guards against
mistakes, not adversaries; anyone who can write to the store can write anything (see
``docs/ARCHITECTURE.md``, "Page identity").
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from aiocache_kv.errors import InvalidInputError

if TYPE_CHECKING:
    from aiocache_kv.components.spec import Component
    from aiocache_kv.config import CacheConfig

__all__ = ["COMPONENT", "key_component", "key_components", "layout_digest"]

#: the KV pool's key component (before its shard and layout digest)
COMPONENT = "kv"


def layout_digest(*parts: object) -> str:
    """16 hex digits (64 bits) of BLAKE2b over the ``repr`` of ``parts``."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=8).hexdigest()


def _kv_layout(config: CacheConfig) -> str:
    return layout_digest(
        COMPONENT,
        config.page_size,
        config.num_layers,
        config.num_kv_heads,
        config.head_dim,
        str(config.dtype),
    )


def _component_layout(component: Component) -> str:
    return layout_digest(component.hit_policy.value, component.page_shape, str(component.dtype))


def key_components(config: CacheConfig, rank: int = 0, world_size: int = 1) -> list[str]:
    """The key component of each pool (KV first, then each sidecar in config order) of a
    cache with ``config`` on tensor-parallel ``rank`` of ``world_size``: the pool's name, the
    rank's shard (``-tp{rank}-{world_size}``, none alone), then ``-`` and its layout digest."""
    shard = "" if world_size == 1 else f"-tp{rank}-{world_size}"
    out = [f"{COMPONENT}{shard}-{_kv_layout(config)}"]
    out += [f"{c.name}{shard}-{_component_layout(c)}" for c in config.components]
    return out


def key_component(
    config: CacheConfig, name: str = COMPONENT, rank: int = 0, world_size: int = 1
) -> str:
    """The key component of pool ``name`` (``"kv"``: the KV pool; else a sidecar's name)
    of a cache with ``config``, as :func:`key_components` makes it.

    Raises:
        InvalidInputError: no pool of that name.
    """
    names = [COMPONENT, *(c.name for c in config.components)]
    if name not in names:
        raise InvalidInputError(f"no pool named {name!r}; the pools are {names}")
    return key_components(config, rank, world_size)[names.index(name)]
