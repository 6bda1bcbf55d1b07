"""A hybrid sliding-window / full-attention model over the cache: full KV in the pool, SWA
KV in a :func:`~aiocache_kv.SlidingWindow` sidecar.

Any ``transformers`` decoder whose config has ``layer_types`` made of ``"full_attention"`` and
``"sliding_attention"`` plus a ``sliding_window`` should fit (Gemma 2/3, Cohere 2, Qwen 2 or
Mistral with sliding layers, ...; only Gemma 3 is tested); :func:`build_gemma3` builds a small
Gemma 3 text model with seeded random weights (nothing is downloaded).  The layout and the
matching ``CacheConfig`` live in :mod:`aiocache_kv.models.hybrid_config` (re-exported here).

Layer mapping (:class:`HybridLayout`):

* full-attention layer ``layers.full[j]`` keeps its K/V in the KV pool, layer ``j`` of
  ``HiCache.device_kv(j)`` (so the cache's ``num_layers`` is the number of full layers);
* sliding layer ``layers.sliding[s]`` keeps its K/V in the sidecar ``swa`` at page slot
  ``[page, s, 0 (K) | 1 (V), slot % page_size]`` of a buffer ``[device_pages, swa_layers, 2,
  page_size, kv_heads, head_dim]`` - the same page ids as the KV pool (``slot // page_size``).

Only the window is ever read back.  A sliding layer running queries at positions
``[filled, filled + n)`` gathers the rows of positions ``[filled - window + 1, filled + n)``
and nothing earlier (``get_mask_sizes`` reports that offset, as ``transformers``' own
``DynamicSlidingWindowLayer`` does).  Pages that came back from storage without their SWA part
hold garbage (possibly NaN, which a mask cannot cancel: ``NaN * 0`` is NaN); they lie before the
window by the component's hit policy, so they are never gathered.

Where the reused prefix ends matters: the cache guarantees the window only at the end of a match,
so :class:`HybridLM` matches exactly the part it will reuse (the prompt's whole pages except the
one holding its last token) rather than cutting a longer match short.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from aiocache_kv.cache import HiCache
from aiocache_kv.errors import CapacityError, ConfigError, InvalidInputError
from aiocache_kv.logs import get_logger
from aiocache_kv.models.compat import cache_kwargs
from aiocache_kv.models.generate import CachedLM, reference_generate
from aiocache_kv.models.hybrid_config import (
    FULL,
    SLIDING,
    SWA,
    HybridLayout,
    check_cache,
    hybrid_cache_config,
    hybrid_layout,
    swa_component,
)

log = get_logger(__name__)


# --------------------------------------------------------------------------- model


@dataclass(frozen=True)
class HybridSpec:
    """Size and seed of a random-weight Gemma 3 text model (defaults: 6 layers, 2 of them
    full attention, a 10-token window)."""

    layer_types: tuple[str, ...] = (SLIDING, FULL, SLIDING, SLIDING, FULL, SLIDING)
    hidden_size: int = 64
    intermediate_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    vocab_size: int = 1024
    max_positions: int = 512
    sliding_window: int = 10
    seed: int = 0
    #: large enough for varied greedy outputs (with untied embeddings)
    initializer_range: float = 0.2
    attn_implementation: str = "sdpa"

    @property
    def name(self) -> str:
        """A namespace for the cache: changes whenever the weights would."""
        kinds = "".join("f" if t == FULL else "s" for t in self.layer_types)
        return (
            f"gemma3-random-{kinds}-D{self.hidden_size}-I{self.intermediate_size}"
            f"-H{self.num_heads}x{self.num_kv_heads}x{self.head_dim}-V{self.vocab_size}"
            f"-W{self.sliding_window}-i{self.initializer_range}-s{self.seed}"
        )


def build_gemma3(spec: HybridSpec | None = None) -> Any:
    """A ``Gemma3ForCausalLM`` in eval mode with weights drawn under ``torch.manual_seed``.

    Raises:
        ConfigError: a layer type other than full / sliding attention.
    """
    s = spec if spec is not None else HybridSpec()
    bad = sorted(set(s.layer_types) - {FULL, SLIDING})
    if bad or not s.layer_types:
        raise ConfigError(f"layer_types must be {FULL!r} / {SLIDING!r}, got {s.layer_types!r}")
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=s.vocab_size,
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=len(s.layer_types),
        num_attention_heads=s.num_heads,
        num_key_value_heads=s.num_kv_heads,
        head_dim=s.head_dim,
        max_position_embeddings=s.max_positions,
        sliding_window=s.sliding_window,
        layer_types=list(s.layer_types),
        query_pre_attn_scalar=s.head_dim,
        initializer_range=s.initializer_range,
        tie_word_embeddings=False,  # tied random embeddings make greedy decoding repeat
        attention_dropout=0.0,
        use_cache=True,
    )
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(s.seed)
        model = Gemma3ForCausalLM(config)
        model.set_attn_implementation(s.attn_implementation)
    finally:
        torch.random.set_rng_state(state)
    model.eval()  # type: ignore[no-untyped-call]
    model.requires_grad_(False)
    return model


# --------------------------------------------------------------------------- paged cache


class _Layer(CacheLayerMixin):  # type: ignore[no-untyped-call]
    """One attention layer's view of a :class:`PagedHybridKV`."""

    is_compileable = False
    is_croppable = False

    def __init__(self, owner: PagedHybridKV, slot: int, sliding: bool) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._owner = owner
        self._slot = slot  # KV-pool layer, or sidecar slot for a sliding layer
        self.is_sliding = sliding
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to allocate: the pools exist already."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new K/V to the pool; return the K/V this step attends over."""
        owner = self._owner
        if self.is_sliding:
            return owner.update_sliding(self._slot, key_states, value_states)
        return owner.update_full(self._slot, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """KV length and offset of the next attention (the window start for sliding layers)."""
        start = self._owner.window_start() if self.is_sliding else 0
        return self._owner.filled + query_length - start, start

    def get_seq_length(self) -> int:
        """Positions already filled."""
        return self._owner.filled

    def get_max_length(self) -> int:
        """The rows this sequence was given."""
        return int(self._owner.rows.numel())

    def reset(self) -> None:
        """Forget the filled rows (the pools keep their data)."""
        self._owner.filled = 0


class PagedHybridKV(Cache):
    """K/V of one sequence (batch 1) in pool rows ``rows``; the first ``filled`` are valid.

    ``views`` are ``[cache.device_kv(j) for j in range(len(layout.full))]`` and ``swa`` is
    ``cache.sidecar("swa")`` (``None`` without sliding layers); take them on the loop thread.
    For rows ``< filled`` only the full layers' K/V and the sliding layers' last
    ``window - 1`` positions need to be valid.

    Raises:
        InvalidInputError: bad ``rows`` / ``filled``, or buffers of the wrong shape.
    """

    def __init__(
        self,
        layout: HybridLayout,
        views: Sequence[tuple[torch.Tensor, torch.Tensor]],
        swa: torch.Tensor | None,
        page_size: int,
        rows: torch.Tensor,
        filled: int = 0,
    ) -> None:
        if rows.dim() != 1 or rows.dtype != torch.int64:
            raise InvalidInputError(f"rows must be 1-D int64, got {rows.dtype} {tuple(rows.shape)}")
        if not 0 <= filled <= rows.numel():
            raise InvalidInputError(f"filled must be in [0, {rows.numel()}], got {filled}")
        if len(views) != len(layout.full):
            raise InvalidInputError(
                f"{len(views)} KV-pool views for {len(layout.full)} full-attention layers"
            )
        if layout.sliding:
            want = (len(layout.sliding), 2, page_size, layout.num_kv_heads, layout.head_dim)
            if swa is None or tuple(swa.shape[1:]) != want:
                got = None if swa is None else tuple(swa.shape[1:])
                raise InvalidInputError(f"sidecar pages must be {want}, got {got}")
        self.layout = layout
        self.views = list(views)
        self.swa = swa
        self.page_size = page_size
        self.rows = rows.to(self.views[0][0].device)
        self.filled = filled
        kinds: dict[int, tuple[int, bool]] = {m: (j, False) for j, m in enumerate(layout.full)}
        kinds.update({m: (s, True) for s, m in enumerate(layout.sliding)})
        super().__init__(layers=[_Layer(self, *kinds[m]) for m in range(layout.num_layers)])

    def window_start(self) -> int:
        """First position a sliding layer reads for queries starting at ``filled``."""
        return max(0, self.filled - self.layout.window + 1)

    def _rows_for(self, key_states: torch.Tensor) -> tuple[torch.Tensor, int]:
        if key_states.shape[0] != 1:
            raise InvalidInputError(f"PagedHybridKV serves batch 1, got {key_states.shape[0]}")
        end = self.filled + key_states.shape[2]
        if end > self.rows.numel():
            raise CapacityError(f"sequence needs {end} KV rows, {self.rows.numel()} were allocated")
        return self.rows[self.filled : end], end

    def update_full(
        self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        new, end = self._rows_for(key_states)
        k_pool, v_pool = self.views[layer]
        # [1, heads, n, dim] -> [n, heads, dim], the pool's row layout
        k_pool.index_copy_(0, new, key_states[0].transpose(0, 1).to(k_pool.dtype))
        v_pool.index_copy_(0, new, value_states[0].transpose(0, 1).to(v_pool.dtype))
        rows = self.rows[:end]
        k = k_pool.index_select(0, rows).permute(1, 0, 2).unsqueeze(0)
        v = v_pool.index_select(0, rows).permute(1, 0, 2).unsqueeze(0)
        return k.to(key_states.dtype), v.to(value_states.dtype)

    def update_sliding(
        self, slot: int, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        new, end = self._rows_for(key_states)
        assert self.swa is not None
        p = self.page_size
        k_buf = self.swa[:, slot, 0]  # [device_pages, page_size, heads, dim] views
        v_buf = self.swa[:, slot, 1]
        k_buf[new // p, new % p] = key_states[0].transpose(0, 1).to(k_buf.dtype)
        v_buf[new // p, new % p] = value_states[0].transpose(0, 1).to(v_buf.dtype)
        # the window only: rows before it may be garbage from storage (see the module doc)
        rows = self.rows[self.window_start() : end]
        k = k_buf[rows // p, rows % p].permute(1, 0, 2).unsqueeze(0)
        v = v_buf[rows // p, rows % p].permute(1, 0, 2).unsqueeze(0)
        return k.to(key_states.dtype), v.to(value_states.dtype)

    def forward(self, model: Any, tokens: Sequence[int]) -> torch.Tensor:
        """Run ``model`` on ``tokens`` (the next positions); return the last position's logits."""
        n = len(tokens)
        if n < 1:
            raise InvalidInputError("forward needs at least one token")
        device = self.rows.device
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=device)
        pos = torch.arange(self.filled, self.filled + n, device=device)[None]
        with torch.no_grad():
            out = model(
                input_ids=ids,
                position_ids=pos,
                **cache_kwargs(model, self),
                use_cache=True,
                logits_to_keep=1,
            )
        self.filled += n
        logits: torch.Tensor = out.logits[0, -1]
        return logits


# --------------------------------------------------------------------------- generation


#: the baseline needs nothing hybrid-specific: ``transformers``' cache keeps sliding windows
reference_generate_hybrid = reference_generate


class HybridLM(CachedLM):
    """A hybrid SWA / full-attention model whose K/V live in ``cache`` (pool + sidecar).

    The serving loop of :class:`~aiocache_kv.models.CachedLM`; only the model-side view of a
    request's KV differs (full layers in the KV pool, sliding layers in the ``swa`` sidecar).

    Raises:
        ConfigError: the cache's KV shape or components do not match the model.
    """

    def _check_model(self, model: Any, cache: HiCache) -> None:
        self.layout = hybrid_layout(model)
        check_cache(self.layout, cache.config)

    def _match_tokens(self, toks: list[int], reusable: int) -> list[int]:
        # exactly the reusable part: the cache guarantees a whole sliding window only at the
        # end of a match, so the match must end where the reuse ends (a prompt of <= one page
        # matches nothing: its aligned length is 0)
        return toks[: max(reusable, 1)]

    def _sequence(self, rows: torch.Tensor, filled: int) -> Any:
        cache = self.cache
        layout = self.layout
        views = [cache.device_kv(j) for j in range(len(layout.full))]
        swa = cache.sidecar(SWA) if layout.sliding else None
        return PagedHybridKV(layout, views, swa, cache.config.page_size, rows, filled)


__all__ = [
    "HybridLM",
    "HybridLayout",
    "HybridSpec",
    "PagedHybridKV",
    "build_gemma3",
    "check_cache",
    "hybrid_cache_config",
    "hybrid_layout",
    "reference_generate_hybrid",
    "swa_component",
]
