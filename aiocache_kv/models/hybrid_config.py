"""The cache layout of a hybrid sliding-window / full-attention model: which layers keep their
K/V in the KV pool (full attention) and which in the ``swa`` sidecar (sliding window), and the
:class:`~aiocache_kv.CacheConfig` that matches (see :mod:`aiocache_kv.models.hybrid` for the
model side).  Nothing here runs the model, so the dispatch of
:func:`aiocache_kv.models.cache_config_for` can use it without the generation loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from aiocache_kv.components import Component, HitPolicy, SlidingWindow
from aiocache_kv.config import CacheConfig
from aiocache_kv.errors import ConfigError

FULL = "full_attention"
SLIDING = "sliding_attention"
SWA = "swa"  #: default name of the sliding-window sidecar


@dataclass(frozen=True)
class HybridLayout:
    """Which model layers go where, and the per-token K/V shape."""

    full: tuple[int, ...]  #: model layer of KV-pool layer ``j``
    sliding: tuple[int, ...]  #: model layer of sidecar slot ``s``
    window: int  #: ``sliding_window``: a query at ``q`` sees keys ``> q - window``
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def num_layers(self) -> int:
        """Model layers."""
        return len(self.full) + len(self.sliding)


def hybrid_layout(model: Any) -> HybridLayout:
    """Read the layer mapping from a ``transformers`` model's config.

    Raises:
        ConfigError: no ``layer_types``, a layer type other than full / sliding attention,
            sliding layers without a ``sliding_window``, or no full-attention layer.
    """
    cfg = getattr(model.config, "get_text_config", lambda: model.config)()
    types = list(getattr(cfg, "layer_types", None) or [])
    if not types:
        raise ConfigError("the model config has no layer_types")
    bad = sorted(set(types) - {FULL, SLIDING})
    if bad:
        raise ConfigError(f"unsupported layer types {bad}: only {FULL!r} and {SLIDING!r}")
    full = tuple(i for i, t in enumerate(types) if t == FULL)
    sliding = tuple(i for i, t in enumerate(types) if t == SLIDING)
    if not full:
        raise ConfigError("the model has no full-attention layer for the KV pool")
    window = int(getattr(cfg, "sliding_window", None) or 0)
    if sliding and window < 1:
        raise ConfigError("sliding layers without a sliding_window")
    heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    return HybridLayout(
        full=full,
        sliding=sliding,
        window=window,
        num_kv_heads=heads,
        head_dim=head_dim,
        dtype=next(model.parameters()).dtype,
    )


def swa_component(layout: HybridLayout, page_size: int, name: str = SWA) -> Component:
    """The sidecar of the sliding layers: their K/V, the trailing ``window`` tokens needed."""
    return SlidingWindow(
        layout.window,
        num_layers=len(layout.sliding),
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        page_size=page_size,
        dtype=layout.dtype,
        name=name,
    )


def hybrid_cache_config(model: Any, **options: Any) -> CacheConfig:
    """A :class:`CacheConfig` for ``model``: the full layers' KV shape and the SWA sidecar.

    ``options`` set the rest (``page_size`` included); shape options and ``components`` may be
    given only if they agree with the model.

    Raises:
        ConfigError: an option contradicts the model, or is invalid.
    """
    layout = hybrid_layout(model)
    page_size = options.get("page_size", CacheConfig.page_size)
    if type(page_size) is not int or page_size < 1:
        raise ConfigError(f"page_size must be a positive int, got {page_size!r}")
    comps = (swa_component(layout, page_size),) if layout.sliding else ()
    fixed: dict[str, Any] = {
        "num_layers": len(layout.full),
        "num_kv_heads": layout.num_kv_heads,
        "head_dim": layout.head_dim,
        "dtype": layout.dtype,
        "components": comps,
    }
    for key, value in fixed.items():
        if key in options:
            given = tuple(options[key]) if key == "components" else options[key]
            if given != value:
                raise ConfigError(f"{key}={options[key]!r} does not match the model ({value!r})")
    return CacheConfig(**{**options, **fixed})


def check_cache(layout: HybridLayout, config: CacheConfig) -> None:
    """Raise ``ConfigError`` unless ``config`` can hold ``layout``'s K/V.

    The KV pool must have one layer per full-attention layer; the components must be exactly
    one sliding-window sidecar named ``swa`` (when the model has sliding layers) whose pages
    hold every sliding layer and whose window covers the model's.
    """
    got = (config.num_layers, config.num_kv_heads, config.head_dim, config.dtype)
    want = (len(layout.full), layout.num_kv_heads, layout.head_dim, layout.dtype)
    if got != want:
        raise ConfigError(
            f"cache KV shape (layers, heads, head_dim, dtype) {got} does not match the "
            f"model's full-attention layers {want}"
        )
    names = [c.name for c in config.components]
    if not layout.sliding:
        if names:
            raise ConfigError(f"the model has no sliding layers; unexpected components {names}")
        return
    if names != [SWA]:
        raise ConfigError(f"the cache needs exactly one component {SWA!r}, got {names}")
    (comp,) = config.components
    shape = (
        len(layout.sliding),
        2,
        config.page_size,
        layout.num_kv_heads,
        layout.head_dim,
    )
    if (
        comp.page_shape != shape
        or comp.dtype != layout.dtype
        or comp.hit_policy is not HitPolicy.TRAILING_PAGES
        or comp.window_tokens < layout.window - 1  # a query sees window - 1 earlier keys
    ):
        raise ConfigError(
            f"component {comp!r} does not hold the model's sliding layers: want page_shape "
            f"{shape}, dtype {layout.dtype}, a trailing window >= {layout.window - 1} tokens"
        )


__all__ = [
    "FULL",
    "SLIDING",
    "SWA",
    "HybridLayout",
    "check_cache",
    "hybrid_cache_config",
    "hybrid_layout",
    "swa_component",
]
