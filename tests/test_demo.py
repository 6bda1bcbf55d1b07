"""``aiocache-kv demo`` in process: what the measurement and the summary claim."""

from __future__ import annotations

import argparse
import io
from typing import Any

import pytest

from aiocache_kv import demo
from aiocache_kv.models import CachedLM
from aiocache_kv.models.generate import Generation


def _args(**kw: Any) -> argparse.Namespace:
    base = dict(conversations=2, turns=2, new_tokens=3, storage="none", device_pages=96)
    return argparse.Namespace(**{**base, **kw})


def _turn(device: int, host: int, storage: int) -> demo.TurnResult:
    ref = Generation(prompt_len=200, tokens=[1], ttft=0.05, total=0.05, computed=200)
    got = Generation(prompt_len=200, tokens=[1], ttft=0.02, total=0.02, computed=8)
    got.hit_device, got.hit_host, got.hit_storage = device, host, storage
    return demo.TurnResult("node 1", 1, "chat A", ref, got, 0.0)


def test_hits_line_names_only_the_tiers_the_run_has() -> None:
    three = [_turn(16, 0, 0), _turn(0, 32, 0), _turn(0, 0, 48)]
    assert demo.hits_line(three, storage=True) == (
        "tokens hit per tier: device 16, host 32, storage 48 - every tier served hits"
    )
    line = demo.hits_line(three[:2], storage=False)
    assert line == "tokens hit per tier: device 16, host 32 - both tiers served hits (no storage)"
    line = demo.hits_line(three[:1], storage=False)
    assert "storage" not in line and "every tier" not in line and "no hits from host" in line
    assert "no hits from host or storage" in demo.hits_line(three[:1], storage=True)


async def test_both_paths_are_warm_before_the_first_timed_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whichever path runs first on the first turn (a miss) must not pay a warm-up the other
    one skips: both ran, untimed, on a prompt as long as the first turn's."""
    calls: list[tuple[str, int, int]] = []
    real_ref, real_gen = demo.reference_generate, CachedLM.generate

    def ref(model: Any, prompt: Any, n: int, **kw: Any) -> Generation:
        g = real_ref(model, prompt, n, **kw)
        calls.append(("no cache", len(prompt), id(g)))
        return g

    async def gen(self: CachedLM, prompt: Any, n: int, **kw: Any) -> Generation:
        g = await real_gen(self, prompt, n, **kw)
        calls.append(("cache", len(prompt), id(g)))
        return g

    monkeypatch.setattr(demo, "reference_generate", ref)
    monkeypatch.setattr(CachedLM, "generate", gen)
    seen: list[demo.ChatDemo] = []
    real_run = demo.ChatDemo.run

    async def run(self: demo.ChatDemo) -> bool:
        seen.append(self)
        return await real_run(self)

    monkeypatch.setattr(demo.ChatDemo, "run", run)
    assert await demo.run_demo(_args(), out=io.StringIO()) == 0
    first = seen[0].log.results[0]
    assert first.source == "miss"
    timed = {id(first.ref), id(first.got)}
    before = calls[: min(i for i, c in enumerate(calls) if c[2] in timed)]
    assert {("no cache", first.got.prompt_len), ("cache", first.got.prompt_len)} <= {
        (path, n) for path, n, _ in before
    }
