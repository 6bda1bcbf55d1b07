"""``examples/server.py`` against clients that misbehave: clients that leave (mid-body, while
queued, after the last chunk), slow clients, unknown routes, bad flags and bad admin bodies."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import SPEC

pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")

from tests.e2e.test_server import Running, metric, options, server_mod, start, stop

OUTCOMES = ("ok", "bad_request", "error")


def served(srv: Running) -> Any:
    return srv.runner.app[server_mod.SERVER]


async def requests_by_outcome(srv: Running) -> dict[str, float]:
    text = await srv.get_text("/metrics")
    return {o: metric(text, f'aiocache_kv_requests_total{{outcome="{o}"}}') for o in OUTCOMES}


async def generated(srv: Running) -> float:
    return metric(await srv.get_text("/metrics"), "aiocache_kv_generated_tokens_total")


async def connect(srv: Running) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = srv.url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


def head(path: str, length: int) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


async def until(cond: Any, timeout: float = 30.0) -> None:
    """Poll ``cond()`` (sync) every 10 ms until it is true."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "not in time"
        await asyncio.sleep(0.01)


def engine_idle(srv: Running) -> bool:
    st = served(srv).engine.statistics()
    return st.waiting + st.admitting + st.running == 0


# ---------------------------------------------------------------------------- disconnects


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
async def test_non_streaming_client_that_leaves_is_aborted(tmp_path: Path, path: str) -> None:
    """A non-streaming request whose client disconnected is aborted then (the handler is
    cancelled), not run to the end for nobody; counted once, as an error."""
    srv = await start(
        options(tmp_path / "kv", max_running=1, max_new_tokens=400, device_pages=80, host_pages=160)
    )
    try:
        engine = served(srv).engine
        blocker = asyncio.create_task(  # holds the one running slot a while
            srv.post("/generate", {"tokens": list(range(1, 41)), "max_new_tokens": 400})
        )
        await until(lambda: engine.statistics().running == 1)
        key = "prompt" if path == "/v1/completions" else "tokens"
        budget = "max_tokens" if path == "/v1/completions" else "max_new_tokens"
        body = json.dumps({key: list(range(100, 140)), budget: 50}).encode()
        _, writer = await connect(srv)
        writer.write(head(path, len(body)) + body)
        await writer.drain()
        await until(lambda: engine.statistics().submitted == 2)
        writer.transport.abort()  # the client leaves (while its request queues, likely)
        await until(lambda: engine.statistics().aborted == 1)
        status, reply = await blocker
        assert status == 200, reply
        await until(lambda: engine_idle(srv))
        assert await requests_by_outcome(srv) == {"ok": 1, "bad_request": 0, "error": 1}
        assert await generated(srv) == 400  # the blocker's only
        health = await srv.get_json("/health")
        assert health["requests"] == {"waiting": 0, "admitting": 0, "running": 0}
    finally:
        await stop(srv)


async def test_stream_client_leaving_after_last_chunk_is_counted_once(tmp_path: Path) -> None:
    """Clients that read the ``finish_reason: "length"`` chunk and drop the connection before
    the usage chunk and ``[DONE]``: each request counted exactly once."""
    srv = await start(options(tmp_path / "kv", max_running=8))
    n = 30

    async def one(i: int) -> None:
        body = {
            "prompt": [i + 1, 5, 6],
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        raw = json.dumps(body).encode()
        reader, writer = await connect(srv)
        writer.write(head("/v1/completions", len(raw)) + raw)
        while True:
            line = await reader.readline()
            if not line or b'"finish_reason": "length"' in line:
                break
        writer.transport.abort()

    try:
        await asyncio.gather(*(one(i) for i in range(n)))
        await until(lambda: engine_idle(srv))
        await asyncio.sleep(0.2)  # the handlers see the disconnects
        counts = await requests_by_outcome(srv)
        assert sum(counts.values()) == n, counts
        assert counts["bad_request"] == 0
    finally:
        await stop(srv)


async def test_stream_client_leaving_before_usage_is_counted_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same, made certain: the token stream ends (and the usage chunk would follow) only
    after the client has read the last chunk and left."""
    srv = await start(options(tmp_path / "kv"))
    engine = served(srv).engine
    open_stream = engine.open_stream
    gate = asyncio.Event()

    class Gated:
        def __init__(self, stream: Any) -> None:
            self.stream = stream

        async def tokens(self) -> Any:
            async for token in self.stream.tokens():
                yield token
            await gate.wait()

        def __getattr__(self, name: str) -> Any:
            return getattr(self.stream, name)

    monkeypatch.setattr(engine, "open_stream", lambda *a, **kw: Gated(open_stream(*a, **kw)))
    try:
        body = {"prompt": [1, 2, 3], "max_tokens": 3, "stream": True}
        raw = json.dumps({**body, "stream_options": {"include_usage": True}}).encode()
        reader, writer = await connect(srv)
        writer.write(head("/v1/completions", len(raw)) + raw)
        while b'"finish_reason": "length"' not in await reader.readline():
            pass
        writer.transport.abort()
        await asyncio.sleep(0.2)  # the server sees the disconnect
        gate.set()
        await until(lambda: engine_idle(srv))
        await asyncio.sleep(0.2)
        counts = await requests_by_outcome(srv)
        assert counts == {"ok": 0, "bad_request": 0, "error": 1}, counts
    finally:
        await stop(srv)


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/cache/warm"])
async def test_client_dropping_mid_body_ends_quietly(
    tmp_path: Path, path: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A client that leaves halfway through its body: no "Error handling request" traceback
    from aiohttp, the request counted as an error, and the server keeps serving."""
    srv = await start(options(tmp_path / "kv"))
    try:
        before = await requests_by_outcome(srv)
        with caplog.at_level(logging.DEBUG, logger="aiohttp"):
            _, writer = await connect(srv)
            writer.write(head(path, 100) + b'{"tokens"')
            await writer.drain()
            await asyncio.sleep(0.2)  # the handler is reading the body
            writer.transport.abort()
            await asyncio.sleep(0.3)
            status, _ = await srv.post("/generate", {"tokens": [1, 2, 3], "max_new_tokens": 1})
            assert status == 200
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert not errors, [r.getMessage() for r in errors]
        after = await requests_by_outcome(srv)
        if path != "/cache/warm":  # the admin routes count no requests
            assert after["error"] == before["error"] + 1, (before, after)
        assert after["bad_request"] == before["bad_request"]
    finally:
        await stop(srv)


# ---------------------------------------------------------------------------- slow clients


async def test_body_must_arrive_within_read_timeout(tmp_path: Path) -> None:
    """A body that stops arriving gets a 408 (JSON) after ``--read-timeout``, and the
    connection is closed; other clients are served meanwhile."""
    srv = await start(options(tmp_path / "kv", read_timeout=0.5))
    try:
        reader, writer = await connect(srv)
        writer.write(head("/v1/completions", 100) + b'{"prompt"')
        await writer.drain()
        status, _ = await srv.post("/generate", {"tokens": [1, 2, 3], "max_new_tokens": 1})
        assert status == 200
        async with asyncio.timeout(10):
            reply = await reader.read()  # to EOF: the server closes the connection
        status_line, _, rest = reply.partition(b"\r\n")
        assert status_line == b"HTTP/1.1 408 Request Timeout", reply
        body = json.loads(rest.partition(b"\r\n\r\n")[2])
        assert "0.5 s" in body["error"]["message"]
        writer.close()
        assert (await requests_by_outcome(srv))["bad_request"] == 1
    finally:
        await stop(srv)


async def test_unfinished_headers_are_timed_out(tmp_path: Path) -> None:
    """Headers that never finish: the connection is closed after ``--read-timeout``."""
    srv = await start(options(tmp_path / "kv", read_timeout=0.5))
    try:
        reader, writer = await connect(srv)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # no blank line
        await writer.drain()
        async with asyncio.timeout(10):
            assert await reader.read() == b""  # closed without a reply
        writer.close()
    finally:
        await stop(srv)


# ---------------------------------------------------------------------------- JSON errors


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/v1/chat/completions", 404),
        ("POST", "/v1/chat/completions", 404),
        ("GET", "/v1/completions", 405),
        ("DELETE", "/generate", 405),
    ],
)
async def test_unknown_routes_and_methods_get_json_errors(
    tmp_path: Path, method: str, path: str, status: int
) -> None:
    srv = await start(options(tmp_path / "kv"))
    try:
        async with srv.session.request(method, srv.url + path, json={}) as r:
            assert r.status == status
            assert r.content_type == "application/json"
            err = (await r.json())["error"]
            if status == 405:
                assert r.headers["Allow"] == "POST"
        assert err["type"] == "invalid_request_error"
        assert path in err["message"] and method in err["message"]
        assert set(err) == {"message", "type", "param", "code"}
    finally:
        await stop(srv)


@pytest.fixture
def openai() -> Any:
    """The ``openai`` package, imported off the event loop."""
    return pytest.importorskip("openai")


async def test_openai_client_reads_unknown_route_error(tmp_path: Path, openai: Any) -> None:
    srv = await start(options(tmp_path / "kv"))
    client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    try:
        with pytest.raises(openai.NotFoundError) as info:
            await client.chat.completions.create(
                model=SPEC.name, messages=[{"role": "user", "content": "hi"}]
            )
        assert "/v1/chat/completions" in info.value.message
        assert info.value.body["type"] == "invalid_request_error"
        with pytest.raises(openai.BadRequestError) as bad:  # a model id of the wrong type
            await client.completions.create(model=5, prompt=[1, 2], max_tokens=1)
        assert bad.value.status_code == 400 and bad.value.body["param"] == "model"
        assert "model must be a string" in bad.value.message
    finally:
        await client.close()
        await stop(srv)


# ---------------------------------------------------------------------------- flags


@pytest.mark.parametrize(
    "argv",
    [
        ["--max-new-tokens", "0"],
        ["--max-new-tokens", "-5"],
        ["--max-body-bytes", "-1"],
        ["--page-size", "0"],
        ["--device-pages", "0"],
        ["--host-pages", "0"],
        ["--heads", "3"],  # the default width, 128, is no multiple of 3
        ["--hidden", "30", "--heads", "4"],
        ["--layers", "0"],
        ["--positions", "0"],
        ["--port", "70000"],
        ["--port", "-1"],
        ["--kv-events", "bogus"],
        ["--read-timeout", "0"],
        ["--read-timeout", "nan"],
        ["--read-timeout", "inf"],
    ],
)
def test_bad_flags_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        server_mod.parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and argv[0] in err.split("error:")[1], err


def test_good_flags_are_kept() -> None:
    flags = "--port 0 --heads 2 --hidden 64 --read-timeout 2.5 --kv-events tcp://127.0.0.1:5557"
    opts = server_mod.parse_args(flags.split())
    assert (opts.port, opts.model.n_head, opts.read_timeout) == (0, 2, 2.5)
    assert server_mod.runner_kwargs(opts) == {
        "handler_cancellation": True,
        "keepalive_timeout": 2.5,
        "lingering_time": 2.5,
    }


# ---------------------------------------------------------------------------- admin routes


async def test_admin_routes_validate_token_ids_and_pin_ids(tmp_path: Path) -> None:
    srv = await start(options(tmp_path / "kv"))
    vocab = SPEC.vocab_size
    try:
        status, reply = await srv.post("/generate", {"tokens": [7] * 24, "max_new_tokens": 1})
        assert status == 200, reply
        for body in (
            {"tokens": [True] * 16, "ttl": 5},
            {"tokens": [1] * 8 + [vocab] + [1] * 7, "ttl": 5},
            {"tokens": [1, -1], "ttl": 5},
        ):
            status, reply = await srv.post("/cache/pin", body)
            assert status == 400, (body, reply)
            bad = next(i for i, t in enumerate(body["tokens"]) if t is True or t in (vocab, -1))
            assert f"tokens[{bad}] is {body['tokens'][bad]!r}" in reply["error"]
        for body in ({"tokens": [vocab + 5] * 16}, {"tokens": [1, False]}):
            status, reply = await srv.post("/cache/warm", body)
            assert status == 400, (body, reply)
            assert "tokens[" in reply["error"]
        for body in ({}, {"pin_id": "1"}, {"pin_id": 1.0}, {"pin_id": True}, {"pin_id": None}):
            status, reply = await srv.post("/cache/unpin", body)
            assert status == 400, (body, reply)
            assert "pin_id must be an int" in reply["error"]
        status, reply = await srv.post("/cache/unpin", {"pin_id": 12345})
        assert status == 404, reply
        status, reply = await srv.post("/cache/pin", {"tokens": [7] * 24, "ttl": 5})
        assert status == 200, reply  # valid ids still pin
        status, reply = await srv.post("/cache/unpin", {"pin_id": reply["pin_id"]})
        assert (status, reply) == (200, {"released": True})
    finally:
        await stop(srv)
