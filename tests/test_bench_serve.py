"""``aiocache-kv bench serve`` on a tiny workload: every arm's replies identical, every JSON
field, hit rates per tier consistent with each arm's tiers, the CLI wiring, and ``--url``
against a live OpenAI-shaped server (same replies as in-process)."""

from __future__ import annotations

import asyncio
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from aiocache_kv.bench import SERVE_ARMS
from aiocache_kv.bench import serve as bench
from aiocache_kv.bench.engine import SPECS
from aiocache_kv.bench.engine_sides import Turn, Workload
from aiocache_kv.bench.serve_arms import ARMS, Pacing, paced_drive, serve_engine_arm
from aiocache_kv.bench.serve_http import parse_tokens, serve_url
from aiocache_kv.cli import main
from aiocache_kv.errors import InvalidInputError

TINY = bench.ServeBenchOptions(
    clients=3,
    rounds=2,
    system_tokens=24,
    user_tokens=8,
    output_len=4,
    page_size=4,
    size="tiny",
    progress=False,
)
ARM_KEYS = {
    "error", "requests", "wall_s", "input_tokens", "output_tokens", "input_tok_s",
    "output_tok_s", "ttft_ms", "itl_ms", "latency_ms_p50", "prompt_tokens_computed",
    "prompt_tokens_reused", "hit_rate", "hit_rate_per_round", "ttft_s_sorted", "extra",
}  # fmt: skip
TOP_KEYS = {
    "workload", "engine_options", "size", "cache", "load_average", "arms", "identical_detail",
    "identical", "errors", "fatal",
}  # fmt: skip


@pytest.fixture(scope="module")
def result() -> dict[str, Any]:
    opts = bench.ServeBenchOptions(**{**TINY.__dict__, "round_barrier": True, "request_rate": 50.0})
    return bench.run(opts)


def check_arm(arm: dict[str, Any], requests: int, prompt_tokens: int) -> None:
    assert set(arm) == ARM_KEYS, set(arm) ^ ARM_KEYS
    assert arm["error"] is None and arm["requests"] == requests
    assert arm["output_tokens"] == requests * TINY.output_len
    assert arm["input_tokens"] == prompt_tokens
    assert arm["wall_s"] > 0 and arm["input_tok_s"] > 0 and arm["output_tok_s"] > 0
    t = arm["ttft_ms"]
    assert set(t) == {"p50", "p90", "p99"} and 0 < t["p50"] <= t["p90"] <= t["p99"]
    assert set(arm["itl_ms"]) == {"mean", "p50", "p90", "p99"} and arm["itl_ms"]["mean"] > 0
    assert arm["prompt_tokens_computed"] + arm["prompt_tokens_reused"] == prompt_tokens
    assert len(arm["ttft_s_sorted"]) == requests
    h = arm["hit_rate"]
    assert set(h) == {"device", "host", "storage", "total"}
    assert h["total"] == pytest.approx(h["device"] + h["host"] + h["storage"], abs=2e-4)
    assert h["total"] == pytest.approx(arm["prompt_tokens_reused"] / prompt_tokens, abs=1e-4)
    assert len(arm["hit_rate_per_round"]) == TINY.rounds


def test_arms_agree_and_report_every_field(result: dict[str, Any]) -> None:
    assert set(result) == TOP_KEYS, set(result) ^ TOP_KEYS
    assert tuple(result["arms"]) == tuple(ARMS) == SERVE_ARMS
    assert result["identical"] is True and result["errors"] == [] and not result["fatal"]
    same = result["identical_detail"]
    assert same["reference"] == "no-cache"
    for arm in SERVE_ARMS[1:]:
        assert same[arm]["differing"] == 0, (arm, same)  # greedy: token for token
    assert same["transformers"]["must_match"] is False
    wl = result["workload"]
    assert wl["requests"] == TINY.clients * TINY.rounds and wl["round_barrier"] is True
    assert wl["request_rate"] == 50.0 and wl["max_in_flight"] == TINY.max_in_flight
    cache = result["cache"]
    assert cache["working_set_pages"] > 0 and cache["host_pages"] >= cache["working_set_pages"]
    prompts = {a["input_tokens"] for a in result["arms"].values()}
    assert len(prompts) == 1  # the same requests on every arm
    for arm in result["arms"].values():
        check_arm(arm, wl["requests"], next(iter(prompts)))


def test_hit_rates_follow_each_arms_tiers(result: dict[str, Any]) -> None:
    arms = result["arms"]
    assert arms["no-cache"]["hit_rate"]["total"] == 0  # nothing reused, ever
    assert arms["no-cache"]["prompt_tokens_reused"] == 0
    dev = arms["device"]["hit_rate"]
    assert dev["device"] > 0 and dev["host"] == 0 and dev["storage"] == 0
    for name in ("device+host", "device+host+storage"):
        assert arms[name]["hit_rate"]["storage"] == 0  # a live cache never goes to storage
        assert arms[name]["hit_rate"]["total"] >= dev["total"]
    restart = arms["storage-restart"]
    assert restart["hit_rate"]["storage"] > 0
    assert restart["hit_rate_per_round"][0]["total"] > 0  # warm from storage from the start
    assert arms["device"]["hit_rate_per_round"][0]["host"] == 0
    tf = arms["transformers"]["hit_rate"]
    assert tf["host"] == 0 and tf["storage"] == 0  # its prefix sharing is one pool


def test_paced_drive_bounds_requests_in_flight() -> None:
    wl = bench.workload(TINY, 100)
    live = peak = 0

    async def serve(prompt: list[int]) -> Any:
        nonlocal live, peak
        live += 1
        peak = max(peak, live)
        await asyncio.sleep(0.002)
        live -= 1
        from aiocache_kv.bench.engine_sides import Served

        return Served([1, 2], 0.001, [0.001], 0.002, 0, len(prompt))

    turns = asyncio.run(paced_drive(wl, serve, Pacing(max_in_flight=2, request_rate=math.inf)))
    assert peak == 2 and len(turns) == wl.requests
    assert [(t.conversation, t.turn) for t in turns] == [
        (c, r) for c in range(TINY.clients) for r in range(TINY.rounds)
    ]
    second = [t.prompt_len for t in turns if t.turn == 1]
    first = [t.prompt_len for t in turns if t.turn == 0]
    assert all(b == a + 2 + TINY.user_tokens for a, b in zip(first, second, strict=True))


def test_bad_options_are_refused() -> None:
    with pytest.raises(InvalidInputError):
        bench.run(bench.ServeBenchOptions(arms=("storage-restart",), progress=False))
    with pytest.raises(InvalidInputError):
        bench.run(bench.ServeBenchOptions(arms=("nope",), progress=False))


def test_cli_runs_serve_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--serve-size", "tiny", "--clients", "2", "--rounds", "2",
            "--system-len", "16", "--user-len", "8", "--output-len", "3",
            "--arms", "device", "device+host", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    data = json.loads(out.read_text())["suites"]["serve"]
    assert list(data["arms"]) == ["device", "device+host"] and data["identical"]


def test_plot_without_matplotlib_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not importable
    png = tmp_path / "serve.png"
    assert main(["bench", "serve", "--plot", str(png)]) == 2
    assert bench.PLOT_HINT in capsys.readouterr().err and not png.exists()


def test_reply_token_ids_from_either_field() -> None:
    assert parse_tokens({"token_ids": [3, 4]}) == [3, 4]
    assert parse_tokens({"text": " 5 6 7"}) == [5, 6, 7]
    assert parse_tokens({"text": ""}) == []
    with pytest.raises(InvalidInputError):
        parse_tokens({"text": "hello"})


# ---------------------------------------------------------------------- --url


def test_url_mode_matches_in_process() -> None:
    """``--url`` against a live OpenAI-shaped server on 127.0.0.1 (an Engine behind
    ``POST /v1/completions``, streamed): the same replies as the in-process arms."""
    pytest.importorskip("aiohttp")
    from aiohttp import web

    from aiocache_kv.cache import HiCache
    from aiocache_kv.models import build_gpt2, cache_config_for
    from aiocache_kv.serving import Engine

    spec = SPECS["tiny"]["gpt2"]
    model = build_gpt2(spec)  # type: ignore[arg-type]
    wl = bench.workload(TINY, spec.vocab_size)  # type: ignore[union-attr]
    replies: dict[tuple[int, ...], list[int]] = {}

    async def scenario() -> Any:
        cfg = cache_config_for(model, page_size=4, device_pages=64, host_pages=0)
        async with HiCache(cfg) as cache, Engine(model, cache) as engine:

            async def completions(request: web.Request) -> web.StreamResponse:
                body = await request.json()
                assert body["stream"] is True and body["model"] == "tiny"
                r = await engine.generate(body["prompt"], max_new_tokens=body["max_tokens"])
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                for i, tok in enumerate(r.tokens):  # ids as text, or as token_ids
                    choice = {"text": f" {tok}"} if i % 2 else {"token_ids": [tok], "text": "x"}
                    await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
                details = {"cached_tokens": r.attribution.cached}
                usage = {"prompt_tokens": r.prompt_len, "prompt_tokens_details": details}
                await resp.write(
                    f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
                )
                await resp.write(b"data: [DONE]\n\n")
                replies[tuple(body["prompt"])] = r.tokens
                return resp

            async def models(request: web.Request) -> web.Response:
                return web.json_response({"data": [{"id": "tiny"}]})

            app = web.Application()
            app.router.add_post("/v1/completions", completions)
            app.router.add_get("/v1/models", models)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = runner.addresses[0][1]
            try:
                return await serve_url(f"http://127.0.0.1:{port}", wl, Pacing(max_in_flight=2))
            finally:
                await runner.cleanup()

    run = asyncio.run(scenario())
    assert run.error is None and len(run.turns) == wl.requests
    cfg = cache_config_for(model, page_size=4, device_pages=64, host_pages=0)
    local = asyncio.run(
        serve_engine_arm("device", model, wl, cfg, Pacing(), max_batch_tokens=64, max_running=4)
    )
    ref = {(t.conversation, t.turn): t.served.tokens for t in local.turns}
    assert len(ref) == wl.requests
    for t in run.turns:
        assert t.served.tokens == ref[(t.conversation, t.turn)], (t.conversation, t.turn)
        assert replies[tuple(t_prompt(wl, run.turns, t))] == t.served.tokens
        assert t.served.ttft > 0 and len(t.served.itl) == TINY.output_len - 1
    assert sum(t.served.reused for t in run.turns) > 0  # cached_tokens read from usage


def t_prompt(wl: Workload, turns: list[Turn], turn: Turn) -> list[int]:
    """The prompt ``turn`` sent: the system prompt, then each earlier round's message and
    reply, then this round's message."""
    prompt = list(wl.system)
    for r in range(turn.turn):
        prompt += wl.users[turn.conversation][r]
        prompt += next(
            x for x in turns if (x.conversation, x.turn) == (turn.conversation, r)
        ).served.tokens
    return prompt + wl.users[turn.conversation][turn.turn]


ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def example_server() -> Any:
    """``tests.e2e.test_server`` (which loads ``examples/server.py``), imported off the loop."""
    pytest.importorskip("aiohttp")
    pytest.importorskip("prometheus_client")
    from tests.e2e import test_server

    return test_server


@pytest.mark.skipif(
    "/v1/completions" not in (ROOT / "examples/server.py").read_text(),
    reason="examples/server.py has no OpenAI endpoints",
)
async def test_url_mode_against_the_example_server(tmp_path: Path, example_server: Any) -> None:
    """``--url`` against ``examples/server.py`` on 127.0.0.1 (started as its own tests do):
    the same replies as the engine in-process, with reuse reported through ``usage``."""
    from aiocache_kv.models import build_gpt2, cache_config_for
    from tests.e2e.conftest import SPEC

    wl = bench.workload(TINY, SPEC.vocab_size)
    srv = await example_server.start(example_server.options(tmp_path / "kv"))
    try:
        run = await serve_url(srv.url, wl, Pacing(max_in_flight=2, round_barrier=True))
    finally:
        await example_server.stop(srv)
    assert run.error is None and len(run.turns) == wl.requests
    assert run.extra["model"] == SPEC.name
    model = build_gpt2(SPEC)
    cfg = cache_config_for(model, page_size=8, device_pages=64, host_pages=0)
    local = await serve_engine_arm(
        "device", model, wl, cfg, Pacing(), max_batch_tokens=64, max_running=4
    )
    ref = {(t.conversation, t.turn): t.served.tokens for t in local.turns}
    for t in run.turns:
        assert t.served.tokens == ref[(t.conversation, t.turn)], (t.conversation, t.turn)
        assert t.served.ttft > 0 and len(t.served.itl) == TINY.output_len - 1
    assert sum(t.served.reused for t in run.turns) > 0  # usage.prompt_tokens_details


def test_unreachable_server_is_reported_and_fatal() -> None:
    opts = bench.ServeBenchOptions(**{**TINY.__dict__, "url": "http://127.0.0.1:9"})
    res = bench.run(opts)
    assert res["fatal"] and res["errors"] and "error" in res["arms"]["server"]
