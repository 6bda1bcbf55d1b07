"""The layout of one ragged batch step of :class:`~aiocache_kv.models.batched.PagedBatch`, and
the attention over it.

A step runs the model once on every sequence's new tokens, flattened into one row of ``T``
tokens.  :func:`plan_step` decides, once per step and on the host:

* the flat order: the 1-token decodes first, sorted by context length, then the prefill chunks
  in the caller's order (so each decode group and each chunk is one contiguous slice of the
  queries);
* ``new_rows``: the pool row of each flat token, where every layer scatters its new K/V;
* per attention window (``None`` for full attention, ``w`` for sliding layers), a
  :class:`Gather`: the pool rows each layer reads, packed as
  ``[decode group 0 | decode group 1 | ... | chunk 0 | chunk 1 | ...]``.  A sliding layer
  reads only the window (``[start - w + 1, end)``), never the rows before it, which may be
  garbage (NaN) in a sidecar page that came back from storage without them.

Decode groups: on CPU every decode is its own group; on an accelerator, decodes of similar
context length share one, padded to the longest with copies of each sequence's last row
(always valid: it was just written) and masked.  A new group starts when padding would exceed
:data:`DECODE_PAD_WASTE` of the group's rows, or the group :data:`DECODE_GROUP_ROWS` rows.
:func:`attend` gathers one group or chunk at a time into the same scratch rows and attends over
them at once.  On CPU that keeps the rows in
cache between the gather and the attention, which measured twice as fast as padding the
decodes together (``aiocache_kv.bench.batched_attention``); on a GPU the launches per group
are what counts, so fewer, padded groups win there.

Every index tensor of the step reaches the model's device in one copy; the masks are then
built there from lengths, so nothing in a step reads a device tensor back on the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

#: a decode group's padded rows may exceed its real rows by this factor before a new group
#: starts (fewer, larger groups: fewer kernel calls; smaller groups: less padding to gather)
DECODE_PAD_WASTE = 1.25
#: nor may a group gather more rows than this (unless it is one sequence): it bounds the scratch
#: buffer, and a group this large already fills a GPU
DECODE_GROUP_ROWS = 1 << 16


@dataclass(frozen=True)
class Seq:
    """One validated sequence of a step: ``tokens`` go to positions ``[start, start + n)``."""

    tokens: Sequence[int]
    rows: torch.Tensor  #: 1-D int64 pool rows of the whole sequence (at least ``end`` long)
    start: int

    @property
    def n(self) -> int:
        """New tokens this step."""
        return len(self.tokens)

    @property
    def end(self) -> int:
        """Positions filled after the step."""
        return self.start + len(self.tokens)


@dataclass
class DecodeGroup:
    """Decodes ``q0 .. q0 + size`` of the flat order; their K/V rows ``[k0, k0 + size * width)``
    of the gather, ``width`` per sequence."""

    q0: int
    size: int
    width: int
    k0: int
    lengths: list[int] | None  #: real rows per sequence; ``None`` when all are ``width``
    mask: torch.Tensor | None = None  #: ``[size, 1, 1, width]``, True where a key is real


@dataclass
class Chunk:
    """A prefill chunk: flat tokens ``[q0, q0 + n)`` at positions ``[start, start + n)``,
    attending over gather rows ``[k0, k0 + length)`` (positions ``[lo, start + n)``)."""

    q0: int
    n: int
    k0: int
    length: int
    start: int
    lo: int
    causal: bool  #: the mask is plain top-left causal (``lo == start``, window not binding)
    mask: torch.Tensor | None = None  #: ``[n, length]``, True where a key is visible


@dataclass
class Gather:
    """The rows every layer with attention window ``window`` reads in this step."""

    window: int | None
    groups: list[DecodeGroup]
    chunks: list[Chunk]
    size: int  #: rows gathered
    largest: int  #: rows of the largest group or chunk (the scratch it needs)
    rows: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    #: the same rows as flat indices of a sidecar buffer's ``[page, slot]`` (sliding layers of
    #: a hybrid cache), without the layer's and K/V's offset
    side: torch.Tensor | None = None


@dataclass
class Step:
    """Everything one forward needs, on the model's device."""

    input_ids: torch.Tensor  #: ``[1, T]``
    position_ids: torch.Tensor  #: ``[1, T]``
    last: torch.Tensor  #: ``[len(seqs)]`` flat index of each sequence's last token
    new_rows: torch.Tensor  #: ``[T]`` pool row of each flat token
    new_side: torch.Tensor | None  #: ``new_rows`` as sidecar indices (hybrid caches only)
    gathers: dict[int | None, Gather]


def _lo(seq: Seq, window: int | None) -> int:
    """First position a query of ``seq`` may see: a query at ``q`` sees keys ``> q - window``."""
    return 0 if window is None else max(0, seq.start - window + 1)


def _decode_groups(lengths: list[int], pad: bool) -> list[tuple[int, int]]:
    """Split ascending ``lengths`` into runs ``[a, b)`` whose padding stays within the bound
    (runs of one without ``pad``)."""
    if not pad:
        return [(a, a + 1) for a in range(len(lengths))]
    runs: list[tuple[int, int]] = []
    a = 0
    while a < len(lengths):
        b, total = a + 1, lengths[a]
        while b < len(lengths) and (b + 1 - a) * lengths[b] <= min(
            DECODE_PAD_WASTE * (total + lengths[b]), DECODE_GROUP_ROWS
        ):
            total += lengths[b]
            b += 1
        runs.append((a, b))
        a = b
    return runs


def _layout(
    seqs: Sequence[Seq], decodes: list[int], prefills: list[int], window: int | None, pad: bool
) -> tuple[Gather, list[torch.Tensor]]:
    """The gather of one window: its groups, chunks and row pieces (on the rows' device)."""
    parts: list[torch.Tensor] = []
    groups: list[DecodeGroup] = []
    k = 0
    lens = [seqs[i].end - _lo(seqs[i], window) for i in decodes]
    for a, b in _decode_groups(lens, pad):
        width = lens[b - 1]
        for i, length in zip(decodes[a:b], lens[a:b], strict=True):
            s = seqs[i]
            parts.append(s.rows[s.end - length : s.end])
            if length < width:  # pad with the last (just written) row, masked
                parts.append(s.rows[s.end - 1 : s.end].expand(width - length))
        uniform = lens[a] == width
        groups.append(DecodeGroup(a, b - a, width, k, None if uniform else lens[a:b]))
        k += (b - a) * width
    chunks: list[Chunk] = []
    q = len(decodes)
    for i in prefills:
        s = seqs[i]
        lo = _lo(s, window)
        causal = lo == s.start and (window is None or s.n <= window)
        parts.append(s.rows[lo : s.end])
        chunks.append(Chunk(q, s.n, k, s.end - lo, s.start, lo, causal))
        k += s.end - lo
        q += s.n
    largest = max([grp.size * grp.width for grp in groups] + [c.length for c in chunks])
    return Gather(window, groups, chunks, k, largest), parts


def plan_step(
    seqs: Sequence[Seq],
    windows: Sequence[int | None],
    device: torch.device,
    sidecar: tuple[int, int, int | None] | None = None,
    pad: bool | None = None,
) -> Step:
    """Lay out one step over ``seqs`` (validated) for the attention windows ``windows``.

    ``pad``: decodes of similar lengths share a padded group (default: off the CPU only).

    ``sidecar`` is ``(sliding layers, page size, window)`` of a hybrid cache's SWA buffer: the
    gather of that window (and the new rows) also get their sidecar indices.
    """
    if pad is None:
        pad = device.type != "cpu"
    decodes = sorted((i for i, s in enumerate(seqs) if s.n == 1), key=lambda i: seqs[i].start)
    prefills = [i for i, s in enumerate(seqs) if s.n > 1]
    order = decodes + prefills
    tokens: list[int] = []
    positions: list[int] = []
    last = [0] * len(seqs)
    for i in order:
        s = seqs[i]
        tokens.extend(s.tokens)
        positions.extend(range(s.start, s.end))
        last[i] = len(tokens) - 1
    gathers: list[Gather] = []
    row_parts = [seqs[i].rows[seqs[i].start : seqs[i].end] for i in order]
    sizes = [len(tokens)]
    for w in dict.fromkeys(windows):
        g, parts = _layout(seqs, decodes, prefills, w, pad)
        gathers.append(g)
        row_parts.extend(parts)
        sizes.append(g.size)
    meta = [*tokens, *positions, *last]
    for g in gathers:
        for grp in g.groups:
            meta.extend(grp.lengths or ())
    rows = torch.cat(row_parts)
    host = torch.tensor(meta, dtype=torch.int64)
    if rows.device == device:
        meta_t, rows_t = host.to(device, non_blocking=True), rows
    else:  # rows on the host, model on a device: one copy for everything
        both = torch.cat([host, rows.to(torch.int64)]).to(device, non_blocking=True)
        meta_t, rows_t = both[: host.numel()], both[host.numel() :]
    t = len(tokens)
    input_ids, position_ids = meta_t[:t], meta_t[t : 2 * t]
    step = Step(
        input_ids=input_ids[None],
        position_ids=position_ids[None],
        last=meta_t[2 * t : 2 * t + len(seqs)],
        new_rows=rows_t[:t],
        new_side=None,
        gathers={},
    )
    off_rows, off_meta = t, 2 * t + len(seqs)
    longest = max([g.size for g in gathers] + [t])
    arange = torch.arange(longest, device=device)
    for g, size in zip(gathers, sizes[1:], strict=True):
        g.rows = rows_t[off_rows : off_rows + size]
        off_rows += size
        for grp in g.groups:
            if grp.lengths is not None:
                lens = meta_t[off_meta : off_meta + grp.size]
                off_meta += grp.size
                grp.mask = (arange[None, : grp.width] < lens[:, None]).view(
                    grp.size, 1, 1, grp.width
                )
        for c in g.chunks:
            if not c.causal:
                kpos = arange[: c.length] + c.lo
                qpos = arange[: c.n] + c.start
                mask = kpos[None, :] <= qpos[:, None]
                if g.window is not None:
                    mask &= kpos[None, :] > qpos[:, None] - g.window
                c.mask = mask
        step.gathers[g.window] = g
    if sidecar is not None:
        layers, page, window = sidecar
        step.new_side = side_index(step.new_rows, layers, page)
        g = step.gathers[window]
        g.side = side_index(g.rows, layers, page)
    return step


def side_index(rows: torch.Tensor, layers: int, page: int) -> torch.Tensor:
    """Flat index of pool rows ``rows`` in a ``[pages, layers, 2, page, ...]`` sidecar viewed
    as rows, for layer 0's K (add ``2 * layer * page`` for a layer, ``page`` for V)."""
    return torch.div(rows, page, rounding_mode="floor") * (2 * layers * page) + rows % page


def _repeat_kv(x: torch.Tensor, rep: int) -> torch.Tensor:
    """``[1, kv_heads, n, d]`` -> ``[1, kv_heads * rep, n, d]`` (each KV head ``rep`` times)."""
    _, heads, n, d = x.shape
    return x[:, :, None].expand(1, heads, rep, n, d).reshape(1, heads * rep, n, d)


def attend(
    g: Gather,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    offsets: tuple[int, int] | None,
    scratch: tuple[torch.Tensor, torch.Tensor],
    scaling: float | None,
    dropout: float,
) -> torch.Tensor:
    """Attention of the step's flat queries ``[1, heads, T, d]`` over the rows of ``g``.

    ``key`` / ``value`` are the layer's whole pool as ``[1, kv_heads, rows, d]`` views (a
    sidecar: its pages as flat rows, ``offsets`` then the layer's K and V offsets added to
    ``g.side``).  Each group or chunk is gathered into ``scratch`` (``[>= g.largest, kv_heads,
    d]`` each) and attended at once.  Returns ``[1, T, heads, d_v]`` in flat token order.
    """
    heads, kv_heads = query.shape[1], key.shape[1]
    rep = heads // kv_heads
    k_pool, v_pool = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [rows, kv_heads, d]
    if offsets is None:
        k_idx = v_idx = g.rows
    else:
        assert g.side is not None
        k_idx, v_idx = g.side + offsets[0], g.side + offsets[1]
    k_buf, v_buf = scratch
    dtype = query.dtype

    def rows(k0: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = torch.index_select(k_pool, 0, k_idx[k0 : k0 + n], out=k_buf[:n])
        v = torch.index_select(v_pool, 0, v_idx[k0 : k0 + n], out=v_buf[:n])
        return k.to(dtype), v.to(dtype)  # [n, kv_heads, d]

    outs: list[torch.Tensor] = []
    if g.groups:
        q_tok = query[0].transpose(0, 1)  # [T, heads, d]
    for grp in g.groups:
        k, v = rows(grp.k0, grp.size * grp.width)
        kd = k.view(grp.size, grp.width, kv_heads, -1).transpose(1, 2)
        vd = v.view(grp.size, grp.width, kv_heads, -1).transpose(1, 2)
        # one query per sequence: its heads packed per KV head act as `rep` queries
        qd = q_tok[grp.q0 : grp.q0 + grp.size].reshape(grp.size, kv_heads, rep, -1)
        out = F.scaled_dot_product_attention(
            qd, kd, vd, attn_mask=grp.mask, dropout_p=dropout, scale=scaling
        )
        outs.append(out.reshape(grp.size, heads, -1))
    gqa_ok = query.device.type == "cpu"  # elsewhere SDPA's fused kernels take GQA unmasked only
    for c in g.chunks:
        k, v = rows(c.k0, c.length)
        kc, vc = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, kv_heads, length, d]
        gqa = rep > 1 and (gqa_ok or c.mask is None)
        if rep > 1 and not gqa:
            kc, vc = _repeat_kv(kc, rep), _repeat_kv(vc, rep)
        out = F.scaled_dot_product_attention(
            query[:, :, c.q0 : c.q0 + c.n],
            kc,
            vc,
            attn_mask=c.mask,
            dropout_p=dropout,
            scale=scaling,
            is_causal=c.causal,
            enable_gqa=gqa,
        )
        outs.append(out[0].transpose(0, 1))
    return (outs[0] if len(outs) == 1 else torch.cat(outs)).unsqueeze(0)


__all__ = ["Chunk", "DecodeGroup", "Gather", "Seq", "Step", "attend", "plan_step", "side_index"]
