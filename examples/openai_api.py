"""OpenAI-compatible endpoints of ``examples/server.py``, served by its engine.

* ``POST /v1/completions`` - the completions API on token ids (the server has no tokenizer):

  - ``prompt``: a list of token ids, or a list holding one such list (a string, or a list of
    strings, is a 400: there is no tokenizer to read it with);
  - ``max_tokens`` (default 16, at most ``--max-new-tokens``); ``temperature`` absent, null or
    0 (decoding is greedy; another value is a 400); ``n``/``best_of`` 1, ``top_p`` 1, the
    penalties 0, ``echo`` false, ``logprobs``/``suffix``/``stop`` null, any ``seed``: the
    defaults, accepted; anything else, or a field the API does not have, is a 400;
  - ``stream``: server-sent events, one ``data: {...}`` chunk per token (the last with
    ``finish_reason: "length"``), with ``stream_options.include_usage`` a chunk with
    ``usage`` and no choices, then ``data: [DONE]``;
  - extension fields ``priority`` (an int in [0, 1000]) and ``retention_seconds``: the
    retention priority of the request's cached pages (``HiCache.insert``; a bad value is a
    400 naming it);
  - the tenant (whose namespace of the cache the request reads and fills) is the
    ``X-Tenant`` header when it is present (a gateway in front of the server sets it), else
    the ``user`` field, else the default tenant;
  - the reply: ``choices[0].text`` is the generated token ids in decimal, joined by single
    spaces (streamed chunks concatenate to it), ``choices[0].token_ids`` the same ids as a
    list (not part of the API: clients ignore it); ``usage.prompt_tokens_details
    .cached_tokens`` counts the prompt tokens whose KV was reused instead of recomputed (from
    the device pool, host memory or storage), as vLLM reports it: a prompt's last token is
    always computed, and only whole pages are cached.

* ``GET /v1/models`` - the one served model (its id is the cache's namespace).

Errors have the API's shape, ``{"error": {"message", "type", "param", "code"}}``: 400 a bad
value (``type: "invalid_request_error"``), 404 ``model`` names another model, 413 a request
longer than the model's context or the device pool (or a body over ``--max-body-bytes``),
415 a body that is not JSON, 503 the engine is not running (``type: "server_error"``).
An error after a stream started is sent as one ``data: {"error": ...}`` event before
``data: [DONE]``.  :func:`json_errors` (a middleware of the whole server) gives aiohttp's own
errors that shape too: 404 no such route, 405 a method the route has not, ...
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web
from aiohttp.typedefs import Handler
from server_requests import (
    BadRequest,
    ClientGone,
    RequestLimits,
    read_json_body,
    retention_fields,
)

from aiocache_kv import KVCacheError
from aiocache_kv.serving import Engine, GenerationResult

__all__ = [
    "CompletionRequest",
    "OpenAIError",
    "OpenAIRoutes",
    "json_errors",
    "validate_completion",
]

DEFAULT_MAX_TOKENS = 16  #: the API's default ``max_tokens``
#: fields the API has that this server accepts at their defaults only (null is always fine)
NEUTRAL: dict[str, tuple[object, ...]] = {
    "n": (1,),
    "best_of": (1,),
    "top_p": (1,),
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "echo": (False,),
    "logprobs": (),
    "suffix": (),
    "stop": ([],),
    "logit_bias": ({},),
}
FIELDS = frozenset(
    {"model", "prompt", "max_tokens", "stream", "stream_options", "temperature", "user", "seed"}
    | {"priority", "retention_seconds"}  # extensions: the pages' retention priority
    | set(NEUTRAL)
)
NO_TOKENIZER = (
    "prompt must be token ids (a list of ints, or a list holding one list of ints): "
    "this server has no tokenizer, so text prompts are not supported"
)


class OpenAIError(Exception):
    """A request the server refuses, in the API's error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        kind = "server_error" if self.status >= 500 else "invalid_request_error"
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }

    def response(self) -> web.Response:
        """The HTTP reply."""
        return web.json_response(self.body(), status=self.status)


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's HTTP errors (no such route 404, a wrong method 405, ...) as
    :class:`OpenAIError` bodies, their status and headers (a 405's ``Allow``) kept; a 408
    (the body came too slowly) also closes the connection."""
    try:
        resp = await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = f"{exc.reason}: {request.method} {request.path}"
        if exc.text and exc.text != f"{exc.status}: {exc.reason}":
            message += f" ({exc.text})"
        if "Allow" in exc.headers:
            message += f" (allowed: {exc.headers['Allow'] or 'none'})"
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return web.json_response(
            OpenAIError(exc.status, message).body(), status=exc.status, headers=headers
        )
    if resp.status == 408:
        resp.force_close()
    return resp


@dataclass(frozen=True)
class CompletionRequest:
    """A validated ``POST /v1/completions`` body."""

    prompt: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    user: str | None
    priority: int | None = None  #: extension: retention priority of the request's pages
    retention: float | None = None  #: extension ``retention_seconds``


def _short(value: object, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_num(value: object, want: object) -> bool:
    return type(value) in (int, float) and value == want  # bool is no number here


def _neutral(name: str, value: object) -> None:
    ok = NEUTRAL[name]
    if value is None or any(
        _is_num(value, want) if type(want) is int else type(value) is type(want) and value == want
        for want in ok
    ):
        return
    allowed = " or ".join(["null", *(json.dumps(w) for w in ok)])
    raise OpenAIError(400, f"{name} {_short(value)} is not supported (only {allowed})", name)


def _prompt(value: object, vocab: int) -> list[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], list):
        value = value[0]  # a batch of one prompt
    if isinstance(value, str) or (isinstance(value, list) and any(type(v) is str for v in value)):
        raise OpenAIError(400, NO_TOKENIZER, "prompt")
    if not isinstance(value, list) or not value:
        raise OpenAIError(400, f"{NO_TOKENIZER}; got {_short(value)}", "prompt")
    for i, t in enumerate(value):
        if isinstance(t, list):
            raise OpenAIError(400, "only one prompt per request is supported", "prompt")
        if type(t) is not int or not 0 <= t < vocab:  # bool is no token id
            raise OpenAIError(
                400,
                f"prompt must be token ids in [0, {vocab}), prompt[{i}] is {_short(t)}",
                "prompt",
            )
    return value


def validate_completion(obj: object, limits: RequestLimits, model: str) -> CompletionRequest:
    """A parsed JSON body -> :class:`CompletionRequest` (raises :class:`OpenAIError`)."""
    if not isinstance(obj, dict):
        raise OpenAIError(400, "body must be a JSON object")
    unknown = sorted(set(obj) - FIELDS)
    if unknown:
        raise OpenAIError(400, f"unrecognized request arguments {_short(unknown)}", unknown[0])
    asked = obj.get("model")
    if asked is not None and type(asked) is not str:
        raise OpenAIError(400, f"model must be a string, got {_short(asked)}", "model")
    if asked is not None and asked != model:
        raise OpenAIError(
            404,
            f"the model {_short(asked)} does not exist; this server serves {model!r}",
            "model",
            "model_not_found",
        )
    for name in NEUTRAL:
        _neutral(name, obj.get(name))
    if obj.get("seed") is not None and type(obj["seed"]) is not int:
        raise OpenAIError(400, f"seed must be an int, got {_short(obj['seed'])}", "seed")
    temperature = obj.get("temperature")
    if temperature is not None and not _is_num(temperature, 0):
        raise OpenAIError(
            400,
            f"temperature must be 0 (decoding is greedy), got {_short(temperature)}",
            "temperature",
        )
    prompt = _prompt(obj.get("prompt"), limits.vocab_size)
    bound = limits.max_new_tokens
    max_tokens = obj.get("max_tokens")
    if max_tokens is None:
        max_tokens = min(DEFAULT_MAX_TOKENS, bound)
    if type(max_tokens) is not int or not 1 <= max_tokens <= bound:
        raise OpenAIError(
            400,
            f"max_tokens must be an int in [1, {bound}], got {_short(max_tokens)}",
            "max_tokens",
        )
    need = len(prompt) + max_tokens
    for room, what in (
        (limits.max_positions, "the model's context"),
        (limits.max_kv_slots, "the device pool's KV slots"),
    ):
        if need > room:
            raise OpenAIError(
                413,
                f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) = {need} "
                f"exceeds {what} ({room})",
                "prompt",
                "context_length_exceeded",
            )
    stream = obj.get("stream")
    if stream is not None and type(stream) is not bool:
        raise OpenAIError(400, f"stream must be a boolean, got {_short(stream)}", "stream")
    options = obj.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise OpenAIError(
                400, "stream_options is only allowed with stream: true", "stream_options"
            )
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise OpenAIError(
                400,
                f'stream_options must be {{"include_usage": bool}}, got {_short(options)}',
                "stream_options",
            )
        include_usage = options.get("include_usage") is True
    user = obj.get("user")
    if user is not None and type(user) is not str:
        raise OpenAIError(400, f"user must be a string, got {_short(user)}", "user")
    try:
        priority, retention = retention_fields(obj)
    except BadRequest as exc:
        param = "priority" if "priority" in exc.message else "retention_seconds"
        raise OpenAIError(400, exc.message, param) from None
    return CompletionRequest(
        prompt, max_tokens, bool(stream), include_usage, user or None, priority, retention
    )


def usage(result: GenerationResult) -> dict[str, Any]:
    """The API's ``usage`` of a finished request (``cached_tokens``: prompt tokens reused)."""
    return {
        "prompt_tokens": result.prompt_len,
        "completion_tokens": len(result.tokens),
        "total_tokens": result.prompt_len + len(result.tokens),
        "prompt_tokens_details": {"cached_tokens": result.attribution.cached},
    }


class Served(Protocol):
    """What the routes need of ``examples/server.py``'s ``GenerateServer``."""

    limits: RequestLimits
    engine: Engine | None
    metrics: Any  #: its ``ServerMetrics``


class OpenAIRoutes:
    """The handlers of ``/v1/completions`` and ``/v1/models`` over a ``GenerateServer``."""

    def __init__(self, server: Served, model: str) -> None:
        self.server = server
        self.model = model
        self.created = int(time.time())

    def add_to(self, app: web.Application) -> None:
        """Register the routes."""
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)

    async def models(self, request: web.Request) -> web.Response:
        """``GET /v1/models``."""
        card = {"id": self.model, "object": "model", "created": self.created}
        return web.json_response({"object": "list", "data": [{**card, "owned_by": "aiocache_kv"}]})

    def _fail(self, exc: OpenAIError, outcome: str = "bad_request") -> web.Response:
        self.server.metrics.requests.labels(outcome=outcome).inc()
        return exc.response()

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/completions``."""
        server = self.server
        try:
            obj = await read_json_body(request, server.limits)
            req = validate_completion(obj, server.limits, self.model)
        except ClientGone as exc:  # nobody reads the reply
            return self._fail(OpenAIError(exc.status, exc.message), "error")
        except BadRequest as exc:
            return self._fail(OpenAIError(exc.status, exc.message))
        except OpenAIError as exc:
            return self._fail(exc)
        except asyncio.CancelledError:  # the client went away mid-body
            server.metrics.requests.labels(outcome="error").inc()
            raise
        tenant = request.headers.get("X-Tenant") or req.user  # the gateway's header wins
        engine = server.engine
        if engine is None:
            return self._fail(OpenAIError(503, "the engine is not running"), "error")
        head = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model,
        }
        if req.stream:
            return await self._stream(request, engine, req, tenant, head)
        try:
            res = await engine.generate(
                req.prompt,
                max_new_tokens=req.max_tokens,
                tenant=tenant,
                priority=req.priority,
                retention=req.retention,
            )
        except KVCacheError as exc:
            return self._fail(*_engine_error(exc))
        except asyncio.CancelledError:  # the client went away: generate() aborted it
            server.metrics.requests.labels(outcome="error").inc()
            raise
        server.metrics.record(res)
        choice = {
            "index": 0,
            "text": " ".join(map(str, res.tokens)),
            "token_ids": res.tokens,
            "logprobs": None,
            "finish_reason": "length",
        }
        return web.json_response({**head, "choices": [choice], "usage": usage(res)})

    async def _stream(
        self,
        request: web.Request,
        engine: Engine,
        req: CompletionRequest,
        tenant: str | None,
        head: dict[str, Any],
    ) -> web.StreamResponse:
        try:
            stream = engine.open_stream(
                req.prompt,
                max_new_tokens=req.max_tokens,
                tenant=tenant,
                priority=req.priority,
                retention=req.retention,
            )
        except KVCacheError as exc:
            return self._fail(*_engine_error(exc))
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        metrics = self.server.metrics
        outcome = "error"  #: counted once, at the end: "ok" only once [DONE] is written
        ended = "ok"
        try:
            await resp.prepare(request)

            async def send(obj: object) -> None:
                await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

            n = 0
            async for token in stream.tokens():
                n += 1
                last = n == req.max_tokens
                text = str(token) if n == 1 else f" {token}"
                await send({**head, "choices": [_choice(text, [token], last)]})
            try:
                res = await stream.result()
            except KVCacheError as exc:  # the status line is sent: an error event instead
                err, outcome = _engine_error(exc)
                ended = outcome
                await send(err.body())
            else:
                metrics.observe(res)  # generated, whether or not the client stays for usage
                if n != req.max_tokens:  # not expected: greedy runs to max_tokens
                    await send({**head, "choices": [_choice("", [], True)]})
                if req.include_usage:
                    await send({**head, "choices": [], "usage": usage(res)})
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            outcome = ended
            return resp
        except ConnectionResetError:  # the client went away: its request is aborted below
            return resp
        finally:  # also on cancellation (the client went away, handler_cancellation)
            stream.close()
            metrics.requests.labels(outcome=outcome).inc()


def _choice(text: str, token_ids: list[int], last: bool) -> dict[str, Any]:
    return {
        "index": 0,
        "text": text,
        "token_ids": token_ids,
        "logprobs": None,
        "finish_reason": "length" if last else None,
    }


def _engine_error(exc: KVCacheError) -> tuple[OpenAIError, str]:
    """An engine error as the API's: bad input 400 (the routes check first), else 503."""
    if isinstance(exc, (ValueError, TypeError)):
        return OpenAIError(400, f"{type(exc).__name__}: {exc}"), "bad_request"
    return OpenAIError(503, f"{type(exc).__name__}: {exc}"), "error"
