"""The engine's step bookkeeping yields to the event loop between requests once it ran longer
than ``STEP_SLICE``: a full batch's inserts (write-through starts included) never run as one
callback that keeps every other task on the loop waiting (issue #27, ``bench lag``)."""

from __future__ import annotations

import asyncio
import math
import random
import time
from typing import Any

import pytest

from aiocache_kv.cache import HiCache
from aiocache_kv.models import GPT2Spec, build_gpt2, cache_config_for
from aiocache_kv.serving import Engine
from aiocache_kv.serving import engine as engine_module

VOCAB = 512
SLOW_INSERT = 0.001  #: seconds each insert spins on the loop, well over STEP_SLICE
PROMPTS = 8


@pytest.fixture(scope="module")
def gpt2() -> Any:
    spec = GPT2Spec(n_layer=2, n_head=2, n_embd=64, vocab_size=VOCAB, n_positions=256, seed=3)
    return build_gpt2(spec)


async def _worst_run_of_inserts(model: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    """Serve a full batch with slow inserts; (inserts, most inserts the loop ran between two
    turns of a task that yields at every chance)."""
    cfg = cache_config_for(
        model,
        page_size=4,
        device_pages=128,
        host_pages=256,
        host_memory_reserve_bytes=0,
        namespace="step-slices",
    )
    rng = random.Random(7)
    prompts = [[rng.randrange(VOCAB - 1) for _ in range(16)] for _ in range(PROMPTS)]
    async with (
        HiCache(cfg) as cache,
        Engine(model, cache, max_batch_tokens=128, max_running=PROMPTS) as engine,
    ):
        real = cache.insert
        count = 0

        def slow_insert(*args: Any, **kwargs: Any) -> Any:
            nonlocal count
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < SLOW_INSERT:  # an insert that costs loop time
                pass
            count += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(cache, "insert", slow_insert)
        worst = 0
        stop = asyncio.Event()

        async def probe() -> None:
            nonlocal worst
            seen = count
            while not stop.is_set():
                await asyncio.sleep(0)
                worst, seen = max(worst, count - seen), count

        task = asyncio.create_task(probe())
        try:
            await asyncio.gather(*(engine.generate(p, max_new_tokens=4) for p in prompts))
        finally:
            stop.set()
            await task
        engine.check_invariants()
    return count, worst


async def test_step_bookkeeping_yields_between_requests(
    gpt2: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    inserts, worst = await _worst_run_of_inserts(gpt2, monkeypatch)
    assert inserts >= PROMPTS, f"only {inserts} inserts: the batch never filled pages"
    assert worst <= 1, f"{worst} slow inserts ran without the loop getting a turn"


async def test_without_the_slice_a_step_runs_its_inserts_as_one_callback(
    gpt2: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check above can fail: with no slice, a step's inserts run back to back."""
    monkeypatch.setattr(engine_module, "STEP_SLICE", math.inf)
    inserts, worst = await _worst_run_of_inserts(gpt2, monkeypatch)
    assert inserts >= PROMPTS
    assert worst >= 4, f"expected a whole step's inserts in one callback, saw at most {worst}"
