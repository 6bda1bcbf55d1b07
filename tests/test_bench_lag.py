"""``aiocache-kv bench lag`` at a tiny size: the JSON's shape, lag samples taken in every
ticker arm, the bytes written through, the engine's throughput with and without the ticker
(not the timings themselves)."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from aiocache_kv.bench import SUITES
from aiocache_kv.bench import lag as bench
from aiocache_kv.cli import build_parser
from aiocache_kv.errors import InvalidInputError

TINY = bench.LagBenchOptions(
    lag_mib=8,
    max_running=4,
    max_batch_tokens=64,
    prompt_tokens=(24, 48),
    reply_tokens=6,
    page_size=16,
    device_pages=256,
    host_pages=512,
    write_pages=16,
    writes_in_flight=2,
    idle_s=0.05,
    rounds=2,
    engine_s=0.2,
    size="tiny",
)
LAG_KEYS = {"samples", "counted", "p50_ms", "p99_ms", "max_ms", "all_p99_ms", "samples_ms"}
ENGINE_KEYS = {
    "steps", "generated_tokens", "computed_tokens", "generated_tok_s", "computed_tok_s",
    "engine_bytes_inserted",
}  # fmt: skip
WRITE_KEYS = {"write_s", "bytes", "writer_bytes", "gbs"}


def test_tiny_run_reports_every_arm(capsys: pytest.CaptureFixture[str]) -> None:
    res = bench.run(TINY)
    out = capsys.readouterr().out
    assert "write-through + engine, full batch" in out and "with the ticker" in out
    json.dumps(res)  # JSON-able
    assert set(res["arms"]) == {*bench.ARMS, *bench.NO_TICKER}
    assert res["target_p99_ms"] == bench.TARGET_LAG_P99_MS
    target = TINY.lag_mib << 20
    assert res["rounds"] == 2 and set(res["load_average"]) == {"start", "end", "cpus"}
    for name, arm in res["arms"].items():
        assert arm["rounds"] == 2, name
        lag = arm["lag"]
        if name in bench.NO_TICKER:
            assert arm["ticker"] is False and lag == {"samples": 0, "counted": 0}
        else:
            assert arm["ticker"] is True and set(lag) == LAG_KEYS, name
            assert lag["counted"] > 0 and len(lag["samples_ms"]) == lag["counted"], name
            assert 0 <= lag["p50_ms"] <= lag["p99_ms"] <= lag["max_ms"], name
        if "write" in name:
            assert set(arm) >= WRITE_KEYS, name
            assert arm["bytes"] >= target * 0.9, (name, arm["bytes"])
        if "engine" in name:
            assert set(arm) >= ENGINE_KEYS, name
            assert arm["steps"] > 0 and arm["computed_tokens"] > 0, name
            assert len(arm["computed_tok_s_rounds"]) == 2, name
    assert res["arms"]["write"]["writer_bytes"] == res["arms"]["write"]["bytes"]
    assert res["ticker_throughput_ratio"] > 0 and res["ticker_throughput_ratio_write"] > 0
    assert res["arms"]["engine"]["wall_s"] >= TINY.engine_s
    assert res["loop"] == bench.LOOPS[False] and bench.LOOPS[False] in out


def test_the_stdlib_loop_arm_runs_on_asyncios_loop(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``stdlib_loop``: measured on the loop ``asyncio.run`` makes, named as such."""
    seen: list[str] = []
    measure = bench.measure

    async def spy(opts: bench.LagBenchOptions, model: object) -> dict[str, object]:
        seen.append(type(asyncio.get_running_loop()._selector).__name__)  # type: ignore[attr-defined]
        return await measure(opts, model)

    monkeypatch.setattr(bench, "measure", spy)
    short = dataclasses.replace(TINY, rounds=1, lag_mib=4, engine_s=0.05, idle_s=0.02)
    res = bench.run(dataclasses.replace(short, stdlib_loop=True))
    assert res["loop"] == bench.LOOPS[True] and bench.LOOPS[True] in capsys.readouterr().out
    bench.run(short)
    assert seen == ["EpollSelector", "PreciseEpollSelector"]


def test_bad_options_raise_before_running() -> None:
    with pytest.raises(InvalidInputError, match="size"):
        bench.run(bench.LagBenchOptions(size="huge"))
    with pytest.raises(InvalidInputError, match="prompt_tokens"):
        bench.run(bench.LagBenchOptions(prompt_tokens=(50, 10)))


def test_the_cli_knows_the_suite() -> None:
    assert "lag" in SUITES
    args = build_parser().parse_args(["bench", "lag", "--lag-mib", "64", "--max-running", "8"])
    assert (args.suite, args.lag_mib, args.max_running) == ("lag", 64, 8)
    assert args.stdlib_loop is False
    assert build_parser().parse_args(["bench", "lag", "--stdlib-loop"]).stdlib_loop is True
