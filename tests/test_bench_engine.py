"""``aiocache-kv bench engine`` on a tiny workload: every field of its JSON, engine replies
identical to one-at-a-time ``CachedLM`` replies, a broken ``transformers`` side reported (not
raised), and a mismatch reported loudly."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from aiocache_kv.bench import engine as bench
from aiocache_kv.bench.engine_sides import Served, SideRun
from aiocache_kv.cli import main

TINY = bench.EngineBenchOptions(
    conversations=3,
    turns=2,
    system_tokens=24,
    user_tokens=(5, 12),
    reply_tokens=4,
    page_size=4,
    size="tiny",
)
SIDE_KEYS = {
    "error", "requests", "wall_s", "generated_tokens", "throughput_tok_s", "ttft_ms", "itl_ms",
    "latency_ms_p50", "prompt_tokens", "prompt_tokens_computed", "prompt_tokens_reused",
    "rounds_wall_s",
}  # fmt: skip
ENGINE_KEYS = {
    "steps", "step_seconds", "step_tokens", "mean_batch", "preemptions",
    "shared_in_flight_tokens", "failed", "forward_share_of_wall", "cpu", "loop_lag_ms",
}  # fmt: skip
CPU_KEYS = {
    "step_loop_s", "admission_s", "engine_s", "engine_share_of_step_time",
    "step_loop_share_of_step_time", "step_loop_wall_s", "loop_thread_s",
    "wall_outside_forward_share", "tasks_timed",
}  # fmt: skip
LAG_KEYS = {
    "busy_p50", "busy_p99", "busy_samples", "p99", "max", "samples", "idle_p99",
    "pass_wall_s", "switch_interval_ms",
}  # fmt: skip
TARGETS = {
    "throughput_vs_sequential", "ttft_p50_vs_sequential", "throughput_vs_transformers",
    "ttft_p90_vs_transformers", "engine_cpu_share", "loop_lag_p99_ms",
}  # fmt: skip


def check_side(side: dict[str, Any], requests: int, replies: int) -> None:
    assert set(side) >= SIDE_KEYS, set(side) ^ SIDE_KEYS
    assert side["error"] is None
    assert side["requests"] == requests and side["generated_tokens"] == requests * replies
    assert side["wall_s"] > 0 and side["throughput_tok_s"] > 0
    assert set(side["ttft_ms"]) == {"p50", "p90", "p99"}
    assert 0 < side["ttft_ms"]["p50"] <= side["ttft_ms"]["p90"] <= side["ttft_ms"]["p99"]
    assert set(side["itl_ms"]) == {"mean", "p90"} and side["itl_ms"]["mean"] > 0
    computed, reused = side["prompt_tokens_computed"], side["prompt_tokens_reused"]
    assert computed + reused == side["prompt_tokens"] and reused > 0


def test_tiny_run_reports_every_field_and_identical_replies(
    capsys: pytest.CaptureFixture[str],
) -> None:
    res = bench.run(TINY)
    out = capsys.readouterr().out
    assert "TTFT p50 ms" in out and "throughput engine / sequential" in out
    assert res["identical"] is True and res["errors"] == []
    assert res["workload"]["requests"] == 6 and set(res["models"]) == {"gpt2", "llama"}
    json.dumps(res)  # JSON-able
    for m in res["models"].values():
        assert set(m) == {
            "model", "cache", "load_average", "sides", "ratios", "targets", "identical",
        }  # fmt: skip
        assert set(m["sides"]) == set(bench.SIDES)
        for side in m["sides"].values():
            check_side(side, 6, TINY.reply_tokens)
        eng = m["sides"]["engine"]["engine"]
        assert set(eng) == ENGINE_KEYS
        assert set(eng["cpu"]) == CPU_KEYS and set(eng["loop_lag_ms"]) == LAG_KEYS
        assert eng["steps"] > 0 and eng["mean_batch"] > 1  # conversations shared steps
        timed = eng["cpu"]["tasks_timed"]
        assert timed["step_loop"] == 1 and timed["admission"] >= 6  # one per admission
        assert 0 < eng["cpu"]["engine_s"] <= eng["cpu"]["loop_thread_s"]
        assert eng["loop_lag_ms"]["samples"] > 0
        assert m["sides"]["transformers"]["transformers"]["prefix_sharing"] is True
        assert m["identical"]["engine_vs_sequential"] == {"identical": True, "differing": 0}
        assert m["identical"]["engine_vs_transformers"]["differing"] >= 0
        assert set(m["ratios"]) == {"engine_vs_sequential", "engine_vs_transformers"}
        assert set(m["targets"]) == TARGETS
        assert all(set(t) == {"value", "target", "met"} for t in m["targets"].values())
        # the engine computes the shared system prompt once, as one request at a time does
        eng_side, seq_side = m["sides"]["engine"], m["sides"]["sequential"]
        slack = 3 * TINY.page_size
        assert eng_side["prompt_tokens_computed"] <= seq_side["prompt_tokens_computed"] + slack


def test_cli_writes_the_suite_to_the_json_report(tmp_path: Path) -> None:
    report = tmp_path / "engine.json"
    argv = [
        "bench", "engine", "--engine-size", "tiny", "--engine-models", "gpt2",
        "--engine-sides", "engine", "sequential", "--conversations", "2", "--turns", "2",
        "--system-tokens", "24", "--reply-tokens", "3", "--engine-repeats", "2",
        "--json", str(report),
    ]  # fmt: skip
    assert main(argv) == 0
    res = json.loads(report.read_text())["suites"]["engine"]
    assert res["identical"] is True and set(res["models"]) == {"gpt2"}
    m = res["models"]["gpt2"]
    assert set(m["sides"]) == {"engine", "sequential"}
    for side in m["sides"].values():
        check_side(side, 4, 3)
        assert len(side["rounds_wall_s"]) == 2 and side["wall_s"] in side["rounds_wall_s"]
    assert set(m["targets"]) == {
        "throughput_vs_sequential", "ttft_p50_vs_sequential", "engine_cpu_share",
        "loop_lag_p99_ms",
    }  # fmt: skip


def test_a_broken_transformers_side_is_reported_not_raised(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import transformers.generation.configuration_utils as cu

    def broken(**_: Any) -> Any:
        raise RuntimeError("no continuous batching here")

    monkeypatch.setattr(cu, "ContinuousBatchingConfig", broken)
    opts = dataclasses.replace(TINY, models=("gpt2",), sides=("engine", "transformers"))
    res = bench.run(opts)
    side = res["models"]["gpt2"]["sides"]["transformers"]
    assert "no continuous batching here" in side["error"]
    assert res["errors"] and "gpt2/transformers" in res["errors"][0]
    assert res["identical"] is True  # nothing to compare the engine with
    assert "ERROR" in capsys.readouterr().out


def test_differing_replies_fail_loudly(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = bench.serve_sequential

    async def wrong(model: Any, wl: Any, cfg: Any) -> SideRun:
        run = await real(model, wl, cfg)
        t = run.turns[-1]
        bad = dataclasses.replace(t.served, tokens=[(x + 1) % 500 for x in t.served.tokens])
        assert isinstance(bad, Served)
        run.turns[-1] = dataclasses.replace(t, served=bad)
        return run

    monkeypatch.setattr(bench, "serve_sequential", wrong)
    opts = dataclasses.replace(TINY, models=("gpt2",), sides=("engine", "sequential"))
    res = bench.run(opts)
    assert res["identical"] is False
    same = res["models"]["gpt2"]["identical"]["engine_vs_sequential"]
    assert same == {"identical": False, "differing": 1}
    out = capsys.readouterr().out
    assert "FAILED: engine and sequential replies differ" in out and " NO" in out
