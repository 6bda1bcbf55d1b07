"""The engine restarts a request whose prefix was dropped under it (``PrefixDroppedError``).

A request runs over pages of the tree; an operator's ``drop`` of its prompt detaches them (the
request keeps reading them: they are freed once it lets go).  Its next insert onto them is
refused with ``PrefixDroppedError``: the engine gives its rows and pins back and admits it
again (it recomputes what is gone, its generated tokens stay), at most ``max_restarts`` times.
The tokens are exactly the model's own, nothing leaks, and the restart is counted.
"""

from __future__ import annotations

import asyncio
from contextlib import nullcontext
from typing import Any

import anyio
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import aiocache_kv as akv
from aiocache_kv.models import GPT2Spec, build_gpt2
from aiocache_kv.serving import Engine
from aiocache_kv.serving.metrics import EngineCollector
from aiocache_kv.testing import ManualCopyEngine
from tests.serving.test_engine import VOCAB, assert_nothing_held, config, reference, toks
from tests.test_cache import read_kv
from tests.test_prefix_dropped import spoil

PROMPT_LEN, NEW = 24, 16  # 6 pages of 4, then a page insert every 4 decodes


@pytest.fixture(scope="module")
def gpt2() -> Any:
    spec = GPT2Spec(n_layer=2, n_head=4, n_embd=64, vocab_size=VOCAB, n_positions=512, seed=3)
    return build_gpt2(spec)


async def _generate_with_a_drop(
    cache: akv.HiCache, eng: Engine, prompt: list[int], drop: list[int]
) -> tuple[akv.DropResult, list[int], Any]:
    """Stream ``prompt``; once its first token came (the prompt's pages are in the tree and
    the request's handle pins them), drop ``drop`` (zeroized); then read the rest."""
    ts = eng.open_stream(prompt, max_new_tokens=NEW)
    try:
        it = ts.tokens()
        got = [await it.__anext__()]
        assert cache.cached_len(prompt) == PROMPT_LEN
        res = await cache.drop(drop, zeroize=True)
        assert cache.cached_len(prompt) == len(drop) - 4  # the pages before the dropped one
        got += [t async for t in it]
        return res, got, await ts.result()
    finally:
        ts.close()


async def test_a_prefix_dropped_mid_request_restarts_it_identically(gpt2: Any) -> None:
    prompt = toks(70, PROMPT_LEN)
    async with akv.HiCache(config(gpt2)) as cache:
        async with Engine(gpt2, cache, max_batch_tokens=64, max_running=4) as eng:
            registry = CollectorRegistry()
            EngineCollector(eng, registry=registry)
            res, streamed, result = await _generate_with_a_drop(cache, eng, prompt, prompt[:4])
            assert res.deferred_nodes >= 1  # the running request still held the pages
            st = eng.statistics()
            eng.check_invariants()
            text = generate_latest(registry).decode()
        await cache.flush()
        assert_nothing_held(cache)
        cache.evict(1 << 20, "device")
        cache.evict(1 << 20, "host")
        final = cache.statistics()
        assert final.device.free_pages == final.device.total_pages, final.device
        assert final.device.quarantined_pages == 0
    assert st.restarts == 1 and result.restarts == 1
    assert st.finished == 1 and st.failed == st.aborted == 0
    assert result.tokens == streamed
    assert result.tokens == reference(gpt2, prompt, NEW)  # the model's own, uncached
    # and what a fresh cache, with no drop, generates
    async with (
        akv.HiCache(config(gpt2)) as fresh,
        Engine(gpt2, fresh, max_batch_tokens=64, max_running=4) as eng2,
    ):
        again = await eng2.generate(prompt, max_new_tokens=NEW)
        assert eng2.statistics().restarts == 0
    assert again.tokens == result.tokens and again.restarts == 0
    families = {f.name: f for f in text_string_to_metric_families(text)}
    [sample] = families["aiocache_kv_engine_restarts"].samples
    assert sample.value == 1


async def test_restarts_are_bounded_then_the_request_fails(gpt2: Any) -> None:
    prompt = toks(71, PROMPT_LEN)
    async with akv.HiCache(config(gpt2)) as cache:
        async with Engine(gpt2, cache, max_batch_tokens=64, max_running=4, max_restarts=0) as eng:
            with pytest.raises(akv.PrefixDroppedError) as info:
                await _generate_with_a_drop(cache, eng, prompt, prompt[:8])
            assert info.value.reason == "dropped" and info.value.tokens >= PROMPT_LEN
            st = eng.statistics()
            eng.check_invariants()
            # the engine serves on: the same prompt again is computed afresh, identically
            ok = await eng.generate(prompt, max_new_tokens=NEW)
        await cache.flush()
        assert_nothing_held(cache)
    assert st.restarts == 0 and st.failed == 1
    assert ok.tokens == reference(gpt2, prompt, NEW)


async def test_a_drop_of_another_prompt_restarts_nothing(gpt2: Any) -> None:
    prompt, other = toks(72, PROMPT_LEN), toks(73, PROMPT_LEN)
    async with akv.HiCache(config(gpt2)) as cache:
        async with Engine(gpt2, cache, max_batch_tokens=64, max_running=4) as eng:
            await eng.generate(other, max_new_tokens=2)
            res, _, result = await _generate_with_a_drop_of(cache, eng, prompt, other)
            assert res.nodes >= 1  # (deferred while its write-through copy is in flight)
            st = eng.statistics()
        assert_nothing_held(cache)
    assert st.restarts == 0 and result.tokens == reference(gpt2, prompt, NEW)


async def _generate_with_a_drop_of(
    cache: akv.HiCache, eng: Engine, prompt: list[int], other: list[int]
) -> tuple[akv.DropResult, list[int], Any]:
    ts = eng.open_stream(prompt, max_new_tokens=NEW)
    try:
        it = ts.tokens()
        got = [await it.__anext__()]
        res = await cache.drop(other[:4])
        got += [t async for t in it]
        return res, got, await ts.result()
    finally:
        ts.close()


@pytest.mark.parametrize("bad", [-1, 1001, 1.0, True, None])
async def test_bad_max_restarts_is_a_config_error(gpt2: Any, bad: Any) -> None:
    async with akv.HiCache(config(gpt2)) as cache:
        with pytest.raises(akv.ConfigError, match="max_restarts"):
            Engine(gpt2, cache, max_restarts=bad)


# ------------------------------------------------------------------ a node loading back


class Gate:
    """Holds the engine's forward passes: each waits for a permit, so the test decides how
    many steps run between its own calls (no timing involved)."""

    def __init__(self, eng: Engine) -> None:
        runner = eng._runner
        assert runner is not None
        self.real = runner.step
        self.permits = asyncio.Semaphore(0)
        self.entered = 0
        self.arrived = asyncio.Event()
        self.open = False
        runner.step = self.step  # type: ignore[method-assign]

    async def step(self, *args: Any) -> Any:
        self.entered += 1
        self.arrived.set()
        if not self.open:
            await self.permits.acquire()
        return await self.real(*args)

    async def waiting(self, n: int) -> None:
        with anyio.fail_after(30):
            while self.entered < n:
                self.arrived.clear()
                await self.arrived.wait()

    async def run(self, n: int) -> None:
        """Let ``n`` steps run; return once the step loop waits before the next one (every
        insert of those steps is done)."""
        target = self.entered + n
        for _ in range(n):
            self.permits.release()
        await self.waiting(target)

    def release_all(self) -> None:
        self.open = True
        for _ in range(1000):
            self.permits.release()


async def _copier(ce: ManualCopyEngine) -> None:
    while True:
        ce.complete_all()
        await asyncio.sleep(0.001)


async def _kv_rows(gpt2: Any, tokens: list[int]) -> list[torch.Tensor]:
    """The KV the model computes for ``tokens`` (per layer K, V), from a cache of its own."""
    async with (
        akv.HiCache(config(gpt2)) as other,
        Engine(gpt2, other, max_batch_tokens=64, max_running=4) as eng,
    ):
        await eng.generate(tokens, max_new_tokens=1)
        m = other.match_prefix(tokens)
        assert m.device_len == len(tokens)
        kv = read_kv(other, m.device_indices)
        other.release(m)
        return kv


@pytest.mark.parametrize("load", ["lands", "corrupt", "load failed"])
async def test_an_insert_that_stopped_at_a_loading_node(gpt2: Any, load: str) -> None:
    """Another request loads back the very pages the running request is about to compute
    (cached by someone else, demoted to host): the request's insert stops at that node
    (``inserted_len`` short of its pages; its rows after it are retained), so its next insert
    must start there.  If the load lands, the request goes on; if the node fails its
    verification at load-back (a corrupt prefetched page) or its copy, the pages it leaned
    on left: it restarts, once, and its tokens are still the model's own."""
    prompt = toks(74, PROMPT_LEN)
    want = reference(gpt2, prompt, NEW)
    extra = prompt + want[:8]  # the two pages the request computes next
    kv = await _kv_rows(gpt2, extra)
    ce = ManualCopyEngine()
    copier = None
    async with akv.HiCache(config(gpt2), copy_engine=ce) as cache:
        async with Engine(gpt2, cache, max_batch_tokens=64, max_running=4) as eng:
            gate = Gate(eng)
            ts = eng.open_stream(prompt, max_new_tokens=NEW)
            try:
                await gate.waiting(1)
                await gate.run(1)  # the prefill: the prompt's pages go in, the first token
                tokens = ts.tokens()
                got = [await tokens.__anext__()]
                # someone else caches the next two pages, which are then demoted to host
                mp = cache.match_prefix(prompt)
                slots = cache.alloc(8)
                for layer in range(cache.config.num_layers):
                    k, v = cache.device_kv(layer)
                    k[slots] = kv[2 * layer][PROMPT_LEN:]
                    v[slots] = kv[2 * layer + 1][PROMPT_LEN:]
                r = cache.insert(extra, slots, prefix=mp)
                ce.complete_all()
                await cache.flush()
                cache.release(r)
                cache.release(mp)
                cache.evict(2, "device")
                mx = cache.match_prefix(extra)
                assert (mx.device_len, mx.host_len) == (PROMPT_LEN, 8)
                if load == "corrupt":  # as a Mooncake prefetch whose page fails its checksum
                    spoil(cache, extra)
                loading = asyncio.ensure_future(cache.load_back(mx))
                await asyncio.sleep(0)
                assert len(ce.pending) == 1
                h2d = ce.pending[0]
                await gate.run(8)  # decodes: inserts at 28 (splits the node) and 32 (short)
                assert ce.pending[0] is h2d
                ce.pending.remove(h2d)
                ce.pending.insert(0, h2d)
                if load == "load failed":
                    ce.fail(0)
                else:
                    ce.complete(0)
                with pytest.raises(akv.TransferError) if load == "load failed" else nullcontext():
                    await loading
                cache.release(mx)
                copier = asyncio.ensure_future(_copier(ce))
                gate.release_all()
                got += [t async for t in tokens]
                result = await ts.result()
                st = eng.statistics()
                eng.check_invariants()
            finally:
                ts.close()
                if copier is not None:
                    copier.cancel()
        await cache.flush()
        assert_nothing_held(cache)
    assert result.tokens == got == want
    assert st.failed == 0 and st.finished == 1
    assert st.restarts == result.restarts == (0 if load == "lands" else 1)
