"""The model dispatch (``aiocache_kv.models.arch``): a ``CacheConfig`` for every supported
``model_type``, a ``ConfigError`` naming an unsupported one, and the input checks against the
model (vocabulary, positions) before anything runs."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import aiocache_kv as akv
from aiocache_kv.models import (
    SUPPORTED_MODEL_TYPES,
    HybridLM,
    HybridSpec,
    LlamaSpec,
    build_gemma3,
    build_llama,
    cache_config_for,
    check_token_ids,
    hybrid_cache_config,
    kv_shape,
    max_positions,
    model_type,
    vocab_size,
)
from aiocache_kv.models import gpt2 as gpt2_module
from aiocache_kv.models.arch import check_request
from aiocache_kv.models.generate import CachedLM

OPTS: dict[str, Any] = dict(page_size=4, device_pages=32, host_pages=0, host_memory_reserve_bytes=0)


@pytest.fixture(scope="module")
def llamas() -> dict[str, Any]:
    return {
        a: build_llama(LlamaSpec(arch=a, layers=2, seed=5)) for a in ("llama", "qwen2", "mistral")
    }


@pytest.fixture(scope="module")
def gemma() -> Any:
    return build_gemma3(HybridSpec(seed=2))


@pytest.fixture(scope="module")
def bert() -> Any:
    from transformers import BertConfig, BertModel

    cfg = BertConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        vocab_size=100,
    )  # fmt: skip
    return BertModel(cfg)


def test_supported_types() -> None:
    assert set(SUPPORTED_MODEL_TYPES) == {"gpt2", "llama", "mistral", "qwen2", "gemma3_text"}


def test_gpt2(gpt2: Any) -> None:
    cfg = cache_config_for(gpt2, **OPTS)
    c = gpt2.config
    assert model_type(gpt2) == "gpt2"
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) == (c.n_layer, c.n_head, 64 // 4)
    # the old names in models.gpt2 are the dispatch's
    assert gpt2_module.cache_config_for(gpt2, **OPTS) == cfg
    assert gpt2_module.kv_shape(gpt2) == kv_shape(gpt2)
    assert max_positions(gpt2) == c.n_positions
    assert vocab_size(gpt2) == c.vocab_size


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_llama_family(llamas: dict[str, Any], arch: str) -> None:
    model = llamas[arch]
    cfg = cache_config_for(model, **OPTS)
    assert model_type(model) == arch
    # grouped KV heads, head_dim from the config (32), not hidden / heads (96 / 4 = 24)
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) == (2, 2, 32)
    assert cfg.dtype == torch.float32 and cfg.components == ()
    assert kv_shape(model).num_kv_heads == 2
    assert max_positions(model) == 512 and vocab_size(model) == 1000
    with pytest.raises(akv.ConfigError, match="num_kv_heads=4 does not match"):
        cache_config_for(model, num_kv_heads=4, **OPTS)


def test_gemma3_dispatches_to_the_hybrid_layout(gemma: Any) -> None:
    cfg = cache_config_for(gemma, **OPTS)
    assert cfg == hybrid_cache_config(gemma, **OPTS)
    assert model_type(gemma) == "gemma3_text"
    assert cfg.num_layers == 2  # the full-attention layers; the sliding ones are in "swa"
    assert [c.name for c in cfg.components] == ["swa"]
    assert kv_shape(gemma).num_layers == 2


def test_unsupported_model_is_a_config_error(bert: Any) -> None:
    made_up = SimpleNamespace(config=SimpleNamespace(model_type="made-up-lm"))
    for model, kind in ((bert, "'bert'"), (made_up, "'made-up-lm'")):
        for fn in (cache_config_for, kv_shape, model_type):
            with pytest.raises(akv.ConfigError, match=kind) as info:
                fn(model)
            assert "gpt2, llama, mistral, qwen2, gemma3_text" in str(info.value)
    with pytest.raises(akv.ConfigError, match="no config"):
        cache_config_for(object())


async def test_cached_lm_refuses_unsupported_and_hybrid_models(
    bert: Any, gemma: Any, gpt2: Any
) -> None:
    async with akv.HiCache(cache_config_for(gpt2, **OPTS)) as cache:
        with pytest.raises(akv.ConfigError, match="'bert'"):
            CachedLM(bert, cache)
    async with akv.HiCache(cache_config_for(gemma, **OPTS)) as cache:
        with pytest.raises(akv.ConfigError, match="HybridLM"):
            CachedLM(gemma, cache)
        HybridLM(gemma, cache)  # the right one


def test_check_token_ids(gpt2: Any) -> None:
    v = gpt2.config.vocab_size
    assert check_token_ids(gpt2, [0, v - 1]) == [0, v - 1]
    assert check_token_ids(gpt2, torch.tensor([3, 4])) == [3, 4]
    toks = [1, 2]
    assert check_token_ids(gpt2, toks) is not toks  # a copy: the caller's list stays theirs
    with pytest.raises(akv.InvalidInputError, match=f"token id {v} at position 1 .* {v} ids"):
        check_token_ids(gpt2, [0, v, v + 1])
    with pytest.raises(akv.InvalidInputError, match="empty"):
        check_token_ids(gpt2, [])
    with pytest.raises(akv.InvalidTypeError, match="ints"):
        check_token_ids(gpt2, [1, 2.0])  # type: ignore[list-item]
    with pytest.raises(akv.InvalidInputError, match=r"-3 at 0"):
        check_token_ids(gpt2, [-3])


def test_check_request(gpt2: Any) -> None:
    limit = gpt2.config.n_positions
    assert len(check_request(gpt2, [1] * (limit - 4), 4)) == limit - 4
    with pytest.raises(akv.InvalidInputError, match=f"exceeds the model's {limit} positions"):
        check_request(gpt2, [1] * (limit - 4), 5)
    for bad in (0, -1, 1.0, True):
        with pytest.raises(akv.InvalidInputError, match="max_new_tokens"):
            check_request(gpt2, [1], bad)  # type: ignore[arg-type]


def test_missing_sizes_are_config_errors() -> None:
    cfg = SimpleNamespace(model_type="llama")
    model = SimpleNamespace(config=cfg)
    with pytest.raises(akv.ConfigError, match="max_position_embeddings"):
        max_positions(model)
    with pytest.raises(akv.ConfigError, match="vocabulary"):
        vocab_size(model)
    with pytest.raises(akv.ConfigError, match="llama config"):
        kv_shape(model)


async def test_hybrid_model_checks_the_vocabulary_first(gemma: Any) -> None:
    v = gemma.config.vocab_size
    prompt = [random.Random(3).randrange(v) for _ in range(20)]
    async with akv.HiCache(cache_config_for(gemma, **OPTS)) as cache:
        lm = HybridLM(gemma, cache)
        await lm.generate(prompt, 3)
        await cache.flush()
        before = cache.statistics()
        with pytest.raises(akv.InvalidInputError, match=f"token id {v} at position 20"):
            await lm.generate([*prompt, v], 3)
        cache.check_invariants()
        assert cache.statistics() == before


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (LlamaSpec(arch="gpt-9"), "arch must be one of"),
        (LlamaSpec(heads=4, kv_heads=3), "multiple of kv_heads"),
        (LlamaSpec(head_dim=31), "head_dim must be even"),
        (LlamaSpec(layers=0), "layers must be a positive int"),
        (LlamaSpec(vocab=True), "vocab must be a positive int"),
        (LlamaSpec(arch="llama", sliding_window=8), "sliding_window is for"),
        (LlamaSpec(arch="mistral", sliding_window=0), "sliding_window must be"),
    ],
)
def test_build_llama_rejects_bad_specs(spec: LlamaSpec, match: str) -> None:
    with pytest.raises(akv.ConfigError, match=match):
        build_llama(spec)


def test_build_llama_is_seeded() -> None:
    a, b = (build_llama(LlamaSpec(arch="qwen2", layers=1, seed=7)) for _ in range(2))
    for x, y in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(x, y)
    assert LlamaSpec(arch="qwen2").name != LlamaSpec(arch="mistral").name


def test_model_without_parameters_is_a_config_error() -> None:
    cfg = SimpleNamespace(
        model_type="llama", num_hidden_layers=2, num_attention_heads=4, hidden_size=64
    )
    with pytest.raises(akv.ConfigError, match="no parameters"):
        kv_shape(SimpleNamespace(config=cfg))
