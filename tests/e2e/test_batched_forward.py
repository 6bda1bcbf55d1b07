"""``PagedBatch``: one forward for a ragged batch (prefill chunks and decodes) over pool rows.

Against each sequence run alone through ``PagedKV`` (``PagedHybridKV`` for Gemma 3): the same
logits and the same K/V written; against ``transformers``' own ``generate``: the same greedy
tokens while sequences join and leave the batch.  Models: the random GPT-2 of the e2e tests,
Llama, Qwen2 and Mistral (a 6-token sliding window on every layer, all in the pool) with grouped
KV heads and a head_dim other than hidden / heads, and Gemma 3 (sliding layers in the ``swa``
sidecar).  Every device pool starts poisoned with NaN, so a read
of a row no one wrote shows up as NaN.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import aiocache_kv as akv
from aiocache_kv.models import (
    HybridSpec,
    build_gemma3,
    build_gpt2,
    cache_config_for,
    hybrid_cache_config,
    hybrid_layout,
)
from aiocache_kv.models.batched import PagedBatch, SeqChunk
from aiocache_kv.models.hybrid import PagedHybridKV
from aiocache_kv.models.paged import PagedKV
from tests.e2e.conftest import SPEC

ATOL = 5e-5


def build_llama_family(kind: str) -> Any:
    """Three layers, 8 query heads over 2 KV heads, head_dim 24 (hidden 64), random weights;
    Mistral with a 6-token sliding window on every layer."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[kind]
    extra = {"sliding_window": 6} if kind == "mistral" else {}
    config = cls(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=24,
        max_position_embeddings=512,
        initializer_range=0.2,  # varied greedy outputs
        tie_word_embeddings=False,
        **extra,
    )
    with torch.random.fork_rng():
        torch.manual_seed(3)
        model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            config, attn_implementation="sdpa"
        )
    model.eval()
    model.requires_grad_(False)
    return model


@dataclass
class Kind:
    """A model, a cache laid out for it, and how one sequence runs alone."""

    name: str
    model: Any
    page_size: int
    vocab: int

    @property
    def hybrid(self) -> bool:
        return self.name == "gemma3"

    def config(self, **kw: Any) -> akv.CacheConfig:
        opts: dict[str, Any] = dict(
            page_size=self.page_size,
            device_pages=96,
            host_pages=0,
            host_memory_reserve_bytes=0,
            namespace=f"batched-{self.name}",
        )
        opts.update(kw)
        if self.name == "gpt2":
            return cache_config_for(self.model, **opts)
        if self.hybrid:
            return hybrid_cache_config(self.model, **opts)
        cfg = self.model.config
        return akv.CacheConfig(
            num_layers=cfg.num_hidden_layers,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            dtype=torch.float32,
            device="cpu",
            **opts,
        )

    def batch(self, cache: akv.HiCache, **kw: Any) -> PagedBatch:
        views = [cache.device_kv(j) for j in range(cache.config.num_layers)]
        swa = cache.sidecar("swa") if self.hybrid else None
        return PagedBatch(self.model, views, swa=swa, **kw)

    def alone(self, cache: akv.HiCache, rows: torch.Tensor, start: int, toks: list[int]) -> Any:
        """Run ``toks`` at ``start`` through the one-sequence adapter; its logits."""
        views = [cache.device_kv(j) for j in range(cache.config.num_layers)]
        if self.hybrid:
            layout = hybrid_layout(self.model)
            kv: Any = PagedHybridKV(
                layout, views, cache.sidecar("swa"), self.page_size, rows, start
            )
        else:
            kv = PagedKV(views, rows, start)
        return kv.forward(self.model, toks)


@pytest.fixture(scope="module", params=["gpt2", "llama", "qwen2", "mistral", "gemma3"])
def kind(request: pytest.FixtureRequest) -> Kind:
    name = request.param
    if name == "gpt2":  # its own instance: PagedBatch switches the model's attention
        return Kind(name, build_gpt2(SPEC), 8, SPEC.vocab_size)
    if name == "gemma3":
        spec = HybridSpec(seed=1)  # layers s f s s f s, window 10
        return Kind(name, build_gemma3(spec), 4, spec.vocab_size)
    return Kind(name, build_llama_family(name), 8, 1024)


@pytest.fixture(scope="module")
def gpt2_kind() -> Kind:
    return Kind("gpt2", build_gpt2(SPEC), 8, SPEC.vocab_size)


@pytest.fixture(scope="module")
def gemma_kind() -> Kind:
    spec = HybridSpec(seed=1)
    return Kind("gemma3", build_gemma3(spec), 4, spec.vocab_size)


def tokens(seed: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def pools(cache: akv.HiCache) -> list[torch.Tensor]:
    """Every device buffer the model writes: K and V per layer, and the sidecar."""
    out = [t for j in range(cache.config.num_layers) for t in cache.device_kv(j)]
    if cache.config.components:
        out.append(cache.sidecar("swa"))
    return out


def poison(cache: akv.HiCache) -> None:
    for t in pools(cache):
        t.fill_(float("nan"))


def snapshot(cache: akv.HiCache) -> list[torch.Tensor]:
    return [t.clone() for t in pools(cache)]


def restore(cache: akv.HiCache, saved: list[torch.Tensor]) -> None:
    for t, s in zip(pools(cache), saved, strict=True):
        t.copy_(s)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)  # NaN-safe bitwise comparison of float32 buffers


#: (cached prefix, new tokens): prefill chunks from 0 and after a prefix (page-aligned or
#: not), decodes over short and long contexts, a 1-token prompt
MIX = [(0, 13), (16, 9), (30, 1), (5, 1), (11, 7), (0, 1), (40, 1), (24, 3), (3, 12)]


async def fill(
    kind: Kind, cache: akv.HiCache, mix: list[tuple[int, int]], seed: int
) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Rows and tokens per sequence, with each cached prefix written by the one-sequence
    adapter."""
    rows, toks = [], []
    for i, (start, n) in enumerate(mix):
        r = cache.alloc(start + n + 2)
        t = tokens(seed + i, start + n, kind.vocab)
        if start:
            kind.alone(cache, r, 0, t[:start])
        rows.append(r)
        toks.append(t)
    return rows, toks


@pytest.mark.parametrize("pad", [None, True], ids=["per-sequence", "padded"])
async def test_mixed_batch_matches_each_sequence_alone(kind: Kind, pad: bool | None) -> None:
    async with akv.HiCache(kind.config()) as cache:
        poison(cache)
        rows, toks = await fill(kind, cache, MIX, seed=100)
        before = snapshot(cache)
        batch = kind.batch(cache, pad_decodes=pad)
        chunks = [SeqChunk(t[s:], r, s) for (s, _), r, t in zip(MIX, rows, toks, strict=True)]
        got = batch.forward(chunks)
        after = snapshot(cache)
        restore(cache, before)
        want = torch.stack([kind.alone(cache, c.rows, c.start, list(c.tokens)) for c in chunks])
        assert got.shape == (len(MIX), want.shape[-1])
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-5)
        for a, b in zip(after, pools(cache), strict=True):  # the same K/V written, same rows
            torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-5, equal_nan=True)
            assert torch.equal(a.isnan(), b.isnan())


async def test_rows_outside_the_step_are_untouched(kind: Kind) -> None:
    async with akv.HiCache(kind.config()) as cache:
        poison(cache)
        rows, toks = await fill(kind, cache, MIX, seed=200)
        others, _ = await fill(kind, cache, [(21, 1), (9, 4)], seed=300)  # not in the batch
        before = snapshot(cache)
        batch = kind.batch(cache)
        batch.forward([SeqChunk(t[s:], r, s) for (s, _), r, t in zip(MIX, rows, toks, strict=True)])
        written = torch.cat([r[s : s + n] for (s, n), r in zip(MIX, rows, strict=True)])
        p = kind.page_size
        for a, b in zip(before, pools(cache), strict=True):
            if a.dim() == 6:  # the sidecar, by page: [pages, layers, 2, page_size, ...]
                keep = torch.ones(a.shape[0], p, dtype=torch.bool)
                keep[written // p, written % p] = False
                a, b = a.transpose(1, 3)[keep], b.transpose(1, 3)[keep]
            else:
                keep = torch.ones(a.shape[0], dtype=torch.bool)
                keep[written] = False
                a, b = a[keep], b[keep]
            assert torch.equal(bits(a), bits(b))
        for r, (s, _) in zip(others, [(21, 1), (9, 4)], strict=True):
            assert not any(torch.isin(r[:s], written))


@dataclass
class Request:
    prompt: list[int]
    new: int
    joins: int  #: the step it arrives at
    rows: torch.Tensor | None = None
    filled: int = 0
    out: list[int] | None = None


def reference(model: Any, prompt: list[int], new: int) -> list[int]:
    from transformers import GenerationConfig

    ids = torch.tensor([prompt])
    gen = GenerationConfig(  # type: ignore[no-untyped-call]
        max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
    assert out.shape[1] == len(prompt) + new
    return [int(t) for t in out[0, len(prompt) :]]


#: (prompt length, new tokens, the step the request arrives at)
ARRIVALS = [(5, 6, 0), (17, 3, 0), (9, 8, 1), (30, 5, 2), (12, 7, 4), (1, 4, 6)]


@pytest.fixture(scope="module")
def expected(kind: Kind) -> list[list[int]]:
    """``generate``'s greedy tokens per request (computed outside the event loop)."""
    return [
        reference(kind.model, tokens(400 + i, n, kind.vocab), new)
        for i, (n, new, _) in enumerate(ARRIVALS)
    ]


async def test_greedy_generation_matches_transformers(
    kind: Kind, expected: list[list[int]]
) -> None:
    """Requests join at different steps, prefill in chunks of at most 8 tokens while others
    decode, and leave when done (their rows go to later requests)."""
    chunk = 8
    reqs = [
        Request(tokens(400 + i, n, kind.vocab), new, at) for i, (n, new, at) in enumerate(ARRIVALS)
    ]
    async with akv.HiCache(kind.config(device_pages=48)) as cache:
        poison(cache)
        batch = kind.batch(cache)
        step = 0
        while any(r.out is None or len(r.out) < r.new for r in reqs):
            live = [r for r in reqs if r.joins <= step and (r.out is None or len(r.out) < r.new)]
            work: list[SeqChunk] = []
            for r in live:
                if r.rows is None:
                    r.rows = cache.alloc(len(r.prompt) + r.new)
                if r.filled < len(r.prompt):
                    toks = r.prompt[r.filled : r.filled + chunk]
                else:
                    assert r.out is not None
                    toks = r.out[-1:]
                work.append(SeqChunk(toks, r.rows, r.filled))
            if work:
                logits = batch.forward(work)
                for r, c, lg in zip(live, work, logits, strict=True):
                    r.filled += len(c.tokens)
                    if r.filled >= len(r.prompt):
                        r.out = [*(r.out or []), int(lg.argmax())]
                        if len(r.out) == r.new:
                            assert r.rows is not None
                            cache.free(r.rows)
            step += 1
        assert step > 8  # the schedule really mixed chunks and decodes over several steps
        assert [r.out for r in reqs] == expected


def test_fallback_is_sdpa(kind: Kind) -> None:
    """Outside a step the switched model computes exactly as with ``"sdpa"``."""
    fresh = (
        build_gpt2(SPEC)
        if kind.name == "gpt2"
        else build_gemma3(HybridSpec(seed=1))
        if kind.hybrid
        else build_llama_family(kind.name)
    )
    cfg = kind.config()
    rows, shape = cfg.device_pages * cfg.page_size, (cfg.num_kv_heads, cfg.head_dim)
    views = [(torch.zeros(rows, *shape), torch.zeros(rows, *shape)) for _ in range(cfg.num_layers)]
    swa = None
    if kind.hybrid:
        (comp,) = cfg.components
        swa = torch.zeros(cfg.device_pages, *comp.page_shape)
    PagedBatch(kind.model, views, swa=swa)
    ids = torch.tensor([tokens(500, 23, kind.vocab)])
    with torch.no_grad():
        assert torch.equal(kind.model(ids).logits, fresh(ids).logits)


async def test_hybrid_reads_only_the_window(gemma_kind: Kind) -> None:
    """Sliding layers never read sidecar rows before the window (garbage from storage)."""
    kind = gemma_kind
    window = HybridSpec().sliding_window
    async with akv.HiCache(kind.config()) as cache:
        poison(cache)
        rows, toks = await fill(kind, cache, MIX, seed=600)
        swa = cache.sidecar("swa")
        saved = snapshot(cache)
        for r, (s, _) in zip(rows, MIX, strict=True):
            old = r[: max(0, s - window + 1)]  # before the window of every new query
            swa[old // 4, :, :, old % 4] = float("nan")
        chunks = [SeqChunk(t[s:], r, s) for (s, _), r, t in zip(MIX, rows, toks, strict=True)]
        got = kind.batch(cache).forward(chunks)
        restore(cache, saved)
        want = torch.stack([kind.alone(cache, c.rows, c.start, list(c.tokens)) for c in chunks])
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-5)


def refused(
    batch: PagedBatch, cache: akv.HiCache, error: type[Exception], match: str
) -> Callable[[list[SeqChunk]], None]:
    """Check that a step is refused with ``error`` and leaves every pool bit as it was."""

    def check(seqs: list[SeqChunk]) -> None:
        before = snapshot(cache)
        with pytest.raises(error, match=match):
            batch.forward(seqs)
        for a, b in zip(before, pools(cache), strict=True):
            assert torch.equal(bits(a), bits(b))

    return check


async def test_bad_input_is_refused_and_changes_nothing(gpt2_kind: Kind) -> None:
    kind = gpt2_kind
    async with akv.HiCache(kind.config()) as cache:
        poison(cache)
        rows, toks = await fill(kind, cache, [(8, 4), (3, 1)], seed=700)
        batch = kind.batch(cache)
        a, b = SeqChunk(toks[0][8:], rows[0], 8), SeqChunk(toks[1][3:], rows[1], 3)
        for error, match, seqs in [
            (akv.InvalidInputError, "non-empty", []),
            (akv.InvalidInputError, "sequence 1 has no tokens", [a, SeqChunk([], rows[1], 3)]),
            (akv.CapacityError, r"needs 18 KV rows \(start 15 \+ 3 tokens\), 8 were", [
                SeqChunk([1, 2, 3], rows[1], 15)
            ]),
            (akv.InvalidInputError, "start must be an int >= 0, got -1", [
                SeqChunk([1], rows[1], -1)
            ]),
            (akv.InvalidInputError, "start must be", [SeqChunk([1], rows[1], True)]),
            (akv.InvalidInputError, "past the model's 512", [
                SeqChunk([1, 2], torch.arange(520), 511)
            ]),
            (akv.InvalidInputError, "1-D int64, got 'torch.int32", [
                SeqChunk([1], rows[1].to(torch.int32), 3)
            ]),
            (akv.InvalidInputError, r"token 4096 outside the vocabulary \[0, 4096\)", [
                a, SeqChunk([4096], rows[1], 3)
            ]),
            (akv.InvalidTypeError, "token 1.0 is not an int", [SeqChunk([1.0], rows[1], 3)]),  # type: ignore[list-item]
            (akv.InvalidTypeError, "sequence 0 is a tuple", [(1, rows[1], 3)]),
            (akv.InvalidInputError, r"rows must be in \[0, 768\), got 900 .. 900", [
                SeqChunk([1], torch.tensor([0, 1, 2, 900]), 3)
            ]),
            (akv.InvalidInputError, "written twice", [a, SeqChunk([1], rows[0], 8)]),
            (akv.InvalidInputError, "also listed as cached", [
                a, SeqChunk([1], torch.cat([rows[0][8:9], rows[1][:1]]), 1)
            ]),
        ]:  # fmt: skip
            refused(batch, cache, error, match)(seqs)  # type: ignore[arg-type]
        assert torch.isfinite(batch.forward([a, b])).all()  # still usable


async def test_views_must_match_the_model(kind: Kind) -> None:
    async with akv.HiCache(kind.config()) as cache:
        views = [cache.device_kv(j) for j in range(cache.config.num_layers)]
        swa = cache.sidecar("swa") if kind.hybrid else None
        with pytest.raises(akv.ConfigError, match=r"pool views|swa given"):
            PagedBatch(kind.model, views[:-1], swa=swa)
        k, v = views[0]
        narrow = (k[:, :, :-1], v[:, :, :-1])
        with pytest.raises(akv.ConfigError, match=r"must be K and V of shape \[rows, "):
            PagedBatch(kind.model, [narrow, *views[1:]], swa=swa)
        with pytest.raises(akv.ConfigError, match="pad_decodes"):
            PagedBatch(kind.model, views, swa=swa, pad_decodes=1)  # type: ignore[arg-type]
        if kind.hybrid:
            assert swa is not None
            with pytest.raises(akv.ConfigError, match=r"needs swa=cache.sidecar\('swa'\)"):
                PagedBatch(kind.model, views)
            with pytest.raises(akv.ConfigError, match="swa pages must be"):
                PagedBatch(kind.model, views, swa=swa[:, :2])


def test_decode_groups_bound_their_padding() -> None:
    from aiocache_kv.models import batched_plan as bp

    assert bp._decode_groups([100] * 15 + [4000], pad=True) == [(0, 15), (15, 16)]
    assert bp._decode_groups([450 + 7 * i for i in range(16)], pad=True) == [(0, 16)]
    assert bp._decode_groups([5000] * 20, pad=True) == [(0, 13), (13, 20)]  # <= 65536 rows
    assert bp._decode_groups([5, 6, 9], pad=False) == [(0, 1), (1, 2), (2, 3)]


def test_a_window_the_model_does_not_use_is_refused() -> None:
    """A layout that disagrees with the model's attention stops the step with ConfigError."""
    model = build_llama_family("llama")
    model.config.sliding_window = 4  # the cache layout would window; Llama's attention does not
    views = [(torch.zeros(64, 2, 24), torch.zeros(64, 2, 24)) for _ in range(3)]
    batch = PagedBatch(model, views)
    with pytest.raises(akv.ConfigError, match="sliding_window=None, the cache layout expects 4"):
        batch.forward([SeqChunk([1, 2, 3], torch.arange(8), 0)])
