"""The batched engine on a GPU: a real ``transformers`` model (random weights) on CUDA over a
cache whose device pool is on CUDA, with host and file-storage tiers.  Every reply equals the
model's own uncached greedy generation on the same device, wherever the prompt's KV came
from; the event loop makes no blocking call and no implicit CUDA sync (the autouse
detector); nothing leaks.  Run where a GPU exists."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

import aiocache_kv as akv
from aiocache_kv.models import GPT2Spec, build_gpt2, reference_generate
from aiocache_kv.models.llama import LlamaSpec, build_llama
from aiocache_kv.serving import Engine
from tests.serving.test_engine import VOCAB, assert_nothing_held, config, toks

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def model(request: pytest.FixtureRequest) -> Any:
    if request.param == "gpt2":
        spec = GPT2Spec(n_layer=2, n_head=4, n_embd=64, vocab_size=VOCAB, n_positions=512, seed=3)
        return build_gpt2(spec).to("cuda")
    spec_l = LlamaSpec(arch="llama", layers=2, vocab=VOCAB, max_positions=512, seed=4)
    return build_llama(spec_l).to("cuda")


async def _reference(model: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    """The model's own generations, off the loop (reading a CUDA token is a sync)."""

    def run() -> list[list[int]]:
        return [reference_generate(model, p, n).tokens for p in prompts]

    return await asyncio.to_thread(run)


async def test_the_engine_on_a_gpu_replies_as_the_model_does(model: Any, tmp_path: Path) -> None:
    system = toks(1, 40)
    firsts = [system + toks(10 + i, 5 + 3 * i) for i in range(6)]
    n = 6
    async with akv.HiCache(
        config(model, device="cuda", storage=akv.FileStorage(tmp_path))
    ) as cache:
        async with Engine(model, cache, max_batch_tokens=48, max_running=6) as eng:
            r1 = await asyncio.gather(*(eng.generate(p, max_new_tokens=n) for p in firsts))
            seconds = [
                p + r.tokens + toks(50 + i, 4)
                for i, (p, r) in enumerate(zip(firsts, r1, strict=True))
            ]
            r2 = await asyncio.gather(*(eng.generate(p, max_new_tokens=n) for p in seconds))
            assert all(r.attribution.device >= len(p) for r, p in zip(r2, firsts, strict=True)), [
                r.attribution for r in r2
            ]
            await cache.flush()
            cache.evict(1 << 20, "device")  # every page to host: the next turn loads back
            thirds = [
                p + r.tokens + toks(80 + i, 3)
                for i, (p, r) in enumerate(zip(seconds, r2, strict=True))
            ]
            r3 = await asyncio.gather(*(eng.generate(p, max_new_tokens=n) for p in thirds))
            assert all(r.attribution.host >= 40 for r in r3), [r.attribution for r in r3]
            st = eng.statistics()
            eng.check_invariants()
        await cache.flush()
        assert_nothing_held(cache)
    cfg = config(model, device="cuda", storage=akv.FileStorage(tmp_path))
    async with akv.HiCache(cfg) as cache:  # restarted: the KV comes from storage
        async with Engine(model, cache, max_batch_tokens=48, max_running=6) as eng:
            r4 = await asyncio.gather(*(eng.generate(p, max_new_tokens=n) for p in thirds))
        # the shared turns come back from storage (once each: the others then find them in
        # the host or device tier); nothing but the new tail is computed
        att = [r.attribution for r in r4]
        assert sum(a.storage for a in att) >= 40 + 6 * 16, att
        assert all(a.storage >= 16 and a.computed <= 4 for a in att), att
        assert_nothing_held(cache)
    assert st.batch_size.sum / st.steps > 1.5  # requests shared forward passes
    prompts = [*firsts, *seconds, *thirds, *thirds]
    want = await _reference(model, prompts, n)
    got = [r.tokens for r in (*r1, *r2, *r3, *r4)]
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a == b, f"request {i} differs from the model's own generation"
