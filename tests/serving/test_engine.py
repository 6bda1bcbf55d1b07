"""The batched engine over a real cache and real ``transformers`` models (random weights):
every request's greedy tokens equal the model's own uncached generation, whatever the batch
mixes (prefill chunks and decodes), wherever the prompt's KV came from (device, host,
storage), under preemption, cancellation, a full pool, and prefixes shared while in flight;
nothing leaks (rows, pins, pages) and both the engine's and the cache's invariants hold."""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import aiocache_kv as akv
from aiocache_kv.metrics import CacheCollector
from aiocache_kv.models import GPT2Spec, build_gpt2, cache_config_for, reference_generate
from aiocache_kv.models.arch import is_hybrid
from aiocache_kv.models.hybrid import HybridSpec, build_gemma3, reference_generate_hybrid
from aiocache_kv.models.llama import LlamaSpec, build_llama
from aiocache_kv.serving import Engine, GenerationResult
from aiocache_kv.serving.metrics import EngineCollector

VOCAB = 2048


@pytest.fixture(scope="module", params=["gpt2", "llama", "qwen2", "gemma3"])
def model(request: pytest.FixtureRequest) -> Any:
    if request.param == "gpt2":
        spec = GPT2Spec(n_layer=2, n_head=4, n_embd=64, vocab_size=VOCAB, n_positions=512, seed=3)
        return build_gpt2(spec)
    if request.param == "gemma3":  # sliding-window layers in the swa sidecar, window 10
        return build_gemma3(HybridSpec(vocab_size=VOCAB, seed=5))
    return build_llama(
        LlamaSpec(arch=request.param, layers=2, vocab=VOCAB, max_positions=512, seed=4)
    )


@pytest.fixture(scope="module")
def gpt2() -> Any:
    spec = GPT2Spec(n_layer=2, n_head=4, n_embd=64, vocab_size=VOCAB, n_positions=512, seed=3)
    return build_gpt2(spec)


def toks(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def config(model: Any, **kw: Any) -> akv.CacheConfig:
    opts: dict[str, Any] = dict(
        page_size=4,
        device_pages=96,
        host_pages=192,
        host_memory_reserve_bytes=0,
        namespace="engine-test",
        prefetch_policy="wait_complete",
        prefetch_threshold_tokens=0,
    )
    opts.update(kw)
    return cache_config_for(model, **opts)


# Keyed by the model object itself (kept alive here), not its id: a module-scoped model torn
# down between parameters frees an id the next model can be given.
_REFS: dict[tuple[Any, tuple[int, ...], int], list[int]] = {}


def reference(model: Any, prompt: list[int], n: int) -> list[int]:
    key = (model, tuple(prompt), n)
    if key not in _REFS:
        ref = reference_generate_hybrid if is_hybrid(model) else reference_generate
        _REFS[key] = ref(model, prompt, n).tokens
    return _REFS[key]


def assert_identical(model: Any, prompts: list[list[int]], results: list[Any], n: int) -> None:
    for i, (p, r) in enumerate(zip(prompts, results, strict=True)):
        assert r.tokens == reference(model, p, n), f"request {i} differs from uncached"
        a = r.attribution
        assert a.cached + a.computed == len(p)


def assert_nothing_held(cache: akv.HiCache) -> None:
    st = cache.statistics()
    assert st.device.held_pages == 0, st.device
    assert st.device.protected_pages == 0 or st.ops_in_flight, st.device
    cache.check_invariants()


async def test_batches_mix_prefill_chunks_and_decodes(model: Any) -> None:
    """Eight requests of different lengths at once, a budget that chunks the prompts: every
    reply is the model's own, and steps ran several requests at once."""
    prompts = [toks(10 + i, 9 + 7 * i) for i in range(8)]
    async with akv.HiCache(config(model)) as cache:
        async with Engine(model, cache, max_batch_tokens=24, max_running=8) as eng:
            results = await asyncio.gather(*(eng.generate(p, max_new_tokens=7) for p in prompts))
            st = eng.statistics()
            eng.check_invariants()
        assert_nothing_held(cache)
    assert_identical(model, prompts, results, 7)
    assert st.finished == 8 and st.failed == st.aborted == 0
    assert st.batch_size.sum / st.steps > 2  # requests shared forward passes
    assert st.tokens_per_step.sum <= 24 * st.steps


async def test_eight_first_turns_share_a_system_prompt_in_flight(gpt2: Any) -> None:
    """Nobody has finished the shared system prompt when the others arrive: it is computed
    once and the others wait for its pages instead of computing them again."""
    system = toks(1, 64)
    prompts = [system + toks(100 + i, 6) for i in range(8)]
    async with akv.HiCache(config(gpt2)) as cache:
        async with Engine(gpt2, cache, max_batch_tokens=32, max_running=8) as eng:
            results = await asyncio.gather(*(eng.generate(p, max_new_tokens=4) for p in prompts))
            st = eng.statistics()
        assert_nothing_held(cache)
    assert_identical(gpt2, prompts, results, 4)
    computed = sum(r.attribution.computed for r in results)
    assert computed <= 64 + 8 * 10, computed  # the system prompt ran once, not 8 times
    assert st.shared_in_flight_tokens >= 7 * 60
    assert sum(r.shared_in_flight > 0 for r in results) == 7


async def test_hits_from_device_host_and_storage(model: Any, tmp_path: Path) -> None:
    """A second turn hits on device; after its pages are pushed to host it hits there; a
    restarted cache on the same directory serves it from storage; always identical."""
    gpt2 = model
    first = toks(2, 30)
    reply_len = 5
    async with akv.HiCache(config(gpt2, storage=akv.FileStorage(tmp_path))) as cache:
        async with Engine(gpt2, cache) as eng:
            r1 = await eng.generate(first, max_new_tokens=reply_len)
            second = first + r1.tokens + toks(3, 9)
            r2 = await eng.generate(second, max_new_tokens=reply_len)
            assert r2.attribution.device >= 32
            await cache.flush()  # the write-through copies landed: pages are evictable
            cache.evict(1 << 20, "device")  # everything to host
            third = second + r2.tokens + toks(4, 5)
            r3 = await eng.generate(third, max_new_tokens=reply_len)
            assert r3.attribution.host >= 40
        await cache.flush()
        assert_nothing_held(cache)
    async with akv.HiCache(config(gpt2, storage=akv.FileStorage(tmp_path))) as cache:
        async with Engine(gpt2, cache) as eng:
            r4 = await eng.generate(third, max_new_tokens=reply_len)
        assert_nothing_held(cache)
    assert r4.attribution.storage >= 40
    assert_identical(gpt2, [first, second, third, third], [r1, r2, r3, r4], reply_len)


async def test_a_short_pool_preempts_and_resumes_identically(gpt2: Any) -> None:
    """Long replies in a pool that cannot hold them all: the newest requests are preempted,
    keep their computed pages cached, resume by matching them, and still reply identically."""
    prompts = [toks(20 + i, 12) for i in range(6)]
    cfg = config(gpt2, device_pages=28, host_pages=96)
    async with akv.HiCache(cfg) as cache:
        async with Engine(gpt2, cache, max_batch_tokens=64, max_running=6) as eng:
            results = await asyncio.gather(*(eng.generate(p, max_new_tokens=24) for p in prompts))
            st = eng.statistics()
            eng.check_invariants()
        assert_nothing_held(cache)
    assert_identical(gpt2, prompts, results, 24)
    assert st.preemptions > 0
    assert sum(r.preemptions for r in results) == st.preemptions


async def test_requests_beyond_the_pool_wait_instead_of_failing(gpt2: Any) -> None:
    """Twelve requests whose prompts together need three times the pool: admission waits for
    room (holding nothing), every request completes, identically."""
    prompts = [toks(40 + i, 30) for i in range(12)]
    cfg = config(gpt2, device_pages=40, host_pages=128)
    async with akv.HiCache(cfg) as cache:
        async with Engine(gpt2, cache, max_batch_tokens=48, max_running=12) as eng:
            results = await asyncio.gather(*(eng.generate(p, max_new_tokens=5) for p in prompts))
        assert_nothing_held(cache)
    assert_identical(gpt2, prompts, results, 5)


async def test_stream_yields_the_tokens_and_an_early_break_aborts(gpt2: Any) -> None:
    prompt = toks(5, 20)
    async with akv.HiCache(config(gpt2)) as cache:
        async with Engine(gpt2, cache) as eng:
            streamed = [t async for t in eng.stream(prompt, max_new_tokens=6)]
            assert streamed == reference(gpt2, prompt, 6)
            async for _ in eng.stream(toks(6, 20), max_new_tokens=50):
                break
            await asyncio.sleep(0.05)
            st = eng.statistics()
            assert st.aborted == 1 and st.running == 0
            eng.check_invariants()
        assert_nothing_held(cache)


async def test_bad_input_is_a_typed_error_and_affects_nothing(gpt2: Any) -> None:
    async with akv.HiCache(config(gpt2)) as cache:
        async with Engine(gpt2, cache) as eng:
            ok = asyncio.create_task(eng.generate(toks(7, 10), max_new_tokens=5))
            with pytest.raises(akv.InvalidInputError):
                await eng.generate([], max_new_tokens=3)
            with pytest.raises(akv.InvalidInputError, match=str(VOCAB)):
                await eng.generate([1, 2, VOCAB + 5], max_new_tokens=3)
            with pytest.raises(akv.InvalidInputError):
                await eng.generate(toks(8, 500), max_new_tokens=20)  # past 512 positions
            with pytest.raises(akv.InvalidInputError, match="device pool"):
                await eng.generate(toks(9, 300), max_new_tokens=200)  # past 96 x 4 rows
            with pytest.raises(akv.InvalidInputError):
                await eng.generate([1, 2], max_new_tokens=0)
            with pytest.raises(akv.InvalidTypeError):
                await eng.generate([1, 2], max_new_tokens=2, tenant=3)  # type: ignore[arg-type]
            assert (await ok).tokens == reference(gpt2, toks(7, 10), 5)
            assert eng.statistics().submitted == 1
        with pytest.raises(akv.EngineClosedError):
            await eng.generate([1, 2, 3], max_new_tokens=2)
        assert_nothing_held(cache)


async def test_closing_fails_what_is_in_flight_and_gives_everything_back(gpt2: Any) -> None:
    async with akv.HiCache(config(gpt2)) as cache:
        eng = Engine(gpt2, cache)
        async with eng:
            tasks = [
                asyncio.create_task(eng.generate(toks(50 + i, 40), max_new_tokens=100))
                for i in range(4)
            ]
            await asyncio.sleep(0.1)
        for t in tasks:
            with pytest.raises(akv.EngineClosedError):
                await t
        assert_nothing_held(cache)


@pytest.mark.parametrize("seed", range(4))
async def test_seeded_stress_cancels_and_shares(gpt2: Any, seed: int) -> None:
    """Many concurrent requests over a few shared prefixes, a small pool, random
    cancellations and timeouts at random moments: every request that finishes is identical,
    the others end with their error, nothing leaks, invariants hold throughout."""
    rng = random.Random(seed)
    prefixes = [toks(1000 * seed + k, rng.randrange(4, 40)) for k in range(3)]
    cfg = config(gpt2, device_pages=48, host_pages=96)
    outcomes: list[tuple[list[int], int, GenerationResult | BaseException]] = []
    try:
        async with akv.HiCache(cfg) as cache:
            async with Engine(
                gpt2, cache, max_batch_tokens=rng.choice([16, 40]), max_running=8
            ) as eng:

                async def one(i: int) -> None:
                    prompt = rng.choice(prefixes) + toks(seed * 7919 + i, rng.randrange(1, 20))
                    n = rng.randrange(1, 12)
                    await asyncio.sleep(rng.random() * 0.05)
                    fate = rng.random()
                    try:
                        if fate < 0.2:
                            with anyio.move_on_after(rng.random() * 0.05):
                                await eng.generate(prompt, max_new_tokens=n)
                            return
                        res = await eng.generate(prompt, max_new_tokens=n)
                        outcomes.append((prompt, n, res))
                    except akv.KVCacheError as exc:
                        outcomes.append((prompt, n, exc))

                async def checker() -> None:
                    for _ in range(40):
                        eng.check_invariants()
                        await asyncio.sleep(0.005)

                await asyncio.gather(*(one(i) for i in range(24)), checker())
                eng.check_invariants()
            assert_nothing_held(cache)
    except BaseException:
        print(f"engine stress seed {seed} FAILED")
        raise
    done = [(p, n, r) for p, n, r in outcomes if isinstance(r, GenerationResult)]
    assert len(done) >= 10, outcomes
    for p, n, r in done:
        assert r.tokens == reference(gpt2, p, n), f"seed {seed}"


async def test_metrics_parse_with_prometheus_clients_own_parser(gpt2: Any) -> None:
    prompts = [toks(60 + i, 12) for i in range(3)]
    async with akv.HiCache(config(gpt2)) as cache, Engine(gpt2, cache) as eng:
        registry = CollectorRegistry()
        CacheCollector(cache, registry=registry, prompts=eng.counters.prompt_tokens)
        EngineCollector(eng, registry=registry)
        await asyncio.gather(*(eng.generate(p, max_new_tokens=3) for p in prompts))
        text = generate_latest(registry).decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    assert samples[("aiocache_kv_engine_requests_total", (("outcome", "finished"),))] == 3
    assert samples[("aiocache_kv_engine_generated_tokens_total", ())] == 9
    assert samples[("aiocache_kv_engine_ttft_seconds_count", ())] == 3
    assert samples[("aiocache_kv_engine_inter_token_seconds_count", ())] == 6
    assert samples[("aiocache_kv_prompt_tokens_total", (("source", "computed"),))] == 36


async def test_a_cached_prefix_does_not_make_requests_wait_for_each_other(gpt2: Any) -> None:
    """Four requests whose shared system prompt is already in the tree are admitted together:
    one pass per token, none counted as sharing in flight (a request being admitted is not
    computing pages the tree holds)."""
    system = toks(70, 64)
    async with akv.HiCache(config(gpt2)) as cache:
        async with Engine(gpt2, cache, max_running=16) as eng:
            await eng.generate(system + toks(71, 10), max_new_tokens=2)
            steps = eng.statistics().steps
            prompts = [system + toks(80 + i, 10) for i in range(4)]
            results = await asyncio.gather(*(eng.generate(p, max_new_tokens=4) for p in prompts))
            assert eng.statistics().steps - steps == 4
        assert_nothing_held(cache)
    assert [r.shared_in_flight for r in results] == [0, 0, 0, 0]
    assert all(r.attribution.device == 64 for r in results)
    assert_identical(gpt2, prompts, results, 4)


@pytest.mark.parametrize(
    "kw",
    [
        {"max_batch_tokens": 0},
        {"max_running": True},
        {"model_threads": 0},
        {"model_threads": 1.5},
        {"switch_interval": float("nan")},
        {"switch_interval": 0.0},
        {"switch_interval": 5.0},
    ],
)
async def test_bad_engine_options_are_config_errors(gpt2: Any, kw: dict[str, Any]) -> None:
    async with akv.HiCache(config(gpt2)) as cache:
        with pytest.raises(akv.ConfigError):
            Engine(gpt2, cache, **kw)


async def test_the_switch_interval_is_the_engines_only_while_it_runs(gpt2: Any) -> None:
    before = sys.getswitchinterval()
    async with (
        akv.HiCache(config(gpt2)) as cache,
        Engine(gpt2, cache, switch_interval=0.0007, model_threads=1) as eng,
    ):
        assert abs(sys.getswitchinterval() - 0.0007) < 1e-9
        got = await eng.generate(toks(90, 9), max_new_tokens=3)
        assert got.tokens == reference(gpt2, toks(90, 9), 3)
    assert sys.getswitchinterval() == before


async def test_an_engine_runs_once(gpt2: Any) -> None:
    async with akv.HiCache(config(gpt2)) as cache:
        eng = Engine(gpt2, cache)
        async with eng:
            with pytest.raises(akv.EngineClosedError):
                await eng.__aenter__()
        with pytest.raises(akv.EngineClosedError):
            async with eng:
                pass
        assert_nothing_held(cache)
