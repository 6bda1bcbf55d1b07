"""``aiocache-kv demo`` in process: what the measurement and the summary claim."""

from __future__ import annotations

import argparse
import io
from typing import Any

import pytest

from aiocache_kv import demo
from aiocache_kv.demo_report import TurnResult, hits_line
from aiocache_kv.models.generate import Generation, reference_generate
from aiocache_kv.serving import Engine, GenerationResult
from aiocache_kv.telemetry import attribute


def _args(**kw: Any) -> argparse.Namespace:
    base = dict(conversations=2, turns=2, new_tokens=3, storage="none", device_pages=96)
    return argparse.Namespace(**{**base, **kw})


def _turn(device: int, host: int, storage: int) -> TurnResult:
    ref = Generation(prompt_len=200, tokens=[1], ttft=0.05, total=0.05, computed=200)
    reused = device + host + storage
    got = GenerationResult(
        tokens=[1],
        prompt_len=200,
        queue_time=0.0,
        ttft=0.02,
        itl=[],
        total=0.02,
        attribution=attribute(200, reused, device=device, host=host, storage=storage),
        preemptions=0,
        shared_in_flight=0,
    )
    return TurnResult("node 1", 1, "chat A", ref, got, 0.0)


def test_hits_line_names_only_the_tiers_the_run_has() -> None:
    three = [_turn(16, 0, 0), _turn(0, 32, 0), _turn(0, 0, 48)]
    assert hits_line(three, storage=True) == (
        "tokens hit per tier: device 16, host 32, storage 48 - every tier served hits"
    )
    line = hits_line(three[:2], storage=False)
    assert line == "tokens hit per tier: device 16, host 32 - both tiers served hits (no storage)"
    line = hits_line(three[:1], storage=False)
    assert "storage" not in line and "every tier" not in line and "no hits from host" in line
    assert "no hits from host or storage" in hits_line(three[:1], storage=True)
    assert [t.source for t in three] == ["device", "host", "storage"]
    assert _turn(0, 0, 0).source == "miss"


Call = tuple[str, int, object]


def _record(monkeypatch: pytest.MonkeyPatch) -> tuple[list[Call], list[int], list[demo.ChatDemo]]:
    """Record every generation (path, prompt length, its result: the object itself, kept
    alive, since the id of a freed warm-up result can be reused by a timed one), how many
    cached generations were in flight at once, and the demo object of the run."""
    calls: list[Call] = []
    in_flight = [0, 0]  # now, most at once
    real_ref, real_gen = reference_generate, Engine.generate

    def ref(model: Any, prompt: Any, n: int, **kw: Any) -> Generation:
        g = real_ref(model, prompt, n, **kw)
        calls.append(("no cache", len(prompt), g))
        return g

    async def gen(self: Engine, prompt: Any, **kw: Any) -> GenerationResult:
        in_flight[0] += 1
        in_flight[1] = max(in_flight)
        try:
            g = await real_gen(self, prompt, **kw)
        finally:
            in_flight[0] -= 1
        calls.append(("cache", len(prompt), g))
        return g

    monkeypatch.setattr(demo, "reference_generate", ref)
    monkeypatch.setattr(Engine, "generate", gen)
    seen: list[demo.ChatDemo] = []
    real_run = demo.ChatDemo.run

    async def run(self: demo.ChatDemo) -> bool:
        seen.append(self)
        return await real_run(self)

    monkeypatch.setattr(demo.ChatDemo, "run", run)
    return calls, in_flight, seen


async def test_both_paths_are_warm_and_each_round_is_batched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whichever path runs first on the first turn (a miss) must not pay a warm-up the other
    one skips: both ran, untimed, on a prompt as long as the first turn's.  Every round's
    turns are in the engine at once, and the engine ran them in shared forward passes."""
    calls, in_flight, seen = _record(monkeypatch)
    out = io.StringIO()
    assert await demo.run_demo(_args(conversations=3), out=out) == 0
    results = seen[0].log.results
    first = results[0]
    assert first.source == "miss"
    before = calls[: min(i for i, c in enumerate(calls) if c[2] is first.ref or c[2] is first.got)]
    assert {("no cache", first.got.prompt_len), ("cache", first.got.prompt_len)} <= {
        (path, n) for path, n, _ in before
    }
    assert in_flight[1] == 3  # a whole round at once
    assert [r.batch for r in results] == [3] * 6
    ((node, st),) = seen[0].log.engines
    assert node == "node 1" and st.finished == 6 and st.failed == st.aborted == 0
    run = sum(r.got.attribution.computed + len(r.got.tokens) - 1 for r in results)
    assert st.step_tokens == run  # each computed prompt token and reply token ran once
    assert st.batch_size.sum > st.steps  # requests shared forward passes
    text = out.getvalue()
    assert "node 1, turn 1: 3 requests at once through one Engine" in text
    assert "TTFT cache ms (batch of 3)" in text
    assert "concurrent requests in" in text and "Engine.statistics() per node" in text
