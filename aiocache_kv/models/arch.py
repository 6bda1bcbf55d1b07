"""Which models the cache serves, and what their KV and inputs look like.

One dispatch on ``config.model_type`` (of the text config, for a multimodal wrapper):

* ``gpt2`` - every layer in the KV pool, ``n_head`` KV heads of ``n_embd / n_head``;
* ``llama``, ``mistral``, ``qwen2`` (the Llama family: rotary positions, grouped KV heads,
  ``head_dim`` from the config) - every layer in the KV pool, ``num_key_value_heads`` KV heads
  (sliding-window layers too: the model's mask hides what lies before the window);
* ``gemma3_text`` (hybrid) - the full-attention layers in the KV pool, the sliding layers in a
  ``swa`` sidecar (:func:`~aiocache_kv.models.hybrid_config.hybrid_cache_config`).

Anything else is a :class:`~aiocache_kv.errors.ConfigError` naming the model type and the
supported ones, before a cache is laid out for it.  The input checks (:func:`check_token_ids`,
:func:`check_request`) read the vocabulary and the context length from the model, so a token
the embedding table lacks or a request past the last position is a typed error before the
cache or the model is touched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from aiocache_kv.config import CacheConfig
from aiocache_kv.errors import ConfigError, InvalidInputError, InvalidTypeError
from aiocache_kv.models.hybrid_config import hybrid_cache_config, hybrid_layout
from aiocache_kv.validate import check_tokens

#: GPT-2: learned positions, ``n_head`` KV heads
GPT2_TYPES = ("gpt2",)
#: the Llama family: every layer's K/V in the pool
LLAMA_TYPES = ("llama", "mistral", "qwen2")
#: sliding-window / full-attention hybrids: full layers in the pool, sliding ones in a sidecar
HYBRID_TYPES = ("gemma3_text",)
#: every ``model_type`` :func:`cache_config_for` lays a cache out for
SUPPORTED_MODEL_TYPES = GPT2_TYPES + LLAMA_TYPES + HYBRID_TYPES


@dataclass(frozen=True)
class KVShape:
    """What a model's attention KV looks like per token (in the KV pool)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype


def text_config(model: Any) -> Any:
    """The config of ``model``'s language model (the text config of a multimodal wrapper).

    Raises:
        ConfigError: ``model`` has no ``config`` (not a ``transformers`` model).
    """
    cfg = getattr(model, "config", None)
    if cfg is None:
        raise ConfigError(f"{type(model).__name__} has no config: not a transformers model")
    get_text = getattr(cfg, "get_text_config", None)
    return get_text() if callable(get_text) else cfg


def model_type(model: Any) -> str:
    """``model``'s ``model_type``, if the cache supports it.

    Raises:
        ConfigError: no config, or a model type outside :data:`SUPPORTED_MODEL_TYPES`
            (the message names it and lists the supported ones).
    """
    kind = getattr(text_config(model), "model_type", None)
    if kind not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"unsupported model_type {kind!r} ({type(model).__name__}): the cache supports "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    assert isinstance(kind, str)
    return kind


def is_hybrid(model: Any) -> bool:
    """Whether ``model`` keeps sliding layers in a sidecar (serve it with ``HybridLM``).

    Raises:
        ConfigError: an unsupported model (see :func:`model_type`).
    """
    return model_type(model) in HYBRID_TYPES


def _dtype(model: Any) -> torch.dtype:
    try:
        dtype: torch.dtype = next(model.parameters()).dtype
    except (AttributeError, TypeError, StopIteration) as e:
        raise ConfigError(f"{type(model).__name__} has no parameters to take a dtype from") from e
    return dtype


def kv_shape(model: Any) -> KVShape:
    """The per-token shape of the K/V that ``model`` keeps in the cache's KV pool.

    For a hybrid model that is its full-attention layers only (the sliding layers' K/V go to
    the sidecar that :func:`cache_config_for` adds).

    Raises:
        ConfigError: an unsupported model (see :func:`model_type`), a config whose sizes
            are missing or not positive, or a model without parameters.
    """
    kind = model_type(model)
    cfg = text_config(model)
    if kind in HYBRID_TYPES:
        layout = hybrid_layout(model)
        return KVShape(len(layout.full), layout.num_kv_heads, layout.head_dim, layout.dtype)
    try:
        if kind in GPT2_TYPES:
            layers, heads = int(cfg.n_layer), int(cfg.n_head)
            kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
            head_dim = int(cfg.n_embd) // heads
        else:
            layers, heads = int(cfg.num_hidden_layers), int(cfg.num_attention_heads)
            kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
            head_dim = int(getattr(cfg, "head_dim", None) or int(cfg.hidden_size) // heads)
    except (AttributeError, TypeError, ValueError, ZeroDivisionError) as e:
        raise ConfigError(f"{kind} config without a usable layer / head size: {e}") from e
    if min(layers, kv_heads, head_dim) < 1:
        raise ConfigError(
            f"{kind} config has layers {layers}, kv heads {kv_heads}, head_dim {head_dim}"
        )
    return KVShape(layers, kv_heads, head_dim, _dtype(model))


def cache_config_for(model: Any, **options: Any) -> CacheConfig:
    """A :class:`CacheConfig` laid out for ``model``; ``options`` set the rest.

    GPT-2 and the Llama family get their KV shape; a hybrid model (Gemma 3) also gets its
    sliding-window sidecar (:func:`~aiocache_kv.models.hybrid_config.hybrid_cache_config`).
    Shape options (and ``components`` for a hybrid) may be given only if they agree.

    Raises:
        ConfigError: an unsupported model (naming its ``model_type`` and the supported ones),
            an option that contradicts the model's shape, or an invalid option.
    """
    if is_hybrid(model):
        return hybrid_cache_config(model, **options)
    shape = kv_shape(model)
    fixed = {
        "num_layers": shape.num_layers,
        "num_kv_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "dtype": shape.dtype,
    }
    for key, value in fixed.items():
        if key in options and options[key] != value:
            raise ConfigError(f"{key}={options[key]!r} does not match the model ({value!r})")
    return CacheConfig(**{**options, **fixed})


def check_layout(model: Any, config: CacheConfig) -> None:
    """Check that a cache built from ``config`` holds ``model``'s K/V (layers, KV heads,
    head_dim, dtype) - for models whose every layer is in the pool (not hybrid ones).

    Raises:
        ConfigError: the shapes differ, or an unsupported model.
    """
    shape = kv_shape(model)
    got = (config.num_layers, config.num_kv_heads, config.head_dim, config.dtype)
    want = (shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.dtype)
    if got != want:
        raise ConfigError(
            f"cache KV shape (layers, heads, head_dim, dtype) {got} does not match the "
            f"model's {want}"
        )


def vocab_size(model: Any) -> int:
    """Token ids ``model`` embeds: the rows of its input embedding (``config.vocab_size`` for
    a model without ``get_input_embeddings``).

    Raises:
        ConfigError: neither says.
    """
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    rows = getattr(emb, "num_embeddings", None)
    if rows is None:
        rows = getattr(text_config(model), "vocab_size", None)
    if type(rows) is not int or rows < 1:
        raise ConfigError(f"{type(model).__name__} has no vocabulary size (got {rows!r})")
    return rows


def max_positions(model: Any) -> int:
    """Positions ``model`` attends over: ``max_position_embeddings`` (GPT-2's ``n_positions``
    under its other name).

    Raises:
        ConfigError: the config gives neither.
    """
    cfg = text_config(model)
    n = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    if type(n) is not int or n < 1:
        raise ConfigError(f"{type(model).__name__} config has no max_position_embeddings")
    return n


def check_token_ids(model: Any, tokens: Sequence[int] | torch.Tensor) -> list[int]:
    """``tokens`` as a new list of ints, every one an id of ``model``'s vocabulary.

    Call it before anything runs: a token past the embedding table would otherwise fail the
    forward pass with an ``IndexError`` (on CUDA, a device-side assert) after the cache did
    its work.

    Raises:
        InvalidTypeError: not a list / tuple / 1-D integer tensor of ints, or a token is a
            ``bool`` (the forward pass refuses those; the first one is named, with its index).
        InvalidInputError: empty, or an id outside ``[0, vocab_size)`` (the message names the
            first one, its position and the vocabulary size).
    """
    # a bool is an int to check_tokens (which makes it one), not a token to a model
    if isinstance(tokens, (list, tuple)) and bool in set(map(type, tokens)):
        at = next(i for i, t in enumerate(tokens) if type(t) is bool)
        raise InvalidTypeError(
            f"tokens must be ints, not bools; found {tokens[at]!r} at position {at}"
        )
    toks = list(check_tokens(tokens))  # ints in [0, 2**63): only the top needs checking
    vocab = vocab_size(model)
    if max(toks) >= vocab:
        at = next(i for i, t in enumerate(toks) if t >= vocab)
        raise InvalidInputError(
            f"token id {toks[at]} at position {at} is not in the model's vocabulary of "
            f"{vocab} ids [0, {vocab})"
        )
    return toks


def check_request(
    model: Any, prompt: Sequence[int] | torch.Tensor, max_new_tokens: int
) -> list[int]:
    """The prompt of a generation request, checked against ``model``: its token ids are in the
    vocabulary and ``len(prompt) + max_new_tokens`` fits ``max_positions(model)``.

    Raises:
        InvalidTypeError: the prompt is not a sequence of ints (a ``bool`` is not one).
        InvalidInputError: empty prompt, an id outside the vocabulary, ``max_new_tokens`` not
            a positive int, or a request longer than the model's positions.
    """
    if type(max_new_tokens) is not int or max_new_tokens < 1:
        raise InvalidInputError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    toks = check_token_ids(model, prompt)
    limit = max_positions(model)
    if len(toks) + max_new_tokens > limit:
        raise InvalidInputError(
            f"prompt ({len(toks)}) + max_new_tokens ({max_new_tokens}) exceeds the model's "
            f"{limit} positions"
        )
    return toks


__all__ = [
    "GPT2_TYPES",
    "HYBRID_TYPES",
    "LLAMA_TYPES",
    "SUPPORTED_MODEL_TYPES",
    "KVShape",
    "cache_config_for",
    "check_layout",
    "check_request",
    "check_token_ids",
    "is_hybrid",
    "kv_shape",
    "max_positions",
    "model_type",
    "text_config",
    "vocab_size",
]
