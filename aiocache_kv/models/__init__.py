"""Real models over the cache's device pool.

* :mod:`aiocache_kv.models.gpt2` - a small GPT-2 built from a ``GPT2Config`` with seeded random
  weights (nothing is downloaded) and the :class:`~aiocache_kv.CacheConfig` that matches it;
* :mod:`aiocache_kv.models.paged` - :class:`PagedKV`, a ``transformers`` ``Cache`` whose K/V
  live in the rows of ``HiCache.device_kv(layer)``: the model scatters new K/V into its rows
  and attends over the rows of the whole sequence (no second copy kept by the model);
* :mod:`aiocache_kv.models.generate` - :class:`CachedLM`, a greedy generation loop that awaits
  the cache (prefetch, match, load back, alloc, insert), and :func:`reference_generate`, the
  same loop on the stock ``DynamicCache`` with no prefix cache, to compare against.
"""

from __future__ import annotations

from aiocache_kv.models.generate import CachedLM, Generation, reference_generate
from aiocache_kv.models.gpt2 import GPT2Spec, build_gpt2, cache_config_for, kv_shape
from aiocache_kv.models.hybrid import (
    HybridLayout,
    HybridLM,
    HybridSpec,
    PagedHybridKV,
    build_gemma3,
    hybrid_cache_config,
    hybrid_layout,
    reference_generate_hybrid,
)
from aiocache_kv.models.paged import PagedKV

__all__ = [
    "CachedLM",
    "GPT2Spec",
    "Generation",
    "HybridLM",
    "HybridLayout",
    "HybridSpec",
    "PagedHybridKV",
    "PagedKV",
    "build_gemma3",
    "build_gpt2",
    "cache_config_for",
    "hybrid_cache_config",
    "hybrid_layout",
    "kv_shape",
    "reference_generate",
    "reference_generate_hybrid",
]
