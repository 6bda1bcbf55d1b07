"""``examples/server.py`` over real HTTP on 127.0.0.1: generate, health, metrics, restarts."""

from __future__ import annotations

import asyncio
import importlib.util
import io
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import aiocache_kv as akv
from aiocache_kv.models import reference_generate
from tests.e2e.conftest import SPEC, random_tokens

aiohttp = pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")
from aiohttp import web  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def load_server() -> ModuleType:
    spec = importlib.util.spec_from_file_location("example_server", ROOT / "examples/server.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["example_server"] = mod
    spec.loader.exec_module(mod)
    return mod


server_mod = load_server()


class Running:
    def __init__(self, runner: web.AppRunner, url: str, session: aiohttp.ClientSession) -> None:
        self.runner = runner
        self.url = url
        self.session = session

    async def post(self, path: str, body: Any) -> tuple[int, Any]:
        async with self.session.post(self.url + path, json=body) as r:
            return r.status, await r.json()

    async def get_json(self, path: str) -> Any:
        async with self.session.get(self.url + path) as r:
            assert r.status == 200
            return await r.json()

    async def get_text(self, path: str) -> str:
        async with self.session.get(self.url + path) as r:
            assert r.status == 200
            assert r.content_type == "text/plain"
            text: str = await r.text()
            return text


def options(storage_dir: Path, **kw: Any) -> Any:
    opts = dict(
        host="127.0.0.1",
        port=0,
        model=SPEC,
        page_size=8,
        device_pages=32,
        host_pages=64,
        storage="file",
        storage_dir=str(storage_dir),
        max_new_tokens=32,
    )
    opts.update(kw)
    return server_mod.ServerOptions(**opts)


async def start(opts: Any) -> Running:
    runner = web.AppRunner(server_mod.make_app(opts), **server_mod.runner_kwargs(opts))
    await runner.setup()
    site = web.TCPSite(runner, opts.host, opts.port)
    await site.start()
    host, port = runner.addresses[0][:2]
    assert host == "127.0.0.1"
    return Running(runner, f"http://{host}:{port}", aiohttp.ClientSession())


async def stop(srv: Running) -> None:
    await srv.session.close()
    await srv.runner.cleanup()


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Running]:
    srv = await start(options(tmp_path / "kv"))
    try:
        yield srv
    finally:
        await stop(srv)


def parse(text: str) -> dict[str, tuple[str, dict[tuple[str, frozenset[tuple[str, str]]], float]]]:
    """family name -> (type, {(sample name, labels): value}), parsed by prometheus_client."""
    out = {}
    for fam in text_string_to_metric_families(text):
        samples = {(s.name, frozenset(s.labels.items())): s.value for s in fam.samples}
        out[fam.name] = (fam.type, samples)
    return out


def metric(text: str, sample: str) -> float:
    """The value of ``sample``, written ``name`` or ``name{a="x",b="y"}`` (any label order)."""
    name, _, rest = sample.partition("{")
    labels = frozenset(
        (k, v.strip('"')) for k, v in (kv.split("=", 1) for kv in rest.rstrip("}").split(",") if kv)
    )
    for _, samples in parse(text).values():
        if (name, labels) in samples:
            return samples[(name, labels)]
    raise AssertionError(f"{sample} not in metrics:\n{text}")


async def test_generate_health_metrics(server: Running, gpt2: Any) -> None:
    health = await server.get_json("/health")
    assert health["status"] == "ok" and health["device_pages"]["total"] == 32
    prompt = random_tokens(30, 45)
    status, first = await server.post("/generate", {"tokens": prompt, "max_new_tokens": 5})
    assert status == 200, first
    assert first["tokens"] == reference_generate(gpt2, prompt, 5).tokens
    assert first["cached_tokens"] == {"device": 0, "host": 0, "storage": 0}
    turn2 = prompt + first["tokens"] + random_tokens(31, 7)
    status, second = await server.post("/generate", {"tokens": turn2, "max_new_tokens": 5})
    assert status == 200, second
    assert second["tokens"] == reference_generate(gpt2, turn2, 5).tokens
    assert second["cached_tokens"]["device"] == 48  # prompt + reply[:-1] = 49 -> 6 pages
    assert second["computed_tokens"] == len(turn2) - 48
    assert second["ttft_ms"] > 0 and second["total_ms"] >= second["ttft_ms"]

    text = await server.get_text("/metrics")
    assert "# TYPE aiocache_kv_ttft_seconds histogram" in text
    assert metric(text, 'aiocache_kv_requests_total{outcome="ok"}') == 2
    assert metric(text, 'aiocache_kv_prompt_tokens_total{source="device"}') == 48
    assert (
        metric(text, 'aiocache_kv_prompt_tokens_total{source="computed"}') == 45 + len(turn2) - 48
    )
    assert metric(text, "aiocache_kv_ttft_seconds_count") == 2
    assert metric(text, 'aiocache_kv_pool_pages{tier="device",state="total"}') == 32
    assert metric(text, "aiocache_kv_events_published_total") > 0
    assert metric(text, 'aiocache_kv_transfer_bytes_total{direction="device_to_host"}') > 0
    # the engine inserts pages as they complete: request 1 at 40 (prefill) and 48 tokens
    # (decode), request 2 at 56 (prefill); each insert with new pages writes them through
    assert metric(text, "aiocache_kv_write_through_seconds_count") == 3
    await asyncio.sleep(0.05)  # let the events drain task run
    text = await server.get_text("/metrics")
    assert metric(text, 'aiocache_kv_events_total{type="BlockStored",medium="GPU"}') >= 2


async def test_bad_requests(server: Running) -> None:
    for body in (
        {"tokens": []},
        {"tokens": [1, -2]},
        {"tokens": [SPEC.vocab_size]},
        {"tokens": [1, 2], "max_new_tokens": 0},
        {"tokens": [1, 2], "max_new_tokens": 33},
        [1, 2, 3],
        {"tokens": [1, True]},  # a bool is no token id
        {"tokens": [1, 2.0]},
        {"tokens": [1, "2"]},
        {"tokens": {"0": 1}},
        {"tokens": [1, 2], "max_new_tokens": True},
        {"tokens": [1, 2], "max_new_tokens": 4.0},
        {"tokens": [1, 2], "max_new_tokens": None},
        {"tokens": [1] * SPEC.n_positions},  # no room for a reply in the context
        {"tokens": [1] * (SPEC.n_positions - 4), "max_new_tokens": 5},
        "tokens",
    ):
        status, reply = await server.post("/generate", body)
        assert status == 400 and isinstance(reply["error"], str), body
    text = await server.get_text("/metrics")
    assert metric(text, 'aiocache_kv_requests_total{outcome="bad_request"}') == 16


async def test_generate_priority_fields(server: Running) -> None:
    for body in (
        {"tokens": [1, 2], "priority": -1},
        {"tokens": [1, 2], "priority": 1001},
        {"tokens": [1, 2], "priority": True},
        {"tokens": [1, 2], "priority": "high"},
        {"tokens": [1, 2], "priority": 5, "retention_seconds": 0},
        {"tokens": [1, 2], "priority": 5, "retention_seconds": 1e300},
        {"tokens": [1, 2], "priority": 5, "retention_seconds": "1m"},
    ):
        status, reply = await server.post("/generate", body)
        assert status == 400 and (
            "priority" in reply["error"] or "retention_seconds" in reply["error"]
        ), reply
    status, reply = await server.post(
        "/generate", {"tokens": [1, 2, 3, 4, 5], "priority": 9, "retention_seconds": 30}
    )
    assert status == 200, reply


async def test_concurrent_requests_and_health_while_busy(server: Running, gpt2: Any) -> None:
    system = random_tokens(40, 32)
    prompts = [system + random_tokens(41 + i, 10 + 3 * i) for i in range(4)]
    tasks = [
        asyncio.create_task(server.post("/generate", {"tokens": p, "max_new_tokens": 6}))
        for p in prompts
    ]
    health = await server.get_json("/health")  # the loop serves while forwards run
    assert health["status"] == "ok"
    results = await asyncio.gather(*tasks)
    for p, (status, reply) in zip(prompts, results, strict=True):
        assert status == 200, reply
        assert reply["tokens"] == reference_generate(gpt2, p, 6).tokens


async def test_concurrent_requests_are_batched_and_identical(server: Running, gpt2: Any) -> None:
    """Six requests sharing a system prompt, sent at once: each is answered exactly as the
    model alone answers it, and the engine ran them in shared forward passes (fewer passes
    than tokens generated; no token computed twice)."""
    system = random_tokens(80, 24)
    prompts = [system + random_tokens(81 + i, 9 + 2 * i) for i in range(6)]
    replies = await asyncio.gather(
        *(server.post("/generate", {"tokens": p, "max_new_tokens": 6}) for p in prompts)
    )
    for p, (status, reply) in zip(prompts, replies, strict=True):
        assert status == 200, reply
        assert reply["tokens"] == reference_generate(gpt2, p, 6).tokens
        assert sum(reply["cached_tokens"].values()) + reply["computed_tokens"] == len(p)
    assert sum(r["cached_tokens"]["device"] for _, r in replies) >= 5 * 24  # the system prompt
    generated = sum(len(r["tokens"]) for _, r in replies)
    text = await server.get_text("/metrics")
    steps = metric(text, "aiocache_kv_engine_steps_total")
    assert 0 < steps < generated  # forward passes served several requests each
    assert metric(text, "aiocache_kv_engine_batch_size_sum") > steps
    assert metric(text, 'aiocache_kv_engine_batch_size_bucket{le="1.0"}') < steps
    assert metric(text, "aiocache_kv_engine_preemptions_total") == 0
    computed = sum(r["computed_tokens"] for _, r in replies)
    assert metric(text, "aiocache_kv_engine_step_tokens_total") == computed + generated - 6
    assert metric(text, 'aiocache_kv_engine_requests{state="running"}') == 0
    assert metric(text, 'aiocache_kv_prompt_tokens_total{source="computed"}') == computed
    assert metric(text, "aiocache_kv_admission_wait_seconds_count") == 6
    health = await server.get_json("/health")
    assert health["requests"] == {"waiting": 0, "admitting": 0, "running": 0}


async def test_restarted_server_serves_from_storage(tmp_path: Path, gpt2: Any) -> None:
    prompt = random_tokens(50, 70)
    srv = await start(options(tmp_path / "kv"))
    try:
        status, reply = await srv.post("/generate", {"tokens": prompt, "max_new_tokens": 4})
        assert status == 200, reply
    finally:
        await stop(srv)  # flushes: every page is in storage
    srv = await start(options(tmp_path / "kv"))
    try:
        turn2 = prompt + reply["tokens"] + random_tokens(51, 9)
        status, again = await srv.post("/generate", {"tokens": turn2, "max_new_tokens": 4})
        assert status == 200, again
        assert again["cached_tokens"] == {"device": 0, "host": 0, "storage": 72}
        assert again["tokens"] == reference_generate(gpt2, turn2, 4).tokens
        text = await srv.get_text("/metrics")
        assert metric(text, 'aiocache_kv_prompt_tokens_total{source="storage"}') == 72
        # one prefetch on arrival (it loads the pages), one on admission (nothing left to load)
        assert metric(text, "aiocache_kv_prefetch_seconds_count") == 2
        assert metric(text, 'aiocache_kv_transfer_bytes_total{direction="storage_to_host"}') > 0
        assert metric(text, "aiocache_kv_storage_served_requests_total") == 1
    finally:
        await stop(srv)


async def test_queued_request_prefetches_on_arrival(tmp_path: Path, gpt2: Any) -> None:
    """The prefetch pattern: a returning prompt queued behind a running request is
    prefetched while it waits, generated on admission, and its prompt tokens are attributed
    to storage (cached + computed = prompt); the storage-served counter counts it once."""
    prompt = random_tokens(60, 70)
    srv = await start(options(tmp_path / "kv"))
    try:
        status, reply = await srv.post("/generate", {"tokens": prompt, "max_new_tokens": 2})
        assert status == 200, reply
    finally:
        await stop(srv)
    srv = await start(options(tmp_path / "kv", max_running=1))
    try:
        other = random_tokens(61, 40)  # a stranger: computed, holds the only slot
        turn2 = prompt + random_tokens(62, 9)
        (s1, r1), (s2, r2) = await asyncio.gather(
            srv.post("/generate", {"tokens": other, "max_new_tokens": 24}),
            srv.post("/generate", {"tokens": turn2, "max_new_tokens": 4}),
        )
        assert (s1, s2) == (200, 200), (r1, r2)
        assert r1["cached_tokens"] == {"device": 0, "host": 0, "storage": 0}
        assert r2["cached_tokens"] == {"device": 0, "host": 0, "storage": 64}
        assert r2["computed_tokens"] + 64 == len(turn2)
        assert r2["tokens"] == reference_generate(gpt2, turn2, 4).tokens
        text = await srv.get_text("/metrics")
        assert metric(text, "aiocache_kv_storage_served_requests_total") == 1
        assert metric(text, "aiocache_kv_admission_wait_seconds_count") == 2
        assert metric(text, 'aiocache_kv_prompt_tokens_total{source="storage"}') == 64
    finally:
        await stop(srv)


def test_max_running_must_be_positive() -> None:
    with pytest.raises(SystemExit):
        server_mod.parse_args(["--max-running", "0"])
    assert server_mod.parse_args(["--max-running", "2"]).max_running == 2
    with pytest.raises(SystemExit):
        server_mod.parse_args(["--max-batch-tokens", "0"])
    assert server_mod.parse_args(["--max-batch-tokens", "64"]).max_batch_tokens == 64


VALID = b'{"tokens": [1, 2, 3], "max_new_tokens": 1}'
JSON = "application/json"
MiB = 1 << 20
OVERSIZED = b'{"tokens": [' + b"1, " * (MiB // 3) + b"1]}"  # just over 1 MiB


async def chunked(body: bytes, size: int = 64 << 10) -> AsyncIterator[bytes]:
    """``body`` as a chunked upload (no Content-Length: the server must bound the read)."""
    for i in range(0, len(body), size):
        yield body[i : i + size]


# (body, Content-Type, extra headers, status, a word the error names); "*_chunked": no length
HOSTILE: dict[str, tuple[bytes, str, dict[str, str], int, str]] = {
    "deep_nesting": (b"[" * 100_000, JSON, {}, 400, "deep"),
    "deep_nesting_in_field": (b'{"tokens": ' + b"[" * 100_000, JSON, {}, 400, "deep"),
    "5000_digit_int": (
        b'{"tokens": [1], "max_new_tokens": ' + b"9" * 5000 + b"}",
        JSON,
        {},
        400,
        "digits",
    ),
    "5000_digit_token": (b'{"tokens": [' + b"7" * 5000 + b"]}", JSON, {}, 400, "digits"),
    "invalid_utf8": (b'{"tokens": [1, 2], "x": "\xff\xfe"}', JSON, {}, 400, "utf-8"),
    "unknown_charset": (VALID, JSON + "; charset=x-unknown", {}, 415, "charset"),
    "non_text_codec_charset": (VALID, JSON + "; charset=base64", {}, 415, "charset"),
    "text_plain": (VALID, "text/plain", {}, 415, "content type"),
    "form_urlencoded": (VALID, "application/x-www-form-urlencoded", {}, 415, "content type"),
    "corrupt_gzip": (b"not gzip at all", JSON, {"Content-Encoding": "gzip"}, 400, "body"),
    "oversized": (OVERSIZED, JSON, {}, 413, "1048576"),
    "oversized_chunked": (OVERSIZED, JSON, {}, 413, "1048576"),  # no Content-Length
    "unknown_field": (b'{"tokens": [1, 2], "max_tokens": 4}', JSON, {}, 400, "max_tokens"),
    "nan": (b'{"tokens": [1, 2], "max_new_tokens": NaN}', JSON, {}, 400, "NaN"),
    # 300 + 32 - 1 KV slots > the 32 device pages x 8 of the test server (fits 512 positions)
    "exceeds_device_pool": (
        b'{"tokens": [' + b"1, " * 299 + b'1], "max_new_tokens": 32}',
        JSON,
        {},
        400,
        "pool",
    ),
}


@pytest.mark.parametrize("case", list(HOSTILE))
async def test_hostile_body_gets_4xx_and_server_keeps_serving(server: Running, case: str) -> None:
    body, content_type, extra, want_status, word = HOSTILE[case]
    headers = {"Content-Type": content_type, **extra}
    # (a BytesIO for the big one: aiohttp warns about sending over 1 MiB of raw bytes)
    data: Any = chunked(body) if case.endswith("_chunked") else body
    if len(body) > MiB and isinstance(data, bytes):
        data = io.BytesIO(body)
    async with server.session.post(
        server.url + "/generate", data=data, headers=headers, skip_auto_headers=["Content-Type"]
    ) as r:
        assert r.status == want_status, await r.text()
        assert r.content_type == JSON
        reply = await r.json()
    assert isinstance(reply["error"], str) and word.lower() in reply["error"].lower(), reply
    text = await server.get_text("/metrics")
    assert metric(text, 'aiocache_kv_requests_total{outcome="bad_request"}') == 1
    async with server.session.post(
        server.url + "/generate", data=VALID, headers={"Content-Type": JSON}
    ) as r:
        assert r.status == 200, await r.text()
        assert len((await r.json())["tokens"]) == 1


async def test_body_limit_is_configurable(tmp_path: Path) -> None:
    srv = await start(options(tmp_path / "kv", max_body_bytes=len(VALID)))
    try:
        big = VALID[:-1] + b" }"  # one byte over the limit
        async with srv.session.post(
            srv.url + "/generate", data=big, headers={"Content-Type": JSON}
        ) as r:
            assert r.status == 413 and str(len(VALID)) in (await r.json())["error"]
        async with srv.session.post(
            srv.url + "/generate", data=VALID, headers={"Content-Type": JSON}
        ) as r:
            assert r.status == 200, await r.text()
    finally:
        await stop(srv)


async def test_default_max_new_tokens_within_server_limit(tmp_path: Path) -> None:
    srv = await start(options(tmp_path / "kv", max_new_tokens=4))  # below the default of 16
    try:
        status, reply = await srv.post("/generate", {"tokens": [1, 2, 3]})
        assert status == 200, reply
        assert len(reply["tokens"]) == 4
    finally:
        await stop(srv)


# ---------------------------------------------------------------------------- library metrics

LIBRARY_FAMILIES = {
    # family (as the parser names it) -> (type, label names besides none)
    "aiocache_kv_match_queries": ("counter", set()),
    "aiocache_kv_hit_tokens": ("counter", {"tier"}),
    "aiocache_kv_prompts": ("counter", set()),
    "aiocache_kv_prompt_tokens": ("counter", {"source"}),
    "aiocache_kv_transfer_bytes": ("counter", {"direction"}),
    "aiocache_kv_copies_started": ("counter", {"direction"}),
    "aiocache_kv_copies_finished": ("counter", {"direction", "outcome"}),
    "aiocache_kv_storage_pages": ("counter", {"op"}),
    "aiocache_kv_storage_errors": ("counter", set()),
    "aiocache_kv_evicted_pages": ("counter", {"tier"}),
    "aiocache_kv_pool_pages": ("gauge", {"tier", "state"}),
    "aiocache_kv_operations_in_flight": ("gauge", {"kind"}),
    "aiocache_kv_event_queue_depth": ("gauge", set()),
    "aiocache_kv_load_back_seconds": ("histogram", {"le"}),
    "aiocache_kv_write_through_seconds": ("histogram", {"le"}),
    "aiocache_kv_write_back_seconds": ("histogram", {"le"}),
    "aiocache_kv_backup_seconds": ("histogram", {"le"}),
    "aiocache_kv_prefetch_seconds": ("histogram", {"le"}),
}


def prompt_sources(text: str) -> dict[str, float]:
    return {
        src: metric(text, f'aiocache_kv_prompt_tokens_total{{source="{src}"}}')
        for src in ("device", "host", "storage", "computed")
    }


async def test_metrics_scrape_parses_and_moves_per_tier(tmp_path: Path) -> None:
    """The library's families over a real socket: names, types, labels; values follow the
    requests as they hit device, then host, then (after a restart) storage."""
    srv = await start(options(tmp_path / "kv"))
    sent = 0
    try:
        text = await srv.get_text("/metrics")
        fams = parse(text)
        for name, (kind, labels) in LIBRARY_FAMILIES.items():
            assert name in fams, name
            got_kind, samples = fams[name]
            assert got_kind == kind, (name, got_kind)
            for sample_name, sample_labels in samples:
                assert sample_name.startswith(name)
                if not sample_name.endswith(("_sum", "_count")):
                    assert {k for k, _ in sample_labels} == labels, (name, sample_labels)
        assert set(prompt_sources(text).values()) == {0}
        assert metric(text, 'aiocache_kv_pool_pages{tier="host",state="total"}') == 64

        prompt = random_tokens(60, 41)
        status, r1 = await srv.post("/generate", {"tokens": prompt, "max_new_tokens": 4})
        assert status == 200, r1
        sent += len(prompt)
        text = await srv.get_text("/metrics")
        assert metric(text, "aiocache_kv_write_through_seconds_count") == 1
        assert metric(text, 'aiocache_kv_hit_tokens_total{tier="device"}') == 0
        assert prompt_sources(text)["computed"] == len(prompt)

        turn2 = prompt + r1["tokens"] + random_tokens(61, 5)  # device hit: 44 -> 40
        status, r2 = await srv.post("/generate", {"tokens": turn2, "max_new_tokens": 4})
        assert status == 200, r2
        sent += len(turn2)
        assert r2["cached_tokens"] == {"device": 40, "host": 0, "storage": 0}
        text = await srv.get_text("/metrics")
        assert metric(text, 'aiocache_kv_hit_tokens_total{tier="device"}') == 40
        assert prompt_sources(text)["device"] == 40

        cache = srv.runner.app[server_mod.SERVER].cache
        await srv.post("/flush", {})
        evicted = cache.evict(cache.statistics().device.evictable_pages)
        assert evicted > 0
        turn3 = turn2 + r2["tokens"] + random_tokens(62, 3)
        status, r3 = await srv.post("/generate", {"tokens": turn3, "max_new_tokens": 4})
        assert status == 200, r3
        sent += len(turn3)
        assert r3["cached_tokens"]["host"] > 0
        text = await srv.get_text("/metrics")
        assert metric(text, 'aiocache_kv_evicted_pages_total{tier="device"}') >= evicted
        assert (
            metric(text, 'aiocache_kv_hit_tokens_total{tier="host"}') == r3["cached_tokens"]["host"]
        )
        assert metric(text, "aiocache_kv_load_back_seconds_count") >= 1
        assert metric(text, 'aiocache_kv_transfer_bytes_total{direction="host_to_device"}') > 0
        assert metric(text, 'aiocache_kv_copies_finished_total{direction="host_to_device",'
                      'outcome="ok"}') >= 1  # fmt: skip
        assert sum(prompt_sources(text).values()) == sent
        assert metric(text, "aiocache_kv_prompts_total") == 3
    finally:
        await stop(srv)  # flushes: every page is in storage
    srv = await start(options(tmp_path / "kv"))
    try:
        turn4 = turn3 + r3["tokens"] + random_tokens(63, 2)
        status, r4 = await srv.post("/generate", {"tokens": turn4, "max_new_tokens": 2})
        assert status == 200, r4
        assert r4["cached_tokens"]["storage"] > 0
        text = await srv.get_text("/metrics")
        src = prompt_sources(text)
        assert src["storage"] == r4["cached_tokens"]["storage"]
        assert sum(src.values()) == len(turn4)
        assert metric(text, 'aiocache_kv_hit_tokens_total{tier="storage"}') > 0
        assert metric(text, "aiocache_kv_prefetch_seconds_count") == 1
        assert metric(text, 'aiocache_kv_transfer_bytes_total{direction="storage_to_host"}') > 0
        await srv.post("/flush", {})
        text = await srv.get_text("/metrics")
        assert metric(text, "aiocache_kv_backup_seconds_count") >= 1
        assert metric(text, 'aiocache_kv_storage_pages_total{op="backup_ok"}') > 0
        assert metric(text, 'aiocache_kv_transfer_bytes_total{direction="host_to_storage"}') > 0
    finally:
        await stop(srv)


async def test_cached_plus_computed_is_the_prompt(server: Running) -> None:
    """A page-aligned prompt sent twice: its last page is recomputed, so it is not cached."""
    prompt = random_tokens(70, 32)  # 4 whole pages of 8
    status, first = await server.post("/generate", {"tokens": prompt, "max_new_tokens": 2})
    assert status == 200, first
    status, again = await server.post("/generate", {"tokens": prompt, "max_new_tokens": 2})
    assert status == 200, again
    assert again["cached_tokens"] == {"device": 24, "host": 0, "storage": 0}
    assert again["computed_tokens"] == 8
    assert sum(again["cached_tokens"].values()) + again["computed_tokens"] == len(prompt)
    text = await server.get_text("/metrics")
    src = prompt_sources(text)
    assert src == {"device": 24, "host": 0, "storage": 0, "computed": 32 + 8}
    assert sum(src.values()) == 2 * len(prompt)


async def test_metrics_off_the_loop_thread_is_refused(server: Running) -> None:
    """The registry reads loop-owned state: a scrape from another thread raises."""
    from prometheus_client import generate_latest

    app_server = server.runner.app[server_mod.SERVER]
    with pytest.raises(akv.OwnershipError):
        await asyncio.to_thread(generate_latest, app_server.registry)


async def test_cache_admin_pin_unpin_warm(tmp_path: Path, gpt2: Any) -> None:
    """``/cache/pin``, ``/cache/unpin`` and ``/cache/warm`` (examples/cache_admin.py)."""
    prompt = random_tokens(40, 32)
    srv = await start(options(tmp_path / "kv"))
    try:
        status, out = await srv.post("/generate", {"tokens": prompt, "max_new_tokens": 2})
        assert status == 200, out
        status, pin = await srv.post("/cache/pin", {"tokens": prompt, "ttl": 30})
        assert status == 200, pin
        assert pin["tier"] == "device" and pin["pinned_len"] == 32 and pin["pages"] == 4
        assert 0 < pin["expires_in_s"] <= 30
        for body, want in (
            ({"tokens": prompt, "ttl": -1}, 400),
            ({"tokens": prompt, "ttl": 30, "tier": "storage"}, 400),
            ({"tokens": random_tokens(41, 16), "ttl": 30}, 404),  # not cached
            ({"tokens": prompt}, 400),
            ({"tokens": prompt, "ttl": 30, "bogus": 1}, 400),
        ):
            status, err = await srv.post("/cache/pin", body)
            assert status == want, (body, err)
        status, out = await srv.post("/cache/unpin", {"pin_id": pin["pin_id"]})
        assert (status, out) == (200, {"released": True})
        status, out = await srv.post("/cache/unpin", {"pin_id": pin["pin_id"]})
        assert status == 404, out
        await srv.post("/flush", {})
    finally:
        await stop(srv)
    srv = await start(options(tmp_path / "kv"))  # a restart: the prompt is only in storage
    try:
        status, res = await srv.post("/cache/warm", {"tokens": prompt, "timeout": 10})
        assert status == 200, res
        assert res["device_len"] == 32 and res["storage_tokens"] == 32, res
        assert not res["timed_out"]
        status, err = await srv.post("/cache/warm", {"tokens": prompt, "timeout": "soon"})
        assert status == 400, err
    finally:
        await stop(srv)
