"""``PagedKV``: a ``transformers`` ``Cache`` whose K/V live in the cache's device pool.

One :class:`PagedKV` serves one sequence (batch 1).  It is given the pool rows of the whole
sequence up front - the cached prefix (``MatchResult.device_indices``) followed by slots from
``HiCache.alloc`` - and a count of rows already filled.  For each forward of ``n`` tokens,
every attention layer calls ``update(k, v, layer)``; :class:`PagedKV` then

1. scatters the new ``k``/``v`` (``[1, heads, n, head_dim]``) into pool rows
   ``rows[filled : filled + n]`` of ``device_kv(layer)`` (``[rows, heads, head_dim]``), and
2. returns the K/V of rows ``rows[: filled + n]`` gathered from the pool, as
   ``[1, heads, filled + n, head_dim]``, for the attention of this step.

The gathered tensors are transient (one layer at a time, like a paged-attention kernel's
gather); the pool is the only place the sequence's KV is kept, so whatever the model writes is
exactly what ``insert`` caches and what a later request reads back.

Positions and masks: ``get_seq_length()`` is the number of filled rows, so HF's GPT-2 derives
position ids and the causal mask offset from it; :meth:`forward` passes position ids
explicitly anyway.  Rotary models (Llama, Qwen2, Mistral) hand ``update`` their K already
rotated for its position; a cached page is only ever reused at the positions it was computed
at (the tree's key is the whole prefix), so nothing is rotated again.  Every layer reports
offset 0 and the whole sequence, so a sliding-window layer (Mistral's ``sliding_window``) gets
every row and the model's sliding mask hides those before its window: the same attention as
``transformers``' own cache, without the memory saving of a window sidecar.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from aiocache_kv.errors import CapacityError, InvalidInputError
from aiocache_kv.models.compat import cache_kwargs


class _PoolLayer(CacheLayerMixin):  # type: ignore[no-untyped-call]
    """One attention layer's view of a :class:`PagedKV`."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, owner: PagedKV, layer: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._owner = owner
        self._layer = layer
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to allocate: the pool exists already."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Scatter the new K/V into the pool, return the whole sequence's K/V from it."""
        return self._owner.update_layer(self._layer, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """KV length and offset of the next attention: filled rows plus the query."""
        return self._owner.filled + query_length, 0

    def get_seq_length(self) -> int:
        """Rows already filled (the position of the next token)."""
        return self._owner.filled

    def get_max_length(self) -> int:
        """The rows this sequence was given."""
        return int(self._owner.rows.numel())

    def reset(self) -> None:
        """Forget the filled rows (the pool keeps its data; the rows stay the caller's)."""
        self._owner.filled = 0


class PagedKV(Cache):
    """KV of one sequence in pool rows ``rows``; the first ``filled`` rows hold valid K/V.

    ``views`` is ``[cache.device_kv(layer) for layer in range(num_layers)]``: take them on the
    loop thread (``HiCache`` checks its owner); the tensors themselves may then be used by a
    model running in a worker thread, since the rows it touches are pinned (prefix) or held
    (new slots) by the request.

    Raises:
        InvalidInputError: ``rows`` is not 1-D int64, or ``filled`` is out of range.
    """

    def __init__(
        self,
        views: Sequence[tuple[torch.Tensor, torch.Tensor]],
        rows: torch.Tensor,
        filled: int = 0,
    ) -> None:
        if rows.dim() != 1 or rows.dtype != torch.int64:
            raise InvalidInputError(f"rows must be 1-D int64, got {rows.dtype} {tuple(rows.shape)}")
        if not 0 <= filled <= rows.numel():
            raise InvalidInputError(f"filled must be in [0, {rows.numel()}], got {filled}")
        self.views = list(views)
        self.rows = rows.to(self.views[0][0].device) if self.views else rows
        self.filled = filled
        super().__init__(layers=[_PoolLayer(self, i) for i in range(len(self.views))])

    def update_layer(
        self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if key_states.shape[0] != 1:
            raise InvalidInputError(f"PagedKV serves batch 1, got batch {key_states.shape[0]}")
        n = key_states.shape[2]
        end = self.filled + n
        if end > self.rows.numel():
            raise CapacityError(f"sequence needs {end} KV rows, {self.rows.numel()} were allocated")
        k_pool, v_pool = self.views[layer]
        new = self.rows[self.filled : end]
        # [1, heads, n, dim] -> [n, heads, dim], the pool's row layout
        k_pool.index_copy_(0, new, key_states[0].transpose(0, 1).to(k_pool.dtype))
        v_pool.index_copy_(0, new, value_states[0].transpose(0, 1).to(v_pool.dtype))
        rows = self.rows[:end]
        k = k_pool.index_select(0, rows).permute(1, 0, 2).unsqueeze(0)
        v = v_pool.index_select(0, rows).permute(1, 0, 2).unsqueeze(0)
        return k, v

    def forward(self, model: Any, tokens: Sequence[int]) -> torch.Tensor:
        """Run ``model`` on ``tokens`` (the next positions); return the last position's logits.

        The new tokens' K/V land in the pool; ``filled`` advances by ``len(tokens)``.
        """
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


__all__ = ["PagedKV"]
