"""A hybrid model (random-weight Gemma 3 text: sliding-window and full-attention layers) whose
full-attention KV lives in the cache's pool and whose sliding-window KV lives in the ``swa``
sidecar: cached generation must be token-identical to uncached generation (``transformers``' own
``DynamicCache``), with logits allclose, whether the prefix comes from device, from host or from
storage - also when storage lost SWA pages (before the window: the full prefix is still used; in
the window: a shorter prefix is used, never a wrong one).

Every pool starts poisoned with NaN, so any read of a row the model did not write (or of an SWA
page that storage did not have) would show up as NaN logits.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest
import torch

import aiocache_kv as akv
from aiocache_kv.models import (
    Generation,
    HybridLM,
    HybridSpec,
    build_gemma3,
    hybrid_cache_config,
    hybrid_layout,
    reference_generate_hybrid,
)
from aiocache_kv.models.hybrid import PagedHybridKV, swa_component
from aiocache_kv.storage import FileStorage, storage_key
from aiocache_kv.storage.key_layout import key_component
from aiocache_kv.tree.hashing import chain_hashes, namespace_seed

SPEC = HybridSpec(seed=1)  # layers s f s s f s, window 10
P = 4  # page size: the window needs ceil(10 / 4) = 3 pages
NEW = 6
ATOL = 5e-4
NS = "hybrid-e2e"


@pytest.fixture(scope="module")
def gemma() -> Any:
    return build_gemma3(SPEC)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(SPEC.vocab_size) for _ in range(n)]


def config(model: Any, path: Path | None = None, **kw: Any) -> akv.CacheConfig:
    opts: dict[str, Any] = dict(
        page_size=P,
        device_pages=48,
        host_pages=48,
        host_memory_reserve_bytes=0,
        namespace=NS,
        storage=FileStorage(path) if path is not None else None,
        prefetch_policy="wait_complete",
        prefetch_threshold_tokens=0,
    )
    opts.update(kw)
    return hybrid_cache_config(model, **opts)


def assert_same(model: Any, prompt: list[int], got: Generation) -> None:
    ref = reference_generate_hybrid(model, prompt, NEW, keep_logits=True)
    assert got.logits is not None and ref.logits is not None
    assert torch.isfinite(got.logits).all()
    assert got.tokens == ref.tokens
    torch.testing.assert_close(got.logits, ref.logits, atol=ATOL, rtol=1e-5)


def poison_device(cache: akv.HiCache) -> None:
    """NaN in every device row of the KV pool and the sidecar."""
    cache.sidecar("swa").fill_(float("nan"))
    for j in range(cache.config.num_layers):
        for t in cache.device_kv(j):
            t.fill_(float("nan"))


async def poison_host(cache: akv.HiCache) -> None:
    """NaN in every host page of every pool (through the public API: NaN device pages are
    written through to host, then evicted; the freed host pages keep the NaN bytes)."""
    cfg = cache.config
    poison_device(cache)
    left, base = cfg.host_pages, 1 << 40  # junk tokens never collide with real ones
    while left:
        n = min(left, cfg.device_pages)
        slots = cache.alloc(n * P)
        r = cache.insert(list(range(base, base + n * P)), slots, tenant="junk")
        assert r.write_through is not None
        await r.write_through
        cache.release(r)
        cache.evict(n)
        left -= n
        base += n * P
    await cache.flush()
    cache.evict(cfg.host_pages, "host")
    st = cache.statistics()
    assert st.host.free_pages == cfg.host_pages and st.device.free_pages == cfg.device_pages
    poison_device(cache)


def test_layout_and_config(gemma: Any) -> None:
    layout = hybrid_layout(gemma)
    assert layout.full == (1, 4) and layout.sliding == (0, 2, 3, 5) and layout.window == 10
    cfg = config(gemma)
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) == (2, 2, 16)
    (swa,) = cfg.components
    assert swa.name == "swa" and swa.page_shape == (4, 2, P, 2, 16)
    assert swa.hit_policy is akv.HitPolicy.TRAILING_PAGES and swa.window_pages(P) == 3
    with pytest.raises(akv.ConfigError, match="num_layers"):
        config(gemma, num_layers=6)
    with pytest.raises(akv.ConfigError, match="components"):
        config(gemma, components=())


async def test_cache_must_match_the_model(gemma: Any) -> None:
    layout = hybrid_layout(gemma)
    base = dict(
        page_size=P, num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32,
        device_pages=8, host_pages=0, host_memory_reserve_bytes=0,
    )  # fmt: skip
    narrow = akv.SlidingWindow(
        4, num_layers=4, num_kv_heads=2, head_dim=16, page_size=P, dtype=torch.float32
    )
    for bad in (
        akv.CacheConfig(**base),  # type: ignore[arg-type]  # no sidecar
        akv.CacheConfig(**{**base, "components": (narrow,)}),  # type: ignore[arg-type]
        akv.CacheConfig(**{**base, "num_layers": 6}),  # type: ignore[arg-type]
    ):
        async with akv.HiCache(bad) as cache:
            with pytest.raises(akv.ConfigError):
                HybridLM(gemma, cache)
    good = akv.CacheConfig(**{**base, "components": (swa_component(layout, P),)})  # type: ignore[arg-type]
    async with akv.HiCache(good) as cache:
        HybridLM(gemma, cache)
    k = torch.zeros(8, 2, 16)
    with pytest.raises(akv.InvalidInputError, match="sidecar"):
        PagedHybridKV(layout, [(k, k)] * 2, torch.zeros(2, 4, 2, P, 2, 8), P, torch.arange(4))


async def test_device_hits(gemma: Any) -> None:
    system = tokens(1, 30)  # three windows long
    a, b = system + tokens(2, 9), system + tokens(3, 14)
    async with akv.HiCache(config(gemma)) as cache:
        poison_device(cache)
        lm = HybridLM(gemma, cache)
        ga = await lm.generate(a, NEW, keep_logits=True)
        assert (ga.hit_tokens, ga.computed) == (0, len(a))
        assert_same(gemma, a, ga)
        g = await lm.generate(b, NEW, keep_logits=True)  # the system prompt's pages
        assert (g.hit_device, g.reused) == (28, 28) and g.computed == len(b) - 28
        assert_same(gemma, b, g)
        turn2 = a + ga.tokens + tokens(4, 7)  # the reply was cached with the prompt
        g = await lm.generate(turn2, NEW, keep_logits=True)
        assert g.reused == g.hit_device == (len(a) + NEW - 1) // P * P
        assert_same(gemma, turn2, g)
        aligned = tokens(5, 44)  # fully cached, aligned: the last page is recomputed
        await lm.generate(aligned, NEW)
        g = await lm.generate(aligned, NEW, keep_logits=True)
        assert g.reused == 40 and g.computed == 4
        assert_same(gemma, aligned, g)
        short = tokens(14, 3)  # shorter than a page: nothing to match
        g = await lm.generate(short, NEW, keep_logits=True)
        assert g.reused == 0
        assert_same(gemma, short, g)
        await cache.flush()
        cache.check_invariants()
        assert cache.statistics().device.held_pages == 0


async def test_concurrent_requests_share_the_pools(gemma: Any) -> None:
    system = tokens(15, 24)
    prompts = [system + tokens(20 + i, 5 + 7 * i) for i in range(3)]
    async with akv.HiCache(config(gemma)) as cache:
        poison_device(cache)
        lm = HybridLM(gemma, cache)
        await lm.generate(system + tokens(19, 1), 1)
        gens = await asyncio.gather(*(lm.generate(p, NEW, keep_logits=True) for p in prompts))
        for p, g in zip(prompts, gens, strict=True):
            assert g.reused == 24
            assert_same(gemma, p, g)
        await cache.flush()
        cache.check_invariants()
        assert cache.statistics().device.held_pages == 0


async def test_only_the_window_is_read_from_the_sidecar(gemma: Any) -> None:
    prompt = tokens(6, 40)  # 10 pages; a request reusing all 10 reads SWA pages 7-9 only
    nxt = prompt + tokens(7, 5)
    async with akv.HiCache(config(gemma)) as cache:
        poison_device(cache)
        lm = HybridLM(gemma, cache)
        await lm.generate(prompt, NEW)
        m = cache.match_prefix(prompt)
        pages = m.device_pages
        cache.release(m)
        assert pages.numel() == 10
        swa = cache.sidecar("swa")
        assert torch.isfinite(swa[pages]).all()
        swa[pages[:7]] = float("nan")  # before the window: never gathered
        g = await lm.generate(nxt, NEW, keep_logits=True)
        assert g.reused == 40
        assert_same(gemma, nxt, g)
        swa[pages[7]] = float("nan")  # inside the window: the sidecar is what attention reads
        g = await lm.generate(prompt + tokens(13, 5), NEW, keep_logits=True)
        assert g.reused == 40 and g.logits is not None and torch.isnan(g.logits).all()


async def test_from_host_after_demotion(gemma: Any) -> None:
    prompt = tokens(8, 50)
    async with akv.HiCache(config(gemma)) as cache:
        poison_device(cache)
        lm = HybridLM(gemma, cache)
        await lm.generate(prompt, NEW)
        await cache.flush()
        assert cache.evict(cache.statistics().device.evictable_pages) > 0
        poison_device(cache)  # whatever is reused must come back from host
        g = await lm.generate(prompt, NEW, keep_logits=True)
        assert (g.hit_device, g.hit_host, g.hit_storage) == (0, 48, 0) and g.reused == 48
        assert_same(gemma, prompt, g)
        assert cache.statistics().load_back_done >= 1
        cache.check_invariants()


async def test_from_storage(gemma: Any, tmp_path: Path) -> None:
    prompt = tokens(9, 47)
    async with akv.HiCache(config(gemma, tmp_path)) as cache:
        lm = HybridLM(gemma, cache)
        await lm.generate(prompt, NEW)
        await cache.flush()  # backups to storage landed
        cache.evict(cache.statistics().device.evictable_pages)
        cache.evict(cache.statistics().host.evictable_pages, "host")
        poison_device(cache)
        g = await lm.generate(prompt, NEW, keep_logits=True)  # same cache, L1/L2 empty
        assert (g.hit_device, g.hit_host, g.hit_storage) == (0, 0, 44) and g.reused == 44
        assert_same(gemma, prompt, g)
        await cache.flush()
    turn2 = prompt + g.tokens + tokens(10, 5)  # a restarted node: prefetch + load_back
    async with akv.HiCache(config(gemma, tmp_path)) as cache:
        await poison_host(cache)
        lm = HybridLM(gemma, cache)
        g = await lm.generate(turn2, NEW, keep_logits=True)
        assert (g.hit_device, g.hit_host) == (0, 0) and g.hit_storage == g.reused == 52
        assert_same(gemma, turn2, g)
        st = cache.statistics()
        assert st.prefetch_hit_tokens == 52 and st.load_back_done >= 1
        cache.check_invariants()


PROMPT = tokens(11, 48)  # 12 pages; stored with the reply: 13 pages


async def stored(path: Path, model: Any) -> None:
    async with akv.HiCache(config(model, path)) as cache:
        await HybridLM(model, cache).generate(PROMPT, NEW)
        await cache.flush()
        assert cache.statistics().backup_pages_ok == 13


async def drop_swa(path: Path, model: Any, pages: list[int]) -> None:
    """Remove the SWA part of prompt pages ``pages`` from the storage directory."""
    tag = akv.Namespace(NS).tag
    hashes = chain_hashes(namespace_seed(tag), PROMPT, P)
    swa = key_component(config(model), "swa")
    keys = [storage_key(tag, hashes[i], swa) for i in pages]
    store = FileStorage(path)
    assert all(await asyncio.to_thread(store.remove, keys))
    await asyncio.to_thread(store.close)


def usable(dropped: set[int], pages: int, window: int = 3) -> int:
    """The longest prefix (pages) whose last ``window`` SWA pages are all present."""
    for end in range(pages, 0, -1):
        if not any(i in dropped for i in range(max(0, end - window), end)):
            return end
    return 0


@pytest.mark.parametrize(
    ("dropped", "extra"),
    [
        ([0, 1, 2, 3, 4, 5], 3),  # early pages: the whole prefix is still usable
        ([11], 3),  # the last page's SWA: end before it, where the window is whole
        ([5, 9], 3),  # holes inside: the largest end with a whole window
        # the prompt is the 12 stored pages exactly: its last page is recomputed, so the
        # reuse ends at page 11, whose window (pages 8-10) has a hole; ending at 12 (window
        # 9-11 whole) and cutting one page would attend NaN: the end must be checked itself
        ([8], 0),
    ],
)
async def test_from_storage_with_missing_swa_pages(
    gemma: Any, tmp_path: Path, dropped: list[int], extra: int
) -> None:
    await stored(tmp_path, gemma)
    await drop_swa(tmp_path, gemma, dropped)
    prompt = [*PROMPT, *tokens(12, extra)]
    want = usable(set(dropped), (len(prompt) - 1) // P) * P
    assert want > 0
    async with akv.HiCache(config(gemma, tmp_path)) as cache:
        await poison_host(cache)  # a missing SWA page comes back as NaN bytes
        lm = HybridLM(gemma, cache)
        g = await lm.generate(prompt, NEW, keep_logits=True)
        assert g.hit_storage == g.reused == want, (g.hit_storage, g.reused, want)
        assert_same(gemma, prompt, g)
        m = cache.match_prefix(PROMPT[:want])
        assert m.device_len == want
        swa = cache.sidecar("swa")[m.device_pages]
        holes = [i for i in dropped if i < want // P]
        assert torch.isnan(swa[holes]).all()  # the garbage was right there, never attended
        assert torch.isfinite(swa[want // P - 3 :]).all()
        cache.release(m)
        await cache.flush()
        cache.check_invariants()
        assert cache.statistics().device.held_pages == 0
