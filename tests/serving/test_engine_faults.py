"""The engine under adversarial clients and operators (found by adversarial trials):

* a stream reader that stopped reading (``break`` out of ``tokens()``) made the next token's
  send raise inside the step loop: every request failed and the engine's task group died;
* a big request that fits the pool alone was starved for good by a steady stream of small
  ones, each grabbing the rows given back before the big one fit;
* a request that fits alone failed with ``CapacityError`` while a zeroizing drop's pages were
  held by the zeroing worker for a few milliseconds;
* requests of other tenants (or LoRAs) with the same tokens waited for each other's prefill,
  though namespaces never share pages;
* a request that fits alone failed with ``CapacityError`` while an aborted request's
  admission still held its prefetch's pins, or when its prompt of whole pages was cached
  (the last page held twice).

Every reply is checked against the model's own uncached greedy generation.
"""

from __future__ import annotations

import asyncio
import gc
import random
import threading
import types
from typing import Any

import anyio
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import aiocache_kv as akv
from aiocache_kv.models import GPT2Spec, build_gpt2
from aiocache_kv.serving import Engine
from aiocache_kv.serving.metrics import EngineCollector
from aiocache_kv.testing import MemoryStorage
from tests.serving.test_engine import VOCAB, assert_nothing_held, config, reference, toks


@pytest.fixture(scope="module")
def gpt2() -> Any:
    spec = GPT2Spec(n_layer=2, n_head=4, n_embd=64, vocab_size=VOCAB, n_positions=512, seed=3)
    return build_gpt2(spec)


@pytest.mark.parametrize("how", ["aclose", "gc"])
async def test_a_reader_that_stops_reading_leaves_the_engine_serving(gpt2: Any, how: str) -> None:
    async with akv.HiCache(config(gpt2)) as cache:
        async with Engine(gpt2, cache, max_batch_tokens=64, max_running=8) as eng:
            other = asyncio.ensure_future(eng.generate(toks(1, 20), max_new_tokens=24))
            ts = eng.open_stream(toks(2, 20), max_new_tokens=24)
            it = ts.tokens()
            got = [await it.__anext__(), await it.__anext__()]
            if how == "aclose":
                await it.aclose()  # what ``break`` under ``aclosing`` does at once
            else:
                del it
                gc.collect()
            res = await ts.result()  # the request went on: every token
            assert res.tokens[:2] == got
            assert res.tokens == reference(gpt2, toks(2, 20), 24)
            assert (await other).tokens == reference(gpt2, toks(1, 20), 24)
            again = await eng.generate(toks(3, 8), max_new_tokens=2)
            assert again.tokens == reference(gpt2, toks(3, 8), 2)
            st = eng.statistics()
            assert st.failed == 0 and st.finished == 3, st
            eng.check_invariants()
        await cache.flush()
        assert_nothing_held(cache)


async def test_a_big_request_is_not_starved_by_a_stream_of_small_ones(gpt2: Any) -> None:
    big_prompt = toks(7, 116)  # 30 of the 32 pages with its 4 new tokens: fits alone
    async with akv.HiCache(config(gpt2, device_pages=32, host_pages=64)) as cache:
        async with Engine(gpt2, cache, max_batch_tokens=64, max_running=8) as eng:
            stop = False
            small: list[list[int]] = []

            async def client(c: int) -> None:
                i = 0
                while not stop:
                    i += 1
                    prompt = toks(10_000 * c + i, 20)
                    res = await eng.generate(prompt, max_new_tokens=8)
                    small.append(res.tokens)

            clients = [asyncio.ensure_future(client(c)) for c in range(4)]
            await asyncio.sleep(0.2)
            big = asyncio.ensure_future(eng.generate(big_prompt, max_new_tokens=4))
            done, _ = await asyncio.wait([big], timeout=20)
            before = len(small)
            stop = True
            await asyncio.gather(*clients)
            assert done, f"starved: {before} small requests finished while the big one waited"
            assert (await big).tokens == reference(gpt2, big_prompt, 4)
            assert eng.statistics().failed == 0
            eng.check_invariants()
        await cache.flush()
        assert_nothing_held(cache)


@pytest.mark.parametrize("variant", ["admit", "running"])
async def test_pages_a_zeroing_holds_are_waited_for_not_a_capacity_error(
    gpt2: Any, variant: str
) -> None:
    async with akv.HiCache(config(gpt2, device_pages=12, host_pages=0)) as cache:
        async with Engine(gpt2, cache, max_batch_tokens=64, max_running=4) as eng:
            x = toks(1, 32)
            await eng.generate(x, max_new_tokens=1)  # 8 pages cached (evictable)
            ts = None
            if variant == "running":  # the only running request grows while the drop zeroes
                ts = eng.open_stream(toks(2, 14), max_new_tokens=30)  # 44 rows: fits alone
                await ts.tokens().__anext__()
            drop = asyncio.ensure_future(cache.drop(x[:4], zeroize=True))
            await asyncio.sleep(0)
            if ts is None:
                res = await eng.generate(toks(3, 40), max_new_tokens=4)  # 44 rows: fits alone
                assert res.tokens == reference(gpt2, toks(3, 40), 4)
            else:
                res = await ts.result()
                assert res.tokens == reference(gpt2, toks(2, 14), 30)
            await drop
            assert eng.statistics().failed == 0
        await cache.flush()
        assert_nothing_held(cache)


async def test_other_namespaces_with_the_same_tokens_prefill_together(gpt2: Any) -> None:
    prompt = toks(1, 120)
    cfg = config(gpt2, device_pages=200, host_pages=256)
    async with akv.HiCache(cfg) as cache, Engine(gpt2, cache, max_batch_tokens=512) as eng:
        rs = await asyncio.gather(
            eng.generate(prompt, max_new_tokens=2, tenant="alice"),
            eng.generate(prompt, max_new_tokens=2, tenant="bob"),
            eng.generate(prompt, max_new_tokens=2, lora="adapter-1"),
        )
        st = eng.statistics()
    want = reference(gpt2, prompt, 2)
    assert [r.tokens for r in rs] == [want] * 3
    assert [r.attribution.cached for r in rs] == [0, 0, 0]  # never each other's pages
    assert st.steps == 2, f"prefills queued behind each other: {st.steps} steps"


class StallOneExists(MemoryStorage):
    """``exists`` call number ``stall_at`` waits for ``release`` (a slow store, well inside
    ``storage_timeout``)."""

    def __init__(self) -> None:
        super().__init__()
        self.exists_calls = 0
        self.stall_at = -1
        self.stalled = threading.Event()
        self.release = threading.Event()

    def exists(self, keys: Any) -> Any:
        self.exists_calls += 1
        if self.exists_calls == self.stall_at:
            self.stalled.set()
            self.release.wait(5.0)
        return super().exists(keys)


async def test_an_aborted_admissions_pins_are_waited_for_not_a_capacity_error(gpt2: Any) -> None:
    """Found by an adversarial round: a request aborted while its admission's prefetch waited
    on a slow store left the admitting line at once, but its task kept that prefetch's pins
    until the store answered; the next request, which fits the pool alone, was judged alone
    and failed with ``CapacityError``.  Now the ended request's admission is cancelled, and
    while it still gives back what it held nobody is judged alone."""
    store = StallOneExists()
    cfg = config(gpt2, device_pages=16, host_pages=16, storage=store, storage_timeout=8.0)
    async with akv.HiCache(cfg) as cache:
        async with Engine(gpt2, cache, max_batch_tokens=64, max_running=4) as eng:
            p = toks(1, 40)
            await eng.generate(p, max_new_tokens=1)  # 10 pages cached on device
            await cache.flush()
            store.stall_at = store.exists_calls + 2  # its arrival read passes, admission's stalls
            y = asyncio.ensure_future(eng.generate(p + toks(2, 8), max_new_tokens=1))
            assert await asyncio.to_thread(store.stalled.wait, 10)
            y.cancel()  # the client went away
            with pytest.raises(asyncio.CancelledError):
                await y
            x = toks(3, 60)  # 60 + 4 rows: the whole pool
            try:
                res = await asyncio.wait_for(eng.generate(x, max_new_tokens=4), 30)
            finally:
                store.release.set()
            assert res.tokens == reference(gpt2, x, 4)
            assert eng.statistics().failed == 0
        await cache.flush()
        assert_nothing_held(cache)


async def test_a_cached_prompt_of_whole_pages_fits_as_it_did_cold(gpt2: Any) -> None:
    """Found by an adversarial round: a prompt of whole pages, all cached, has its last page
    recomputed (for the logits) into a row of its own while its match pinned the tree's copy;
    the insert kept the tree's copy and retained the duplicate, so the request held that page
    twice and a request that fit the pool cold failed with ``CapacityError`` once cached.
    The engine now reads the tree's copy after the recompute and gives the duplicate back."""
    async with akv.HiCache(config(gpt2, device_pages=8, host_pages=0)) as cache:
        async with Engine(gpt2, cache, max_batch_tokens=64, max_running=4) as eng:
            p = toks(5, 28)  # 28 + 4 rows = 8 pages of 4: the whole pool
            cold = await eng.generate(p, max_new_tokens=4)
            assert cold.tokens == reference(gpt2, p, 4)
            for _ in range(2):
                warm = await asyncio.wait_for(eng.generate(p, max_new_tokens=4), 30)
                assert warm.tokens == cold.tokens
            assert eng.statistics().failed == 0
            eng.check_invariants()
        assert_nothing_held(cache)


async def test_a_recomputed_cached_page_dropped_during_the_pass_is_inserted_as_its_own(
    gpt2: Any,
) -> None:
    """Found by a review: the switch to the tree's copy of a recomputed cached last page
    freed the request's own rows before the insert; a drop during the forward pass made that
    insert fail, and giving the rows back then freed the tree's pinned pages: the step loop
    died with a double free.  Now the request keeps its own rows if the insert fails."""
    async with akv.HiCache(config(gpt2, device_pages=32, host_pages=0)) as cache:
        async with Engine(gpt2, cache, max_batch_tokens=64, max_running=4) as eng:
            p = toks(5, 8)  # 2 whole pages of 4
            cold = await eng.generate(p, max_new_tokens=2)
            runner = eng._runner
            assert runner is not None
            orig = runner.step
            fired: list[bool] = []

            async def step(*args: Any) -> Any:
                res = await orig(*args)
                if not fired:
                    fired.append(True)
                    await cache.drop(p)  # the cached pages go while the pass reads them
                return res

            runner.step = step  # type: ignore[method-assign]
            warm = await asyncio.wait_for(eng.generate(p, max_new_tokens=2), 20)
            assert fired and warm.tokens == cold.tokens
            assert eng.statistics().failed == 0
            eng.check_invariants()
        await cache.flush()
        assert_nothing_held(cache)


async def test_an_admission_cancelled_before_its_first_step_is_not_waited_for(
    gpt2: Any,
) -> None:
    """Found by a review: an admission task cancelled (its caller went away) before its first
    step never ran its ``finally``, so it counted for ever as an ended request's admission
    still giving back pins: no running request was preempted, and two that must take turns
    waited for each other for good."""
    async with akv.HiCache(config(gpt2, device_pages=8, host_pages=0)) as cache:
        async with Engine(gpt2, cache, max_batch_tokens=64, max_running=4) as eng:
            await eng.generate(toks(9, 5), max_new_tokens=1)  # the step loop is running
            g = asyncio.ensure_future(eng.generate(toks(1, 6), max_new_tokens=1))
            await asyncio.sleep(0)  # submitted: the step loop spawns its admission
            g.cancel()  # aborted in the same turn
            with pytest.raises(asyncio.CancelledError):
                await g
            await asyncio.sleep(0.05)
            adm = eng._admissions
            assert adm is not None and not adm.orphans()
            a, b = toks(2, 12), toks(3, 12)
            ra, rb = await asyncio.wait_for(
                asyncio.gather(
                    eng.generate(a, max_new_tokens=12), eng.generate(b, max_new_tokens=12)
                ),
                30,
            )
            assert ra.tokens == reference(gpt2, a, 12) and rb.tokens == reference(gpt2, b, 12)
            eng.check_invariants()
        assert_nothing_held(cache)


async def test_an_insert_that_fails_otherwise_leaves_no_page_switched(gpt2: Any) -> None:
    """Found by a review: an insert onto the tree's copy of a recomputed cached page that
    failed with anything but a cache error (a bug) left the request's rows on the tree's
    page: the step loop's clean-up then freed the tree's pinned page (a double free) and
    leaked the request's own copy and its handle's pins."""
    async with akv.HiCache(config(gpt2, device_pages=32, host_pages=0)) as cache:
        p = toks(5, 8)  # 2 whole pages of 4
        seen: list[BaseException] = []

        async def serve() -> None:  # the engine's own task: its step loop's failure ends it
            async with Engine(gpt2, cache, max_batch_tokens=64, max_running=4) as eng:
                await eng.generate(p, max_new_tokens=2)
                orig = cache.insert

                def broken(*args: Any, **kw: Any) -> Any:
                    raise RuntimeError("injected: a bug in insert")

                cache.insert = broken  # type: ignore[method-assign]
                try:
                    await eng.generate(p, max_new_tokens=2)
                except akv.EngineClosedError as exc:
                    seen.append(exc)
                finally:
                    cache.insert = orig  # type: ignore[method-assign]

        (ended,) = await asyncio.gather(serve(), return_exceptions=True)
        assert seen and "injected" in str(seen[0]), (seen, ended)
        st = cache.statistics()
        assert st.device.held_pages == 0 and st.device.protected_pages == 0, st.device
        cache.check_invariants()


async def _reply_then_stall(
    eng: Engine, cache: akv.HiCache, store: MemoryStorage
) -> tuple[list[int], list[int], Any, Any, int]:
    """Cache a prompt ``p`` of 10 pages (written through), start a 40-token reply to ``r``
    (20 + 40 rows: 15 of the 16 device pages, it fits alone) and take its first token, then
    stall the store's ``exists`` (the caller opens it again).  Returns ``p``, ``r``, the
    reply's stream, its token iterator and the first token."""
    p = toks(1, 40)
    await eng.generate(p, max_new_tokens=1)
    await cache.flush()
    r = toks(2, 20)
    ts = eng.open_stream(r, max_new_tokens=40)
    it = ts.tokens()
    first = await asyncio.wait_for(it.__anext__(), 20)
    store.gates["exists"].clear()
    return p, r, ts, it, first


@pytest.mark.parametrize("variant", ["waiting", "admitting", "aborted"])
async def test_a_running_request_waits_for_storage_reads_instead_of_failing_alone(
    gpt2: Any, variant: str
) -> None:
    """Found by an adversarial round: the only running request, needing one more page while
    another request's storage read pinned a cached prefix (a slow store), was judged alone in
    the pool and failed with ``CapacityError`` mid-reply; an aborted request's read on
    arrival went on pinning until the store answered.  Now a running request short of rows
    waits for storage reads while admissions turn back, and an ended request's read on
    arrival is cancelled.  The store here stalls for the whole reply: after ``storage_wait``
    the reads are cancelled (their deadline, 8 s, is never reached), and the request that
    read is admitted without storage."""
    store = MemoryStorage()
    cfg = config(gpt2, device_pages=16, host_pages=32, storage=store, storage_timeout=8.0)
    running = 4 if variant == "admitting" else 1
    async with akv.HiCache(cfg) as cache:
        async with Engine(
            gpt2, cache, max_batch_tokens=64, max_running=running, storage_wait=0.2
        ) as eng:
            p, r, ts, it, first = await _reply_then_stall(eng, cache, store)
            w = asyncio.ensure_future(eng.generate(p + toks(3, 8), max_new_tokens=1))
            try:
                assert await asyncio.to_thread(store.entered["exists"].wait, 10)
                if variant == "aborted":
                    w.cancel()
                    await asyncio.gather(w, return_exceptions=True)
                got = [first] + [t async for t in it]
                res = await asyncio.wait_for(ts.result(), 30)
                if variant != "aborted":  # w joins while the store still stalls
                    won = await asyncio.wait_for(w, 30)
                    assert won.tokens == reference(gpt2, p + toks(3, 8), 1)
                    assert won.attribution.storage == 0, won.attribution
            finally:
                store.gates["exists"].set()
            assert got == res.tokens == reference(gpt2, r, 40)
            st = eng.statistics()
            assert st.failed == 0, st
            assert (st.storage_reads_cancelled > 0) == (variant != "aborted"), st
            eng.check_invariants()
        await cache.flush()
        assert_nothing_held(cache)


async def test_a_store_that_answers_within_storage_wait_keeps_its_reads(gpt2: Any) -> None:
    """The other side of ``storage_wait``: a running request short of rows waits for the
    pins of a read that the store answers in time (here after 0.3 s, the wait being 60 s),
    and nothing is cancelled: the read's request is served from what it read."""
    store = MemoryStorage()
    cfg = config(gpt2, device_pages=16, host_pages=32, storage=store, storage_timeout=8.0)
    async with akv.HiCache(cfg) as cache:
        async with Engine(
            gpt2, cache, max_batch_tokens=64, max_running=1, storage_wait=60.0
        ) as eng:
            p, r, ts, it, first = await _reply_then_stall(eng, cache, store)
            w = asyncio.ensure_future(eng.generate(p + toks(3, 8), max_new_tokens=1))
            try:
                assert await asyncio.to_thread(store.entered["exists"].wait, 10)
                asyncio.get_running_loop().call_later(0.3, store.gates["exists"].set)
                got = [first] + [t async for t in it]
                res = await asyncio.wait_for(ts.result(), 30)
            finally:
                store.gates["exists"].set()
            assert got == res.tokens == reference(gpt2, r, 40)
            assert (await asyncio.wait_for(w, 30)).tokens == reference(gpt2, p + toks(3, 8), 1)
            st = eng.statistics()
            assert st.failed == 0 and st.storage_reads_cancelled == 0, st
            eng.check_invariants()
        await cache.flush()
        assert_nothing_held(cache)


async def test_storage_wait_zero_cancels_at_the_first_shortage(gpt2: Any) -> None:
    """``storage_wait=0``: the first step a running request is short of rows cancels the
    reads that pin; the store never answers before the reply ends (its gate opens only
    after), and the late answers of the cancelled reads change nothing."""
    store = MemoryStorage()
    cfg = config(gpt2, device_pages=16, host_pages=32, storage=store, storage_timeout=8.0)
    async with akv.HiCache(cfg) as cache:
        async with Engine(gpt2, cache, max_batch_tokens=64, max_running=4, storage_wait=0) as eng:
            p, r, ts, it, first = await _reply_then_stall(eng, cache, store)
            ws = [
                asyncio.ensure_future(eng.generate(p + toks(k, 8), max_new_tokens=2))
                for k in (3, 4)
            ]
            try:
                assert await asyncio.to_thread(store.entered["exists"].wait, 10)
                got = [first] + [t async for t in it]
                res = await asyncio.wait_for(ts.result(), 30)
                done = await asyncio.wait_for(asyncio.gather(*ws), 30)
            finally:
                store.gates["exists"].set()
            assert got == res.tokens == reference(gpt2, r, 40)
            for k, out in zip((3, 4), done, strict=True):
                assert out.tokens == reference(gpt2, p + toks(k, 8), 2)
            st = eng.statistics()
            assert st.failed == 0 and st.storage_reads_cancelled >= 1, st
            registry = CollectorRegistry()
            EngineCollector(eng, registry=registry)
            text = generate_latest(registry).decode()
            families = {f.name: f for f in text_string_to_metric_families(text)}
            [sample] = families["aiocache_kv_engine_storage_reads_cancelled"].samples
            assert sample.name.endswith("_total") and sample.value == st.storage_reads_cancelled
            await asyncio.sleep(0.05)  # the stalled store's late answers land now
            eng.check_invariants()
        await cache.flush()
        assert_nothing_held(cache)


@pytest.mark.parametrize("seed", range(3))
async def test_seeded_stalling_store_under_storage_wait(gpt2: Any, seed: int) -> None:
    """Seeded: a store whose reads stall and resume at random (``exists`` and ``get_into``
    gates toggled every few milliseconds), a device pool that runs short, random
    ``storage_wait`` (0 to 0.1 s) and callers that give up at random moments: every finished
    reply is the model's own, no request fails, invariants hold throughout, and once the
    store answers again nothing stays held."""
    rng = random.Random(seed)
    wait = rng.choice([0.0, 0.02, 0.1])
    store = MemoryStorage()
    cfg = config(gpt2, device_pages=16, host_pages=32, storage=store, storage_timeout=2.0)
    prefixes = [toks(500 * seed + k, rng.randrange(16, 25)) for k in range(3)]
    outcomes: list[tuple[list[int], int, akv.GenerationResult]] = []
    try:
        async with akv.HiCache(cfg) as cache:
            async with Engine(
                gpt2, cache, max_batch_tokens=32, max_running=4, storage_wait=wait
            ) as eng:
                for pre in prefixes:  # on device and in storage: a read of a longer prompt
                    await eng.generate(pre, max_new_tokens=1)  # pins them while it waits
                await cache.flush()
                stop = asyncio.Event()

                async def toggle() -> None:
                    while not stop.is_set():
                        for name in ("exists", "get_into"):
                            if rng.random() < 0.5:
                                store.gates[name].clear()
                        await asyncio.sleep(rng.random() * 0.15)
                        for name in ("exists", "get_into"):
                            store.gates[name].set()
                        await asyncio.sleep(rng.random() * 0.02)

                async def one(i: int) -> None:
                    prompt = rng.choice(prefixes) + toks(seed * 977 + i, rng.randrange(1, 13))
                    n = rng.randrange(1, 25)
                    await asyncio.sleep(rng.random() * 0.05)
                    if rng.random() < 0.2:
                        with anyio.move_on_after(rng.random() * 0.05):
                            await eng.generate(prompt, max_new_tokens=n)
                        return
                    outcomes.append((prompt, n, await eng.generate(prompt, max_new_tokens=n)))

                async def checker() -> None:
                    while not stop.is_set():
                        eng.check_invariants()
                        await asyncio.sleep(0.005)

                tasks = [asyncio.ensure_future(f) for f in (toggle(), checker())]
                try:
                    await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(16))), 60)
                finally:
                    stop.set()
                    for name in ("exists", "get_into"):
                        store.gates[name].set()
                    await asyncio.gather(*tasks)
                st = eng.statistics()
                assert st.failed == 0, st
                eng.check_invariants()
            await cache.flush()
            assert_nothing_held(cache)
    except BaseException:
        print(f"stalling store seed {seed} FAILED")
        raise
    assert len(outcomes) >= 8, outcomes
    for p, n, r in outcomes:
        assert r.tokens == reference(gpt2, p, n), f"seed {seed}"


async def test_storage_wait_leaves_the_reads_of_tensor_parallel_ranks_alone(gpt2: Any) -> None:
    """With tensor parallelism a cancelled read would keep its pins until its ranks agree:
    :meth:`Admissions.cancel_reads` cancels nothing there (the running request waits for the
    reads' deadlines, as before), and counts nothing."""
    store = MemoryStorage()
    cfg = config(gpt2, device_pages=16, host_pages=32, storage=store, storage_timeout=8.0)
    async with akv.HiCache(cfg) as cache:
        async with Engine(  # (the step loop itself cancels nothing within this test)
            gpt2, cache, max_batch_tokens=64, max_running=1, storage_wait=60.0
        ) as eng:
            p, r, ts, it, first = await _reply_then_stall(eng, cache, store)
            w = asyncio.ensure_future(eng.generate(p + toks(3, 8), max_new_tokens=1))
            try:
                assert await asyncio.to_thread(store.entered["exists"].wait, 10)
                adm = eng._admissions
                assert adm is not None and adm.holding()
                single = cache.tp_group
                cache.tp_group = types.SimpleNamespace(rank=0, world_size=2)  # type: ignore[assignment]
                try:
                    assert adm.cancel_reads() == 0 and adm.holding()
                finally:
                    cache.tp_group = single
                assert adm.cancel_reads() == 1  # one rank: the read on arrival gives way
            finally:
                store.gates["exists"].set()
            got = [first] + [t async for t in it]
            assert got == (await asyncio.wait_for(ts.result(), 30)).tokens == reference(gpt2, r, 40)
            assert (await asyncio.wait_for(w, 30)).tokens == reference(gpt2, p + toks(3, 8), 1)
            eng.check_invariants()
        await cache.flush()
        assert_nothing_held(cache)


async def test_a_read_on_arrival_cancelled_before_it_starts_holds_nothing(gpt2: Any) -> None:
    """``storage_wait`` cancels the reads on arrival for a running request short of rows; a
    read cancelled before its task's first step never ran its ``finally``, so its entry
    stayed and the engine believed pins were held for good: the running batch waited for
    them forever instead of preempting (found by the seeded stalling-store test, about once
    in 25 runs under load).  Now the entry goes with the task, however it ends, and the
    request is still served, without a storage read."""
    store = MemoryStorage()
    cfg = config(gpt2, device_pages=16, host_pages=32, storage=store, storage_timeout=8.0)
    async with akv.HiCache(cfg) as cache:
        async with Engine(gpt2, cache, max_batch_tokens=64, max_running=1) as eng:
            adm = eng._admissions
            assert adm is not None
            prompt = toks(11, 9)
            task = asyncio.ensure_future(eng.generate(prompt, max_new_tokens=3))
            for _ in range(50):  # until the request arrived and its read was spawned
                await asyncio.sleep(0)
                if adm.holding():
                    break
            assert adm.holding()
            read = next(iter(adm._arrivals.values()))
            assert adm.cancel_reads() == 1  # (its first step has not run yet, or has)
            await asyncio.wait([read])
            await asyncio.sleep(0)  # its done callback
            assert not adm._arrivals and not adm.holding()
            got = await asyncio.wait_for(task, 30)
            assert got.tokens == reference(gpt2, prompt, 3)
            eng.check_invariants()
        await cache.flush()
        assert_nothing_held(cache)
