"""Real models over the cache's device pool.

* :mod:`aiocache_kv.models.arch` - which models the cache serves (GPT-2, Llama / Mistral /
  Qwen2, Gemma 3) and the dispatch on ``model_type``: :func:`kv_shape`, :func:`cache_config_for`
  (a :class:`~aiocache_kv.CacheConfig` laid out for the model, or ``ConfigError`` naming an
  unsupported one) and the input checks (:func:`check_token_ids`, :func:`max_positions`);
* :mod:`aiocache_kv.models.gpt2` - a small GPT-2 built from a ``GPT2Config`` with seeded random
  weights (nothing is downloaded);
* :mod:`aiocache_kv.models.llama` - small Llama, Qwen2 and Mistral models the same way (rotary
  positions, grouped KV heads, an explicit ``head_dim``);
* :mod:`aiocache_kv.models.paged` - :class:`PagedKV`, a ``transformers`` ``Cache`` whose K/V
  live in the rows of ``HiCache.device_kv(layer)``: the model scatters new K/V into its rows
  and attends over the rows of the whole sequence (no second copy kept by the model);
* :mod:`aiocache_kv.models.generate` - :class:`CachedLM`, a greedy generation loop that awaits
  the cache (prefetch, match, load back, alloc, insert), and :func:`reference_generate`, the
  same loop on the stock ``DynamicCache`` with no prefix cache, to compare against;
* :mod:`aiocache_kv.models.hybrid` (layout in :mod:`~aiocache_kv.models.hybrid_config`) - a
  sliding-window / full-attention model (Gemma 3) with its windows in a sidecar.
"""

from __future__ import annotations

from aiocache_kv.models.arch import (
    SUPPORTED_MODEL_TYPES,
    KVShape,
    cache_config_for,
    check_token_ids,
    kv_shape,
    max_positions,
    model_type,
    vocab_size,
)
from aiocache_kv.models.batched import PagedBatch, SeqChunk
from aiocache_kv.models.generate import CachedLM, Generation, reference_generate
from aiocache_kv.models.gpt2 import GPT2Spec, build_gpt2
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
from aiocache_kv.models.llama import LlamaSpec, build_llama
from aiocache_kv.models.paged import PagedKV

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "CachedLM",
    "GPT2Spec",
    "Generation",
    "HybridLM",
    "HybridLayout",
    "HybridSpec",
    "KVShape",
    "LlamaSpec",
    "PagedBatch",
    "PagedHybridKV",
    "PagedKV",
    "SeqChunk",
    "build_gemma3",
    "build_gpt2",
    "build_llama",
    "cache_config_for",
    "check_token_ids",
    "hybrid_cache_config",
    "hybrid_layout",
    "kv_shape",
    "max_positions",
    "model_type",
    "reference_generate",
    "reference_generate_hybrid",
    "vocab_size",
]
