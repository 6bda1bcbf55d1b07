"""``PagedBatch``: one model forward for many sequences whose K/V live in the cache's pool.

:class:`~aiocache_kv.models.paged.PagedKV` serves one sequence per forward.  A serving engine
runs a ragged batch instead: in one step, some sequences prefill a chunk of their prompt
(starting after a cached prefix, or after an earlier chunk) and others decode one token.
:meth:`PagedBatch.forward` runs the ``transformers`` model once on all of their new tokens,
flattened into one row (``input_ids [1, T]``, each token with its own position id: absolute
positions for GPT-2, RoPE angles for the Llama family), and returns the last position's logits
of every sequence.

How the model is made to do that, without a dense ``[T, T]`` mask or any copy of the K/V
outside the pool:

* the model's attention implementation becomes :data:`ATTN_IMPLEMENTATION`, registered with
  ``transformers``' ``AttentionInterface``.  Called by a :class:`PagedBatch` step it runs the
  batched attention; called any other way (``PagedKV``, ``model.generate``) it is exactly
  ``"sdpa"`` (its mask function is SDPA's too), so the model keeps working as before;
* every layer's cache update (a ``Cache`` built for the step) scatters the layer's new K/V into
  each sequence's rows ``rows[start : start + n]``;
* the attention function then gathers, into a reused scratch buffer, the rows each sequence
  attends over (``rows[: start + n]``, or the window on sliding layers) and attends its
  queries over them, causally from its ``start``, never over another sequence's rows: one
  ``scaled_dot_product_attention`` per sequence on CPU, per group of decodes of similar lengths
  (padded) on a GPU (:mod:`aiocache_kv.models.batched_plan`);
* a 4-D placeholder mask makes ``transformers`` skip building masks.

Hybrid models (Gemma 3: :mod:`aiocache_kv.models.hybrid`): pass ``swa=cache.sidecar("swa")``
and the full layers' views; sliding layers then read and write the sidecar exactly as
:class:`~aiocache_kv.models.hybrid.PagedHybridKV` does, and only ever the window.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from aiocache_kv.errors import CapacityError, ConfigError, InvalidInputError, InvalidTypeError
from aiocache_kv.models.batched_plan import Seq, Step, attend, plan_step
from aiocache_kv.models.compat import cache_kwargs

#: the attention implementation a :class:`PagedBatch` sets on its model
ATTN_IMPLEMENTATION = "aiocache_kv_batched"
#: the forward keyword that carries a step to the attention function
STEP_KWARG = "aiocache_kv_step"

FULL = "full_attention"
SLIDING = "sliding_attention"

_SDPA = ALL_ATTENTION_FUNCTIONS["sdpa"]


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's part of a step."""

    #: the new tokens of this sequence in this step (a prefill chunk, or one decode token)
    tokens: Sequence[int]
    #: 1-D int64 device-pool rows of the whole sequence so far, at least ``start +
    #: len(tokens)`` long (``MatchResult.device_indices`` then ``HiCache.alloc`` slots)
    rows: torch.Tensor
    #: position of ``tokens[0]``: rows ``rows[:start]`` already hold this sequence's K/V
    start: int


def _attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``AttentionInterface`` entry: a :class:`PagedBatch` step, else plain SDPA."""
    step = kwargs.pop(STEP_KWARG, None)
    if not isinstance(step, _BatchKV):
        out: tuple[torch.Tensor, None] = _SDPA(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
        return out
    return step.attention(module, query, key, value, dropout, scaling, kwargs), None


AttentionInterface.register(ATTN_IMPLEMENTATION, _attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


@dataclass(frozen=True)
class _Source:
    """Where one model layer's K/V live: pool rows (``side`` None) or a sidecar's pages."""

    k: torch.Tensor  #: ``[rows, kv_heads, head_dim]`` (a sidecar: its flat row view)
    v: torch.Tensor
    window: int | None
    side: tuple[int, int] | None = None  #: (K offset, V offset) in the flat sidecar


class _Layer(CacheLayerMixin):  # type: ignore[no-untyped-call]
    """One model layer's view of a :class:`_BatchKV` step."""

    is_compileable = False
    is_croppable = False

    def __init__(self, owner: _BatchKV, layer: int, sliding: bool) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._owner = owner
        self._layer = layer
        self.is_sliding = sliding
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to allocate: the pool exists already."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Scatter the step's new K/V into the pool; return the layer's pool (the attention
        gathers the rows each sequence reads)."""
        return self._owner.update_layer(self._layer, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """Masks are not built for a step (each sequence has its own offset)."""
        return query_length, 0

    def get_seq_length(self) -> int:
        """No single length: positions are passed per token."""
        return 0

    def get_max_length(self) -> int:
        """No fixed maximum."""
        return -1


class _BatchKV(Cache):
    """The ``Cache`` of a :class:`PagedBatch`: the sources per model layer and the current
    step.  It is also the object the attention function receives (:data:`STEP_KWARG`)."""

    def __init__(self, sources: list[_Source], sliding: list[bool]) -> None:
        self.sources = sources
        self.step: Step | None = None
        ref = sources[0].k
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None
        self._row_shape = tuple(ref.shape[1:])
        self._dtype = ref.dtype
        self._device = ref.device
        super().__init__(layers=[_Layer(self, i, s) for i, s in enumerate(sliding)])

    def scratch(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V buffers of at least ``rows`` rows, reused by every layer and step (fresh
        buffers of this size would cost page faults on every layer of every step)."""
        if self._scratch is None or self._scratch[0].shape[0] < rows:
            have = 0 if self._scratch is None else self._scratch[0].shape[0]
            cap = max(rows, have + have // 2)
            shape = (cap, *self._row_shape)
            self._scratch = (
                torch.empty(shape, dtype=self._dtype, device=self._device),
                torch.empty(shape, dtype=self._dtype, device=self._device),
            )
        return self._scratch

    def update_layer(
        self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Scatter the step's new K/V of ``layer`` into its rows; return the layer's whole
        pool (views, ``[1, kv_heads, rows, d]``): the attention gathers what it reads."""
        step = self.step
        if step is None:
            raise ConfigError("this Cache serves PagedBatch.forward only")
        src = self.sources[layer]
        k_new = key_states[0].transpose(0, 1).to(src.k.dtype)  # [T, kv_heads, head_dim]
        v_new = value_states[0].transpose(0, 1).to(src.v.dtype)
        if src.side is None:
            src.k.index_copy_(0, step.new_rows, k_new)
            src.v.index_copy_(0, step.new_rows, v_new)
        else:
            assert step.new_side is not None
            src.k.index_copy_(0, step.new_side + src.side[0], k_new)
            src.v.index_copy_(0, step.new_side + src.side[1], v_new)
        return src.k.permute(1, 0, 2).unsqueeze(0), src.v.permute(1, 0, 2).unsqueeze(0)

    def attention(
        self,
        module: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        dropout: float,
        scaling: float | None,
        kwargs: dict[str, Any],
    ) -> torch.Tensor:
        step = self.step
        layer = getattr(module, "layer_idx", None)
        if step is None or not isinstance(layer, int) or not 0 <= layer < len(self.sources):
            raise ConfigError(f"batched attention called outside a step (layer {layer!r})")
        if kwargs.get("softcap") is not None:
            raise ConfigError("batched attention does not support attention logit softcapping")
        window = self.sources[layer].window
        if kwargs.get("sliding_window") != window:
            raise ConfigError(
                f"layer {layer} attends with sliding_window={kwargs.get('sliding_window')!r}, "
                f"the cache layout expects {window!r}"
            )
        g = step.gathers[window]
        scratch = self.scratch(g.largest)
        side = self.sources[layer].side
        return attend(g, query, key, value, side, scratch, scaling, dropout)


@dataclass(frozen=True)
class _Shape:
    """What the model's config says about its attention."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    windows: tuple[int | None, ...]  #: per model layer
    vocab: int
    positions: int


def _model_shape(model: Any) -> _Shape:
    cfg = model.config
    cfg = getattr(cfg, "get_text_config", lambda: cfg)()
    if getattr(cfg, "add_cross_attention", False) or getattr(cfg, "is_encoder_decoder", False):
        raise ConfigError("PagedBatch serves decoder-only models without cross-attention")
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        raise ConfigError(
            f"attn_logit_softcapping={cfg.attn_logit_softcapping!r} is not supported (SDPA)"
        )
    layers = int(cfg.num_hidden_layers)
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    sliding = getattr(cfg, "sliding_window", None)
    types = list(getattr(cfg, "layer_types", None) or [])
    if types:
        bad = sorted(set(types) - {FULL, SLIDING})
        if bad or len(types) != layers:
            raise ConfigError(f"unsupported layer_types {types!r}: only {FULL!r} / {SLIDING!r}")
        if SLIDING in types and not (isinstance(sliding, int) and sliding >= 1):
            raise ConfigError(f"sliding layers need a sliding_window >= 1, got {sliding!r}")
        windows = tuple(sliding if t == SLIDING else None for t in types)
    else:  # no layer types (Mistral): a sliding_window applies to every layer
        windows = (int(sliding) if sliding else None,) * layers
    return _Shape(
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        windows=windows,
        vocab=int(cfg.vocab_size),
        positions=int(cfg.max_position_embeddings),
    )


def _check_view(i: int, k: torch.Tensor, v: torch.Tensor, want: tuple[int, int]) -> None:
    if k.dim() != 3 or k.shape != v.shape or tuple(k.shape[1:]) != want:
        raise ConfigError(
            f"pool view {i} must be K and V of shape [rows, {want[0]}, {want[1]}] (the model's "
            f"kv heads and head_dim), got {tuple(k.shape)} and {tuple(v.shape)}"
        )


def _hybrid_sources(
    shape: _Shape, views: list[tuple[torch.Tensor, torch.Tensor]], swa: torch.Tensor
) -> tuple[list[_Source], tuple[int, int, int | None]]:
    """Full layers in the pool views, sliding layers in the ``swa`` sidecar, as
    :class:`~aiocache_kv.models.hybrid.PagedHybridKV` lays them out."""
    full = [m for m, w in enumerate(shape.windows) if w is None]
    slid = [m for m, w in enumerate(shape.windows) if w is not None]
    if not slid or not full or len(views) != len(full):
        raise ConfigError(
            f"swa given for a model of {len(full)} full-attention and {len(slid)} sliding "
            f"layers with {len(views)} pool views: want one view per full-attention layer, "
            "and layers of both kinds"
        )
    window = shape.windows[slid[0]]
    rows = views[0][0].shape[0]
    if swa.dim() != 6 or swa.shape[0] * swa.shape[3] != rows:
        raise ConfigError(
            f"swa must be [pages, {len(slid)}, 2, page_size, {shape.kv_heads}, "
            f"{shape.head_dim}] over the pool's {rows} rows, got {tuple(swa.shape)}"
        )
    page = int(swa.shape[3])
    got = tuple(swa.shape[1:])
    need = (len(slid), 2, page, shape.kv_heads, shape.head_dim)
    k0 = views[0][0]
    if got != need or not swa.is_contiguous() or (swa.device, swa.dtype) != (k0.device, k0.dtype):
        raise ConfigError(
            f"swa pages must be {need}, contiguous, {k0.dtype} on {k0.device} like the pool; "
            f"got {got}, {swa.dtype} on {swa.device}"
        )
    flat = swa.view(-1, shape.kv_heads, shape.head_dim)
    sources: list[_Source] = [None] * shape.layers  # type: ignore[list-item]
    for j, m in enumerate(full):
        sources[m] = _Source(views[j][0], views[j][1], None)
    for s, m in enumerate(slid):
        off = 2 * s * page
        sources[m] = _Source(flat, flat, window, side=(off, off + page))
    return sources, (len(slid), page, window)


class PagedBatch:
    """Runs ``model`` on a ragged batch of sequences whose K/V live in pool rows.

    ``views`` is ``[cache.device_kv(layer) for layer in range(cache.config.num_layers)]``,
    taken on the loop thread (``HiCache`` checks its owner); one view per model layer, or, for
    a hybrid model (Gemma 3), one per full-attention layer together with
    ``swa=cache.sidecar("swa")`` (:func:`~aiocache_kv.models.hybrid.hybrid_cache_config`).
    :meth:`forward` may then run on a model thread, as long as the rows it touches are pinned
    (a cached prefix) or held (slots from ``alloc``) by their requests.  One step runs at a
    time per :class:`PagedBatch`.

    The model's attention implementation becomes :data:`ATTN_IMPLEMENTATION`, which is plain
    ``"sdpa"`` for every call that is not a :meth:`forward` step (``PagedKV``,
    ``model.generate``): a model built with another implementation (``"eager"``) computes with
    SDPA from now on.

    ``pad_decodes``: attend the 1-token decodes of similar context lengths together, padded,
    one SDPA per group, rather than one per sequence.  Default: on accelerators only (on CPU,
    one sequence at a time keeps its rows in cache and measured faster).

    Raises:
        ConfigError: the views do not match the model (layer count, kv heads, head_dim), a
            sidecar that does not hold the sliding layers, a model it cannot serve
            (cross-attention, logit softcapping, layer types other than full / sliding), or
            ``pad_decodes`` not a bool.
    """

    def __init__(
        self,
        model: Any,
        views: Sequence[tuple[torch.Tensor, torch.Tensor]],
        *,
        swa: torch.Tensor | None = None,
        pad_decodes: bool | None = None,
    ) -> None:
        if pad_decodes is not None and not isinstance(pad_decodes, bool):
            raise ConfigError(f"pad_decodes must be a bool or None, got {pad_decodes!r}")
        shape = _model_shape(model)
        views = list(views)
        want = (shape.kv_heads, shape.head_dim)
        for i, (k, v) in enumerate(views):
            _check_view(i, k, v, want)
        rows = {k.shape[0] for k, _ in views}
        devices = {k.device for kv in views for k in kv}
        dtypes = {k.dtype for kv in views for k in kv}
        if len(rows) > 1 or len(devices) > 1 or len(dtypes) > 1:
            raise ConfigError(
                f"pool views differ in rows {sorted(rows)}, devices {devices} or dtypes {dtypes}"
            )
        sliding = [w is not None for w in shape.windows]
        if swa is None:
            if len(views) != shape.layers:
                hint = ""
                if len(views) == shape.windows.count(None) and any(sliding):
                    hint = "; a hybrid cache also needs swa=cache.sidecar('swa')"
                raise ConfigError(
                    f"{len(views)} pool views for a model of {shape.layers} layers{hint}"
                )
            sources = [_Source(k, v, w) for (k, v), w in zip(views, shape.windows, strict=True)]
            sidecar = None
        else:
            sources, sidecar = _hybrid_sources(shape, views, swa)
        self._sidecar: tuple[int, int, int | None] | None = sidecar
        self.model = model
        self.num_rows = int(next(iter(rows)))
        self.device = next(iter(devices))
        self.vocab_size = shape.vocab
        self.max_positions = shape.positions
        self._windows = tuple(dict.fromkeys(shape.windows))
        self._kv = _BatchKV(sources, sliding)
        self._pad = pad_decodes
        self._flags: torch.Tensor | None = None
        self._no_mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=self.device)
        model.set_attn_implementation(ATTN_IMPLEMENTATION)

    def forward(self, seqs: Sequence[SeqChunk]) -> torch.Tensor:
        """Run the model once over every sequence's new tokens; return the logits of each
        sequence's last new token, ``[len(seqs), vocab]`` in the order of ``seqs``.

        Each chunk's K/V land in ``rows[start : start + len(tokens)]`` of every layer's pool
        (and of the sidecar for sliding layers); each sequence attends over its own rows
        ``rows[: start + len(tokens)]`` only.  Nothing is written when the input is refused.
        Rows given on the host are checked (in range, the new ones distinct and read by no
        other sequence of the step); rows on the device are not, to keep the step free of
        host syncs.

        Raises:
            InvalidInputError: no sequences; a sequence without tokens; a token outside the
                vocabulary; ``start`` negative or not an int; ``rows`` not 1-D int64, or on
                another device; past the model's positions; rows out of the pool's range,
                written twice, or written by one sequence and read by another.
            InvalidTypeError: a sequence that is not a :class:`SeqChunk`, a token not an int.
            CapacityError: ``rows`` shorter than ``start + len(tokens)``.
            ConfigError: the model's attention does not match the layout (a layer's sliding
                window, softcapping); found while the model runs, so the step's new rows may
                hold some layers' K/V (they held nothing valid before the step either).
        """
        checked = self._check(seqs)
        step = plan_step(checked, self._windows, self.device, self._sidecar, self._pad)
        kv = self._kv
        kv.step = step
        model = self.model
        try:
            with torch.no_grad():
                out = model(
                    input_ids=step.input_ids,
                    position_ids=step.position_ids,
                    attention_mask=self._no_mask,
                    use_cache=True,
                    logits_to_keep=step.last,
                    **cache_kwargs(model, kv),
                    **{STEP_KWARG: kv},
                )
        finally:
            kv.step = None
        logits: torch.Tensor = out.logits[0]
        return logits

    def _check(self, seqs: Sequence[SeqChunk]) -> list[Seq]:
        """Validate ``seqs`` without touching the pool."""
        if not isinstance(seqs, Sequence) or not seqs:
            raise InvalidInputError(f"forward needs a non-empty sequence of SeqChunk, got {seqs!r}")
        out: list[Seq] = []
        host = True
        for i, s in enumerate(seqs):
            if not isinstance(s, SeqChunk):
                raise InvalidTypeError(f"sequence {i} is a {type(s).__name__}, not a SeqChunk")
            toks = list(s.tokens)
            n, start, rows = len(toks), s.start, s.rows
            if n < 1:
                raise InvalidInputError(f"sequence {i} has no tokens")
            if isinstance(start, bool) or not isinstance(start, int) or start < 0:
                raise InvalidInputError(f"sequence {i}: start must be an int >= 0, got {start!r}")
            if not isinstance(rows, torch.Tensor) or rows.dim() != 1 or rows.dtype != torch.int64:
                got = (
                    f"{rows.dtype} {tuple(rows.shape)}" if isinstance(rows, torch.Tensor) else rows
                )
                raise InvalidInputError(f"sequence {i}: rows must be 1-D int64, got {got!r}")
            if rows.device.type != "cpu" and rows.device != self.device:
                raise InvalidInputError(
                    f"sequence {i}: rows on {rows.device}, the pool is on {self.device}"
                )
            if start + n > rows.numel():
                raise CapacityError(
                    f"sequence {i} needs {start + n} KV rows (start {start} + {n} tokens), "
                    f"{rows.numel()} were given"
                )
            if start + n > self.max_positions:
                raise InvalidInputError(
                    f"sequence {i} reaches position {start + n}, past the model's "
                    f"{self.max_positions}"
                )
            self._check_tokens(i, toks)
            host = host and rows.device.type == "cpu"
            out.append(Seq(toks, rows, start))
        if host:
            self._check_rows(out)
        return out

    def _check_tokens(self, i: int, toks: list[int]) -> None:
        for t in toks:
            if isinstance(t, bool) or not isinstance(t, int):
                raise InvalidTypeError(f"sequence {i}: token {t!r} is not an int")
            if not 0 <= t < self.vocab_size:
                raise InvalidInputError(
                    f"sequence {i}: token {t} outside the vocabulary [0, {self.vocab_size})"
                )

    def _check_rows(self, seqs: list[Seq]) -> None:
        """Host rows: in the pool, each new row written once and read by no sequence."""
        new = torch.cat([s.rows[s.start : s.end] for s in seqs])
        old = torch.cat([s.rows[: s.start] for s in seqs])
        for part in (new, old):
            if part.numel():
                lo, hi = (int(x) for x in torch.aminmax(part))
                if lo < 0 or hi >= self.num_rows:
                    raise InvalidInputError(
                        f"rows must be in [0, {self.num_rows}), got {lo} .. {hi}"
                    )
        if self._flags is None:  # one int per pool row, all zero between checks
            self._flags = torch.zeros(self.num_rows, dtype=torch.int32)
        flags = self._flags
        flags.index_fill_(0, old, 1)
        listed = new[flags[new] > 0]
        flags.index_fill_(0, old, 0)
        if listed.numel():
            raise InvalidInputError(
                f"rows {listed[:8].tolist()} are written in this step and also listed as cached "
                "K/V (rows[:start]) of a sequence"
            )
        flags.index_add_(0, new, torch.ones_like(new, dtype=torch.int32))
        twice = new[flags[new] > 1]
        flags.index_fill_(0, new, 0)
        if twice.numel():
            raise InvalidInputError(
                f"rows {sorted(set(twice[:16].tolist()))} are written twice in one step"
            )


__all__ = ["ATTN_IMPLEMENTATION", "PagedBatch", "SeqChunk"]
