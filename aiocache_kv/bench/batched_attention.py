"""Benchmark of the batched attention of :class:`~aiocache_kv.models.batched.PagedBatch`.

One serving step: ``--decodes`` sequences decoding one token over contexts of about
``--context`` tokens (spread +-10 %) and one prefill chunk of ``--prefill`` tokens starting at
``--prefill-start``, all in one pool whose rows are handed out page by page in random order
(as the allocator does).  Two parts:

* **attention** (one layer, K/V already in the pool): the ways to attend each sequence over
  its own rows, each gathering into the same reused scratch buffer:

  - ``(a) per-sequence``: a hand-written loop, one gather and one
    ``scaled_dot_product_attention`` per sequence;
  - ``(b) block-diagonal``: one gather of every sequence's rows and one SDPA of all ``T``
    queries over all of them, with a block-diagonal causal mask (built once, not timed);
  - ``(c) padded decodes``: the decodes of similar lengths padded into one SDPA per group (what
    ``PagedBatch`` does on a GPU), each prefill chunk on its own;
  - ``PagedBatch on CPU``: its attention as it runs on CPU (one gather and SDPA per sequence);

  the ``plan`` row is the per-step host work of ``PagedBatch`` (index tensors, masks), paid
  once per step, not per layer;
* **step** (the whole model, GPT-2 small by default): ``PagedBatch.forward`` against running
  each sequence alone through ``PagedKV`` (one forward per sequence).

Run ``python -m aiocache_kv.bench.batched_attention [--threads N] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from aiocache_kv.bench.report import JSON, median, table, write_json
from aiocache_kv.models.batched import PagedBatch, SeqChunk
from aiocache_kv.models.batched_plan import Seq, attend, plan_step
from aiocache_kv.models.gpt2 import GPT2Spec, build_gpt2
from aiocache_kv.models.paged import PagedKV


@dataclass(frozen=True)
class Options:
    """The step and the model."""

    decodes: int = 16
    context: int = 500
    prefill: int = 128
    prefill_start: int = 0
    layers: int = 12
    heads: int = 12
    kv_heads: int = 12
    hidden: int = 768
    page_size: int = 16
    repeat: int = 20
    threads: int = 0  #: torch threads (0: leave torch's default)
    step: bool = True  #: also time the whole model
    seed: int = 0


def _rows(opts: Options, lengths: list[int], pool_rows: int) -> list[torch.Tensor]:
    """Rows of each sequence: whole pages in random order, like ``HiCache.alloc``."""
    p = opts.page_size
    pages = torch.randperm(pool_rows // p, generator=torch.Generator().manual_seed(opts.seed))
    out, at = [], 0
    for n in lengths:
        k = -(-n // p)
        out.append((pages[at : at + k, None] * p + torch.arange(p)).flatten())
        at += k
    return out


def _timed(fns: dict[str, Callable[[], object]], repeat: int) -> dict[str, list[float]]:
    """Seconds per call of each function, interleaved round-robin (fair under noise)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def _seqs(opts: Options) -> tuple[list[int], list[int]]:
    """Starts and token counts: the decodes, then the prefill chunk."""
    rng = random.Random(opts.seed)
    spread = max(1, opts.context // 10)
    starts = [opts.context + rng.randint(-spread, spread) for _ in range(opts.decodes)]
    counts = [1] * opts.decodes
    if opts.prefill:
        starts.append(opts.prefill_start)
        counts.append(opts.prefill)
    return starts, counts


def attention(opts: Options) -> JSON:
    """One layer's attention, three ways (see the module doc)."""
    head_dim = opts.hidden // opts.heads
    starts, counts = _seqs(opts)
    ends = [s + n for s, n in zip(starts, counts, strict=True)]
    pool_rows = 2 * opts.page_size * sum(-(-e // opts.page_size) for e in ends)
    rows = _rows(opts, ends, pool_rows)
    g = torch.Generator().manual_seed(opts.seed)
    k_pool = torch.randn(pool_rows, opts.kv_heads, head_dim, generator=g)
    v_pool = torch.randn(pool_rows, opts.kv_heads, head_dim, generator=g)
    total = sum(counts)
    query = torch.randn(1, opts.heads, total, head_dim, generator=g)
    scale = head_dim**-0.5
    k_buf = torch.empty(sum(ends) * 2, opts.kv_heads, head_dim)
    v_buf = torch.empty_like(k_buf)
    gqa = opts.heads != opts.kv_heads

    def gather(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = idx.numel()
        k = torch.index_select(k_pool, 0, idx, out=k_buf[:n])
        v = torch.index_select(v_pool, 0, idx, out=v_buf[:n])
        return k.permute(1, 0, 2)[None], v.permute(1, 0, 2)[None]

    q0 = [0]
    for n in counts:
        q0.append(q0[-1] + n)

    def per_sequence() -> torch.Tensor:
        outs = []
        for i, (s, n) in enumerate(zip(starts, counts, strict=True)):
            k, v = gather(rows[i][: s + n])
            mask = None
            if n > 1 and s > 0:  # causal from `s`: lower-right aligned
                mask = torch.arange(s + n)[None] <= torch.arange(s, s + n)[:, None]
            q = query[:, :, q0[i] : q0[i] + n]
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale, is_causal=n > 1 and s == 0, enable_gqa=gqa
            )
            outs.append(o[0].transpose(0, 1))
        return torch.cat(outs)

    all_rows = torch.cat([r[:e] for r, e in zip(rows, ends, strict=True)])
    seg = torch.repeat_interleave(torch.arange(len(ends)), torch.tensor(ends))
    kpos = torch.cat([torch.arange(e) for e in ends])
    qseg = torch.repeat_interleave(torch.arange(len(ends)), torch.tensor(counts))
    qpos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, counts, strict=True)])
    block_mask = (qseg[:, None] == seg[None]) & (kpos[None] <= qpos[:, None])

    def block_diagonal() -> torch.Tensor:
        k, v = gather(all_rows)
        o = F.scaled_dot_product_attention(
            query, k, v, attn_mask=block_mask, scale=scale, enable_gqa=gqa
        )
        return o[0].transpose(0, 1)

    seqs = [Seq([0] * n, r, s) for r, s, n in zip(rows, starts, counts, strict=True)]
    cpu = torch.device("cpu")
    order = sorted(range(opts.decodes), key=lambda i: starts[i]) + list(
        range(opts.decodes, len(seqs))
    )
    flat = flat_order(order, q0)
    flat_query = query[:, :, flat]
    k_view, v_view = k_pool.permute(1, 0, 2)[None], v_pool.permute(1, 0, 2)[None]
    plans = {pad: plan_step(seqs, (None,), cpu, pad=pad).gathers[None] for pad in (True, False)}

    def paged(pad: bool) -> Callable[[], torch.Tensor]:
        g = plans[pad]
        return lambda: attend(g, flat_query, k_view, v_view, None, (k_buf, v_buf), scale, 0.0)[0]

    ref = per_sequence()[flat]
    fns: dict[str, Callable[[], object]] = {
        "(a) per-sequence": per_sequence,
        "(b) block-diagonal": block_diagonal,
        "(c) padded decodes": paged(True),
        "PagedBatch on CPU": paged(False),
        "plan (per step)": lambda: plan_step(seqs, (None,), cpu),
    }
    err = {
        "(b) block-diagonal": float((block_diagonal()[flat] - ref).abs().max()),
        "(c) padded decodes": float((paged(True)() - ref).abs().max()),
        "PagedBatch on CPU": float((paged(False)() - ref).abs().max()),
    }
    times = _timed(fns, opts.repeat)
    out: JSON = {"rows_attended": sum(ends), "tokens": total, "max_abs_diff": err, "options": {}}
    lines = []
    for name, ts in times.items():
        best, med = min(ts) * 1e3, median(ts) * 1e3
        per_step = "" if name.startswith("plan") else f"{med * opts.layers:.1f}"
        out["options"][name] = {"min_ms": best, "median_ms": med}
        lines.append([name, f"{best:.3f}", f"{med:.3f}", per_step])
    print(
        f"\nattention, one layer: {opts.decodes} decodes (~{opts.context} rows) + "
        f"{opts.prefill}-token chunk at {opts.prefill_start}; heads {opts.heads}/"
        f"{opts.kv_heads}, head_dim {head_dim}"
    )
    table(["option", "min ms", "median ms", f"x {opts.layers} layers"], lines)
    return out


def flat_order(order: list[int], q0: list[int]) -> torch.Tensor:
    """Token indices of the caller's layout, in the flat order ``order`` of sequences."""
    return torch.tensor([t for i in order for t in range(q0[i], q0[i + 1])])


def whole_step(opts: Options) -> JSON:
    """``PagedBatch.forward`` against one ``PagedKV`` forward per sequence (GPT-2)."""
    if opts.kv_heads != opts.heads:
        return {}
    model = build_gpt2(
        GPT2Spec(
            n_layer=opts.layers,
            n_head=opts.heads,
            n_embd=opts.hidden,
            n_positions=max(1024, opts.context * 2 + opts.prefill_start + opts.prefill),
            seed=opts.seed,
        )
    )
    head_dim = opts.hidden // opts.heads
    starts, counts = _seqs(opts)
    ends = [s + n for s, n in zip(starts, counts, strict=True)]
    pool_rows = 2 * opts.page_size * sum(-(-e // opts.page_size) for e in ends)
    rows = _rows(opts, ends, pool_rows)
    views = [
        (torch.zeros(pool_rows, opts.heads, head_dim), torch.zeros(pool_rows, opts.heads, head_dim))
        for _ in range(opts.layers)
    ]
    rng = random.Random(opts.seed)
    chunks = [
        SeqChunk([rng.randrange(1000) for _ in range(n)], r, s)
        for r, s, n in zip(rows, starts, counts, strict=True)
    ]
    batch = PagedBatch(model, views)
    fns: dict[str, Callable[[], object]] = {
        "PagedBatch.forward (one step)": lambda: batch.forward(chunks),
        "PagedKV, one forward per sequence": lambda: [
            PagedKV(views, c.rows, c.start).forward(model, c.tokens) for c in chunks
        ],
    }
    times = _timed(fns, max(3, opts.repeat // 4))
    out: JSON = {}
    lines = []
    for name, ts in times.items():
        best, med = min(ts) * 1e3, median(ts) * 1e3
        out[name] = {"min_ms": best, "median_ms": med}
        lines.append([name, f"{best:.1f}", f"{med:.1f}"])
    print(f"\nwhole step, GPT-2 {opts.layers} layers x {opts.hidden}: {len(chunks)} sequences")
    table(["path", "min ms", "median ms"], lines)
    return out


def run(opts: Options) -> JSON:
    """Both parts; returns their numbers."""
    if opts.threads:
        torch.set_num_threads(opts.threads)
    out: JSON = {"options": asdict(opts), "threads": torch.get_num_threads()}
    with torch.no_grad():
        out["attention"] = attention(opts)
        if opts.step:
            out["step"] = whole_step(opts)
    return out


def main(argv: list[str] | None = None) -> None:
    """Command line: every :class:`Options` field as ``--name``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    for name, value in asdict(Options()).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=value)
        else:
            parser.add_argument(flag, type=type(value), default=value)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = vars(parser.parse_args(argv))
    path = args.pop("json")
    result = run(Options(**args))
    if path is not None:
        write_json(result, path)


if __name__ == "__main__":
    main()
