"""Every supported full-attention family over the cache: GPT-2 (learned positions) and the
Llama family - Llama, Qwen2, Mistral (rotary positions, grouped KV heads, a ``head_dim`` that is
not ``hidden / heads``), and Mistral with a sliding window served from the full pool.  Cached
generation must be token-identical to ``transformers``' own ``DynamicCache``, with logits
allclose, whether the prefix came from device, from host after eviction, or from storage on a
fresh cache.  Every pool starts poisoned with NaN, so a read of a row nobody wrote shows."""

from __future__ import annotations

import dataclasses
import random
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import aiocache_kv as akv
from aiocache_kv.models import (
    CachedLM,
    Generation,
    LlamaSpec,
    build_llama,
    cache_config_for,
    kv_shape,
    reference_generate,
)

NEW = 6
ATOL = 5e-4
P = 8
#: Llama-family specs (distinct seeds: Llama and Mistral with one seed have one set of weights)
SPECS = {
    "llama": LlamaSpec(arch="llama", seed=1),
    "qwen2": LlamaSpec(arch="qwen2", seed=2),
    "mistral": LlamaSpec(arch="mistral", seed=3),
    "mistral-swa": LlamaSpec(arch="mistral", sliding_window=12, seed=4),
}
ARCHS = ["gpt2", *SPECS]


@pytest.fixture(scope="module")
def built() -> dict[str, Any]:
    return {}


@pytest.fixture(params=ARCHS)
def model(request: pytest.FixtureRequest, built: dict[str, Any], gpt2: Any) -> Any:
    """One model per architecture, built once per module (outside any event loop)."""
    arch: str = request.param
    if arch == "gpt2":
        return gpt2
    if arch not in built:
        built[arch] = build_llama(SPECS[arch])
    return built[arch]


def vocab(model: Any) -> int:
    return int(model.config.vocab_size)


def tokens(model: Any, seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab(model)) for _ in range(n)]


def config(model: Any, path: Path | None = None, **kw: Any) -> akv.CacheConfig:
    opts: dict[str, Any] = dict(
        page_size=P,
        device_pages=64,
        host_pages=128,
        host_memory_reserve_bytes=0,
        namespace=f"families-{model.config.model_type}",
        storage=akv.FileStorage(path) if path is not None else None,
        prefetch_policy="wait_complete",
        prefetch_threshold_tokens=0,
    )
    opts.update(kw)
    return cache_config_for(model, **opts)


def poison(cache: akv.HiCache) -> None:
    """NaN in every device row: a row read before it was written shows in the logits."""
    for layer in range(cache.config.num_layers):
        for t in cache.device_kv(layer):
            t.fill_(float("nan"))


def assert_same(model: Any, prompt: list[int], got: Generation) -> None:
    ref = reference_generate(model, prompt, NEW, keep_logits=True)
    assert got.logits is not None and ref.logits is not None
    assert torch.isfinite(got.logits).all()
    assert got.tokens == ref.tokens
    torch.testing.assert_close(got.logits, ref.logits, atol=ATOL, rtol=1e-5)


def test_llama_family_shapes() -> None:
    """The defaults exercise what GPT-2 does not: grouped KV heads, head_dim != hidden/heads."""
    spec = SPECS["llama"]
    assert spec.kv_heads < spec.heads and spec.head_dim * spec.heads != spec.hidden


async def test_device_hits_with_shared_prefixes(model: Any) -> None:
    system = tokens(model, 1, 40)
    prompts = [system + tokens(model, 2, 13), system + tokens(model, 3, 21)]
    prompts.append(prompts[0] + tokens(model, 4, 9))  # a new turn after the first prompt
    async with akv.HiCache(config(model)) as cache:
        poison(cache)
        lm = CachedLM(model, cache)
        g = await lm.generate(prompts[0], NEW, keep_logits=True)
        assert (g.hit_tokens, g.computed) == (0, len(prompts[0]))
        assert_same(model, prompts[0], g)
        g = await lm.generate(prompts[1], NEW, keep_logits=True)  # the system prompt's pages
        assert (g.hit_device, g.hit_host, g.hit_storage) == (40, 0, 0)
        assert g.computed == len(prompts[1]) - 40
        assert_same(model, prompts[1], g)
        g = await lm.generate(prompts[2], NEW, keep_logits=True)
        assert g.hit_device == len(prompts[0]) // P * P
        assert_same(model, prompts[2], g)
        await cache.flush()
        cache.check_invariants()
        assert cache.statistics().device.held_pages == 0


async def test_host_hit_after_eviction(model: Any) -> None:
    prompt = tokens(model, 5, 50)
    async with akv.HiCache(config(model)) as cache:
        lm = CachedLM(model, cache)
        await lm.generate(prompt, NEW)
        await cache.flush()
        assert cache.evict(cache.statistics().device.evictable_pages) > 0
        poison(cache)
        g = await lm.generate(prompt, NEW, keep_logits=True)
        assert (g.hit_device, g.hit_host, g.hit_storage) == (0, 48, 0)
        assert_same(model, prompt, g)
        assert cache.statistics().load_back_done >= 1
        cache.check_invariants()


async def test_storage_hit_on_a_fresh_cache(model: Any, tmp_path: Path) -> None:
    prompt = tokens(model, 6, 70)
    async with akv.HiCache(config(model, tmp_path)) as cache:
        await CachedLM(model, cache).generate(prompt, NEW)
        await cache.flush()  # the backups to storage landed
    turn2 = prompt + tokens(model, 7, 11)
    async with akv.HiCache(config(model, tmp_path)) as cache:  # a restarted node
        poison(cache)
        lm = CachedLM(model, cache)
        g = await lm.generate(turn2, NEW, keep_logits=True)
        assert (g.hit_device, g.hit_host) == (0, 0) and g.hit_storage >= 64
        assert g.computed == len(turn2) - g.hit_storage
        assert_same(model, turn2, g)
        assert cache.statistics().prefetch_hit_tokens == g.hit_storage
        cache.check_invariants()


def test_cache_config_matches_the_model(model: Any) -> None:
    cfg = config(model)
    shape = kv_shape(model)
    text = model.config
    assert cfg.num_layers == shape.num_layers == text.num_hidden_layers
    assert cfg.num_kv_heads == shape.num_kv_heads
    assert cfg.head_dim == shape.head_dim
    assert cfg.dtype == shape.dtype == torch.float32
    assert cfg.components == ()
    if text.model_type != "gpt2":
        assert (cfg.num_kv_heads, cfg.head_dim) == (text.num_key_value_heads, text.head_dim)


async def test_out_of_vocabulary_token_changes_nothing(model: Any) -> None:
    v = vocab(model)
    prompt = tokens(model, 8, 30)
    async with akv.HiCache(config(model)) as cache:
        lm = CachedLM(model, cache)
        await lm.generate(prompt, NEW)
        await cache.flush()
        before, counted = cache.statistics(), dataclasses.asdict(lm.prompt_tokens)
        for bad in (v, v + 1000, -1):
            with pytest.raises(akv.InvalidInputError, match=re.escape(f"{bad} at")):
                await lm.generate([*prompt, bad], NEW)
            with pytest.raises(akv.InvalidInputError):
                reference_generate(model, [*prompt, bad], NEW)
        with pytest.raises(akv.InvalidInputError, match=rf"token id {v} at position 30 .*{v} ids"):
            await lm.generate([*prompt, v], NEW)
        cache.check_invariants()
        assert cache.statistics() == before
        assert dataclasses.asdict(lm.prompt_tokens) == counted


async def test_too_long_request_changes_nothing(model: Any) -> None:
    limit = int(model.config.max_position_embeddings)
    prompt = tokens(model, 9, limit - 2)
    async with akv.HiCache(config(model)) as cache:
        lm = CachedLM(model, cache)
        before = cache.statistics()
        with pytest.raises(akv.InvalidInputError, match=rf"exceeds the model's {limit} positions"):
            await lm.generate(prompt, 3)
        with pytest.raises(akv.InvalidInputError, match="positions"):
            reference_generate(model, prompt, 3)
        cache.check_invariants()
        assert cache.statistics() == before
