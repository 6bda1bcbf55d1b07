"""``examples/server.py``'s OpenAI-compatible endpoints over real HTTP on 127.0.0.1, called
with the official ``openai`` client: completions on token ids, streaming, ``cached_tokens``,
the model list, typed errors, tenants and batching."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from aiocache_kv import EngineClosedError
from aiocache_kv.models import reference_generate
from tests.e2e.conftest import SPEC, random_tokens

pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")
from tests.e2e.test_server import Running, metric, options, server_mod, start, stop  # noqa: E402

MODEL = SPEC.name
ROOT = Path(__file__).resolve().parents[2]
#: the Python the README's "Serving" lines run against the server (read here, off the loop)
(README_CLIENT,) = re.findall(
    r"^python - <<'EOF'\n(from openai import OpenAI\n.*?)^EOF$",
    (ROOT / "README.md").read_text(),
    re.S | re.M,
)


class Live:
    """A running server and an ``AsyncOpenAI`` client pointed at it."""

    def __init__(self, srv: Running, client: Any) -> None:
        self.srv = srv
        self.client = client

    async def complete(self, prompt: Any, max_tokens: int = 5, **kw: Any) -> Any:
        return await self.client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, **kw
        )


@pytest.fixture
async def live(tmp_path: Path) -> AsyncIterator[Live]:
    srv = await start(options(tmp_path / "kv"))
    client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    try:
        yield Live(srv, client)
    finally:
        await client.close()
        await stop(srv)


def ids(choice: Any) -> list[int]:
    """The reply's token ids, from the text and from the extra ``token_ids`` field."""
    from_text = [int(t) for t in choice.text.split()]
    assert choice.model_extra["token_ids"] == from_text
    return from_text


async def test_completion_is_the_reference_and_reports_cached_tokens(live: Live, gpt2: Any) -> None:
    prompt = random_tokens(30, 45)
    first = await live.complete(prompt)
    assert first.object == "text_completion" and first.model == MODEL
    (choice,) = first.choices
    assert ids(choice) == reference_generate(gpt2, prompt, 5).tokens
    assert choice.finish_reason == "length" and choice.index == 0
    u = first.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (45, 5, 50)
    assert u.prompt_tokens_details.cached_tokens == 0

    turn2 = prompt + ids(choice) + random_tokens(31, 7)  # a batch of one prompt: [[...]]
    second = await live.complete([turn2])
    assert ids(second.choices[0]) == reference_generate(gpt2, turn2, 5).tokens
    # prompt + reply[:-1] = 49 tokens were written: 6 pages of 8 are reused
    assert second.usage.prompt_tokens_details.cached_tokens == 48
    again = await live.complete(turn2)  # the same prompt again: all but its last page
    assert again.usage.prompt_tokens_details.cached_tokens == (len(turn2) - 1) // 8 * 8
    assert ids(again.choices[0]) == ids(second.choices[0])


async def test_default_max_tokens_and_temperature_zero(live: Live) -> None:
    reply = await live.client.completions.create(model=MODEL, prompt=[1, 2, 3], temperature=0)
    assert reply.usage.completion_tokens == 16  # the API's default


async def test_stream_yields_every_token_then_ends(live: Live, gpt2: Any) -> None:
    prompt = random_tokens(40, 30)
    want = reference_generate(gpt2, prompt, 6).tokens
    chunks = [
        c
        async for c in await live.complete(
            prompt, 6, stream=True, stream_options={"include_usage": True}
        )
    ]
    *tokens, usage = chunks
    assert len(tokens) == 6
    assert [c.choices[0].model_extra["token_ids"] for c in tokens] == [[t] for t in want]
    assert "".join(c.choices[0].text for c in tokens) == " ".join(map(str, want))
    assert [c.choices[0].finish_reason for c in tokens] == [None] * 5 + ["length"]
    assert all(c.object == "text_completion" and c.id == tokens[0].id for c in chunks)
    assert usage.choices == [] and usage.usage.completion_tokens == 6
    assert usage.usage.prompt_tokens_details.cached_tokens == 0
    # without include_usage: the token chunks only; the prompt is cached by now
    again = [c async for c in await live.complete(prompt, 6, stream=True)]
    assert [c.choices[0].text.strip() for c in again] == [str(t) for t in want]
    assert all(c.usage is None for c in again)


async def test_stream_on_the_wire(live: Live) -> None:
    """The server-sent events themselves: ``data: {...}`` per token, then ``data: [DONE]``."""
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3, "stream": True}
    async with live.srv.session.post(live.srv.url + "/v1/completions", json=body) as r:
        assert r.status == 200 and r.content_type == "text/event-stream"
        text = await r.text()
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert len(chunks) == 3
    for c in chunks:
        assert set(c) == {"id", "object", "created", "model", "choices"}
        (choice,) = c["choices"]
        assert {"index", "text", "logprobs", "finish_reason"} <= set(choice)


async def test_models_list_and_unknown_model(live: Live) -> None:
    models = await live.client.models.list()
    assert [(m.id, m.object, m.owned_by) for m in models.data] == [(MODEL, "model", "aiocache_kv")]
    with pytest.raises(openai.NotFoundError) as err:
        await live.client.completions.create(model="gpt-4", prompt=[1, 2], max_tokens=1)
    assert err.value.status_code == 404 and err.value.code == "model_not_found"
    assert err.value.param == "model"


BAD: dict[str, tuple[dict[str, Any], int, str, str]] = {
    # kwargs, status, param, a word of the message
    "string_prompt": ({"prompt": "Hello"}, 400, "prompt", "tokenizer"),
    "string_list_prompt": ({"prompt": ["Hello", "world"]}, 400, "prompt", "tokenizer"),
    "two_prompts": ({"prompt": [[1, 2], [3, 4]]}, 400, "prompt", "one prompt"),
    "empty_prompt": ({"prompt": []}, 400, "prompt", "token ids"),
    "temperature": ({"prompt": [1, 2], "temperature": 0.7}, 400, "temperature", "greedy"),
    "max_tokens_0": ({"prompt": [1, 2], "max_tokens": 0}, 400, "max_tokens", "max_tokens"),
    "max_tokens_over": ({"prompt": [1, 2], "max_tokens": 33}, 400, "max_tokens", "32"),
    "negative_id": ({"prompt": [1, -2]}, 400, "prompt", "prompt[1]"),
    "id_past_vocab": ({"prompt": [SPEC.vocab_size]}, 400, "prompt", str(SPEC.vocab_size)),
    "n_2": ({"prompt": [1, 2], "n": 2}, 400, "n", "not supported"),
    "top_p": ({"prompt": [1, 2], "top_p": 0.5}, 400, "top_p", "not supported"),
    "context": ({"prompt": [1] * 510, "max_tokens": 5}, 413, "prompt", "context"),
    "device_pool": ({"prompt": [1] * 300, "max_tokens": 32}, 413, "prompt", "pool"),
    "priority_negative": (
        {"prompt": [1, 2], "extra_body": {"priority": -1}},
        400,
        "priority",
        "[0, 1000]",
    ),
    "priority_float": ({"prompt": [1, 2], "extra_body": {"priority": 2.5}}, 400, "priority", "int"),
    "retention_negative": (
        {"prompt": [1, 2], "extra_body": {"priority": 3, "retention_seconds": -5}},
        400,
        "retention_seconds",
        "retention_seconds",
    ),
    "usage_without_stream": (
        {"prompt": [1, 2], "stream_options": {"include_usage": True}},
        400,
        "stream_options",
        "stream",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
async def test_bad_requests_raise_the_clients_typed_errors(live: Live, case: str) -> None:
    kwargs, status, param, word = BAD[case]
    kwargs = {"max_tokens": 4, **kwargs}
    want = openai.BadRequestError if status == 400 else openai.APIStatusError
    with pytest.raises(want) as err:
        await live.client.completions.create(model=MODEL, **kwargs)
    exc = err.value
    assert exc.status_code == status and exc.param == param, exc.body
    assert exc.type == "invalid_request_error" and word in exc.message, exc.message
    if status == 413:
        assert exc.code == "context_length_exceeded"
    reply = await live.complete([1, 2, 3], 1)  # and the server keeps serving
    assert reply.usage.completion_tokens == 1


async def test_malformed_bodies_get_the_error_shape(live: Live) -> None:
    url = live.srv.url + "/v1/completions"
    for data, content_type, status in (
        (b"{", "application/json", 400),
        (b'{"prompt": [1]}', "text/plain", 415),
        (b"[1, 2]", "application/json", 400),
        (b'{"prompt": [1], "frobnicate": 1}', "application/json", 400),
    ):
        async with live.srv.session.post(
            url, data=data, headers={"Content-Type": content_type}
        ) as r:
            assert r.status == status
            err = (await r.json())["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
        assert err["type"] == "invalid_request_error"


async def test_engine_closed_is_503(live: Live, monkeypatch: pytest.MonkeyPatch) -> None:
    app_server = live.srv.runner.app[server_mod.SERVER]

    async def closed(*args: Any, **kwargs: Any) -> Any:
        raise EngineClosedError("engine closed")

    monkeypatch.setattr(app_server.engine, "generate", closed)
    with pytest.raises(openai.InternalServerError) as err:
        await live.complete([1, 2, 3], 2)
    assert err.value.status_code == 503 and err.value.type == "server_error"
    assert "EngineClosedError" in err.value.message
    monkeypatch.setattr(app_server, "engine", None)  # not started (or gone)
    with pytest.raises(openai.InternalServerError) as err:
        await live.complete([1, 2, 3], 2, stream=True)
    assert err.value.status_code == 503


async def test_priority_extension_reaches_the_cache(live: Live) -> None:
    prompt = random_tokens(51, 33)
    await live.complete(prompt, 1, extra_body={"priority": 7, "retention_seconds": 60})
    # streamed, and long enough to complete a new page: its insert raises the whole path
    await collect(await live.complete(prompt, 8, stream=True, extra_body={"priority": 8}))
    cache = live.srv.runner.app[server_mod.SERVER].engine.cache
    node, n = cache._core.tree.match(cache._ns(None, None), prompt, 32)
    assert n == 32 and node.priority == 8


async def test_tenant_header_wins_over_user(live: Live) -> None:
    prompt = random_tokens(50, 33)  # 4 whole pages can be reused

    async def cached(**kw: Any) -> int:
        reply = await live.complete(prompt, 1, **kw)
        n: int = reply.usage.prompt_tokens_details.cached_tokens
        return n

    assert await cached(user="alice") == 0
    assert await cached(user="alice") == 32
    assert await cached(user="bob") == 0  # another tenant's namespace
    assert await cached() == 0  # the default tenant's
    assert await cached(user="bob", extra_headers={"X-Tenant": "carol"}) == 0
    assert await cached(user="nobody", extra_headers={"X-Tenant": "alice"}) == 32


async def collect(stream: Any) -> list[Any]:
    return [c async for c in stream]


async def test_concurrent_completions_are_batched_and_identical(live: Live, gpt2: Any) -> None:
    system = random_tokens(80, 24)
    prompts = [system + random_tokens(81 + i, 9 + 2 * i) for i in range(6)]
    replies = await asyncio.gather(
        *(live.complete(p, 6) for p in prompts[:4]),
        *(live.complete(p, 6, stream=True) for p in prompts[4:]),
    )
    streamed = [await collect(s) for s in replies[4:]]
    got = [ids(r.choices[0]) for r in replies[:4]]
    got += [
        [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] for chunks in streamed
    ]
    for p, tokens in zip(prompts, got, strict=True):
        assert tokens == reference_generate(gpt2, p, 6).tokens
    text = await live.srv.get_text("/metrics")
    steps = metric(text, "aiocache_kv_engine_steps_total")
    assert 0 < steps < sum(map(len, got))  # forward passes served several requests each
    assert metric(text, 'aiocache_kv_requests_total{outcome="ok"}') == 6
    assert metric(text, "aiocache_kv_generated_tokens_total") == 36


async def test_readme_client_lines_run_against_the_server(live: Live) -> None:
    """The README's ``openai`` client lines, as written but for the port: the second reply
    reports 32 cached tokens, the stream prints four tokens."""
    port = live.srv.url.rsplit(":", 1)[1]
    code = README_CLIENT.replace("127.0.0.1:8001", f"127.0.0.1:{port}")
    assert code != README_CLIENT
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()
    first, second, streamed = out.decode().splitlines()
    assert first.split()[-1] == "0" and second.split()[-1] == "32"
    assert first.split()[:-1] == second.split()[:-1] and len(first.split()) == 9
    assert streamed.split() == first.split()[:4]


async def test_client_leaving_a_stream_aborts_its_request(
    live: Live, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = live.srv.runner.app[server_mod.SERVER].engine
    runner = engine._runner
    step = runner.step

    async def slow_step(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(0.02)  # 32 tokens take 0.64 s: the client leaves before the end
        return await step(*args, **kwargs)

    monkeypatch.setattr(runner, "step", slow_step)
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 32, "stream": True}
    async with live.srv.session.post(live.srv.url + "/v1/completions", json=body) as r:
        assert r.status == 200
        assert (await r.content.readline()).startswith(b"data: {")
        r.close()  # the client goes away mid-stream
    for _ in range(200):
        st = engine.statistics()
        if (st.waiting, st.admitting, st.running) == (0, 0, 0):
            break
        await asyncio.sleep(0.01)
    assert (st.waiting, st.admitting, st.running) == (0, 0, 0)
    assert (st.aborted, st.finished) == (1, 0) and st.generated_tokens < 32
    engine.check_invariants()
    reply = await live.complete([1, 2, 3], 2)  # and the server keeps serving
    assert reply.usage.completion_tokens == 2
