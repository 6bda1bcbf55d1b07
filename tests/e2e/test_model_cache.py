"""A real model (random-weight GPT-2) whose KV lives in the cache: cached generation must be
token-identical to uncached generation, with logits allclose, whichever tier the prefix came
from (device, host after demotion, storage after eviction or on a restarted cache)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import aiocache_kv as akv
from aiocache_kv.models import CachedLM, Generation, cache_config_for, reference_generate
from aiocache_kv.models.paged import PagedKV
from tests.e2e.conftest import random_tokens

NEW = 6
ATOL = 5e-4


def config(model: Any, storage: akv.StorageBackend | None = None, **kw: Any) -> akv.CacheConfig:
    opts: dict[str, Any] = dict(
        page_size=8,
        device_pages=64,
        host_pages=128,
        host_memory_reserve_bytes=0,
        namespace="e2e",
        storage=storage,
        prefetch_policy="wait_complete",
        prefetch_threshold_tokens=0,
    )
    opts.update(kw)
    return cache_config_for(model, **opts)


def assert_same(model: Any, prompt: list[int], got: Generation) -> None:
    ref = reference_generate(model, prompt, NEW, keep_logits=True)
    assert got.tokens == ref.tokens
    assert got.logits is not None and ref.logits is not None
    torch.testing.assert_close(got.logits, ref.logits, atol=ATOL, rtol=1e-5)


async def test_cold_then_device_hit(gpt2: Any) -> None:
    system = random_tokens(1, 40)
    a, b = system + random_tokens(2, 13), system + random_tokens(3, 21)
    async with akv.HiCache(config(gpt2)) as cache:
        lm = CachedLM(gpt2, cache)
        g = await lm.generate(a, NEW, keep_logits=True)
        assert (g.hit_tokens, g.computed) == (0, len(a))
        assert_same(gpt2, a, g)
        g = await lm.generate(b, NEW, keep_logits=True)  # the system prompt's pages
        assert (g.hit_device, g.hit_host, g.hit_storage) == (40, 0, 0)
        assert g.computed == len(b) - 40
        assert_same(gpt2, b, g)
        # a new message after a: every whole page of a hits
        a2 = a + random_tokens(4, 5)
        g = await lm.generate(a2, NEW, keep_logits=True)
        assert g.hit_device == len(a) // 8 * 8
        assert_same(gpt2, a2, g)
        await cache.flush()
        cache.check_invariants()
        st = cache.statistics()
        assert st.device.held_pages == 0  # every slot was inserted or freed


async def test_conversation_reply_is_cached(gpt2: Any) -> None:
    prompt = random_tokens(5, 30)
    async with akv.HiCache(config(gpt2)) as cache:
        lm = CachedLM(gpt2, cache)
        g1 = await lm.generate(prompt, NEW)
        turn2 = prompt + g1.tokens + random_tokens(6, 9)
        g2 = await lm.generate(turn2, NEW, keep_logits=True)
        # prompt + reply minus its last token were inserted: every whole page of that hits
        assert g2.hit_device == (len(prompt) + NEW - 1) // 8 * 8
        assert_same(gpt2, turn2, g2)


async def test_fully_cached_aligned_prompt_recomputes_last_page(gpt2: Any) -> None:
    prompt = random_tokens(7, 32)  # 4 whole pages
    async with akv.HiCache(config(gpt2)) as cache:
        lm = CachedLM(gpt2, cache)
        await lm.generate(prompt, NEW)
        g = await lm.generate(prompt, NEW, keep_logits=True)
        assert g.hit_device == 32 and g.reused == 24 and g.computed == 8
        assert_same(gpt2, prompt, g)
        await cache.flush()
        cache.check_invariants()  # the recomputed duplicate page was freed by insert
        assert cache.statistics().device.held_pages == 0


async def test_from_host_after_demotion(gpt2: Any) -> None:
    prompt = random_tokens(8, 50)
    async with akv.HiCache(config(gpt2)) as cache:
        lm = CachedLM(gpt2, cache)
        await lm.generate(prompt, NEW)
        await cache.flush()
        assert cache.evict(cache.statistics().device.evictable_pages) > 0
        m = cache.match_prefix(prompt)
        assert m.device_len == 0 and m.host_len == 48
        cache.release(m)
        g = await lm.generate(prompt, NEW, keep_logits=True)
        assert (g.hit_device, g.hit_host, g.hit_storage) == (0, 48, 0)
        assert_same(gpt2, prompt, g)
        assert cache.statistics().load_back_done >= 1


async def test_from_storage_after_eviction_and_restart(gpt2: Any, tmp_path: Path) -> None:
    prompt = random_tokens(9, 70)
    async with akv.HiCache(config(gpt2, akv.FileStorage(tmp_path))) as cache:
        lm = CachedLM(gpt2, cache)
        await lm.generate(prompt, NEW)
        await cache.flush()  # backups to storage landed
        cache.evict(cache.statistics().device.evictable_pages)
        cache.evict(cache.statistics().host.evictable_pages, "host")
        g = await lm.generate(prompt, NEW, keep_logits=True)  # same cache, L1/L2 empty
        assert (g.hit_device, g.hit_host, g.hit_storage) == (0, 0, 64)
        assert_same(gpt2, prompt, g)
        await cache.flush()
    # a fresh cache (a restarted node) on the same directory: prefetch + load_back
    turn2 = prompt + random_tokens(10, 11)
    async with akv.HiCache(config(gpt2, akv.FileStorage(tmp_path))) as cache:
        lm = CachedLM(gpt2, cache)
        g = await lm.generate(turn2, NEW, keep_logits=True)
        assert (g.hit_device, g.hit_host) == (0, 0) and g.hit_storage >= 64
        assert g.computed == len(turn2) - g.hit_storage
        assert_same(gpt2, turn2, g)
        assert cache.statistics().prefetch_hit_tokens == g.hit_storage
        cache.check_invariants()


async def test_concurrent_requests_share_the_pool(gpt2: Any) -> None:
    system = random_tokens(11, 24)
    prompts = [system + random_tokens(20 + i, 5 + 7 * i) for i in range(4)]
    async with akv.HiCache(config(gpt2)) as cache:
        lm = CachedLM(gpt2, cache)
        await lm.generate(system, 1)
        gens = await asyncio.gather(*(lm.generate(p, NEW, keep_logits=True) for p in prompts))
        for p, g in zip(prompts, gens, strict=True):
            assert g.hit_device == 24
            assert_same(gpt2, p, g)
        await cache.flush()
        cache.check_invariants()
        assert cache.statistics().device.held_pages == 0


async def test_pool_too_small_leaks_nothing(gpt2: Any) -> None:
    async with akv.HiCache(config(gpt2, device_pages=4)) as cache:
        lm = CachedLM(gpt2, cache)
        with pytest.raises(akv.CapacityError):
            await lm.generate(random_tokens(12, 40), NEW)
        cache.check_invariants()
        st = cache.statistics()
        assert st.device.held_pages == 0 and st.device.free_pages == 4


@pytest.mark.parametrize("bad", [-1, 41, 1.0, True, "8"])
async def test_bad_prefetched_tokens_is_rejected(gpt2: Any, bad: object) -> None:
    async with akv.HiCache(config(gpt2)) as cache:
        lm = CachedLM(gpt2, cache)
        with pytest.raises(akv.InvalidInputError, match="prefetched_tokens"):
            await lm.generate(random_tokens(13, 40), NEW, prefetched_tokens=bad)  # type: ignore[arg-type]
        cache.check_invariants()
        assert cache.statistics().device.held_pages == 0


async def test_shape_mismatch_is_rejected(gpt2: Any) -> None:
    cfg = akv.CacheConfig(
        page_size=8, num_layers=2, num_kv_heads=4, head_dim=16, dtype=torch.float32,
        host_pages=0, host_memory_reserve_bytes=0,
    )  # fmt: skip
    async with akv.HiCache(cfg) as cache:
        with pytest.raises(akv.ConfigError, match="does not match"):
            CachedLM(gpt2, cache)
    with pytest.raises(akv.ConfigError, match="num_layers"):
        cache_config_for(gpt2, num_layers=7)


def test_paged_kv_rejects_bad_rows() -> None:
    k = torch.zeros(8, 2, 4)
    with pytest.raises(akv.InvalidInputError):
        PagedKV([(k, k)], torch.arange(4, dtype=torch.int32))
    with pytest.raises(akv.InvalidInputError):
        PagedKV([(k, k)], torch.arange(4), filled=5)


async def test_cancelled_generate_keeps_rows_until_the_forward_pass_ends(gpt2: Any) -> None:
    """Cancelling a request while its forward pass runs on the model thread must not free
    the rows the thread is writing: another request's load-back would get them and the
    abandoned pass would overwrite its KV.  The rows go back once the pass returns."""
    entered, gate = threading.Event(), threading.Event()
    pool = concurrent.futures.ThreadPoolExecutor(1)

    async def runner(fn: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(pool, fn)

    def stall(*_: Any) -> None:  # inside the forward pass, on the model thread
        entered.set()
        gate.wait(30)

    prompt = random_tokens(7, 30)
    hook = gpt2.register_forward_pre_hook(stall)
    try:
        async with akv.HiCache(config(gpt2)) as cache:
            lm = CachedLM(gpt2, cache, runner=runner)
            task = asyncio.create_task(lm.generate(prompt, NEW))
            assert await asyncio.to_thread(entered.wait, 30)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            stats = cache.statistics()
            assert stats.device.held_pages == 5, "rows under a running forward pass were freed"
            hook.remove()
            gate.set()
            for _ in range(400):
                await asyncio.sleep(0.005)
                if cache.statistics().device.held_pages == 0:
                    break
            stats = cache.statistics()
            assert stats.device.held_pages == 0 and stats.device.free_pages == 64
            cache.check_invariants()
            g = await lm.generate(prompt, NEW, keep_logits=True)  # the cache still serves
            assert_same(gpt2, prompt, g)
    finally:
        hook.remove()
        gate.set()
        pool.shutdown(wait=False)
