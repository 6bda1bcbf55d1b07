"""``aiocache-kv bench serve --url``: the same paced workload against any OpenAI-compatible
server over HTTP (``aiohttp``, the ``server`` extra).

Each request is ``POST {url}/v1/completions`` with the prompt as a list of token ids,
``max_tokens``, ``temperature: 0`` and ``stream: true`` (with ``stream_options.include_usage``):
the first server-sent chunk carrying tokens is the time to first token, the gaps between such
chunks the inter-token latencies.  The generated ids are read from ``choices[0].token_ids``
(a non-standard field some servers add) or else from ``choices[0].text`` as space-separated
ids; reuse from ``usage.prompt_tokens_details.cached_tokens`` (split by tier when the details
also carry ``device`` / ``host`` / ``storage`` counts).
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable
from typing import Any

from aiocache_kv.bench.engine_sides import Served, SideRun, Turn, Workload
from aiocache_kv.bench.serve_arms import Pacing, Serve, Tiered, paced_drive
from aiocache_kv.errors import InvalidInputError

__all__ = ["http_serve", "parse_tokens", "serve_url"]

#: seconds one HTTP request may take
REQUEST_TIMEOUT = 600.0


def parse_tokens(choice: dict[str, Any]) -> list[int]:
    """The token ids of one streamed (or whole) completion choice.

    Raises:
        InvalidInputError: neither ``token_ids`` nor a ``text`` of space-separated ids.
    """
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        return [int(i) for i in ids]
    text = choice.get("text") or ""
    try:
        return [int(part) for part in text.split()]
    except ValueError:
        raise InvalidInputError(
            f"cannot read token ids from the reply text {text[:60]!r}: the server must return "
            "choices[0].token_ids or the ids as space-separated text"
        ) from None


def _served(
    tokens: list[int], stamps: list[float], t0: float, end: float, prompt: int, usage: Any
) -> Served:
    details = (usage or {}).get("prompt_tokens_details") or {}
    cached = min(int(details.get("cached_tokens") or 0), prompt)
    ttft = (stamps[0] if stamps else end) - t0
    itl = [b - a for a, b in itertools.pairwise(stamps)]
    if all(isinstance(details.get(k), int) for k in ("device", "host", "storage")):
        return Tiered(tokens, ttft, itl, end - t0, cached, prompt - cached,
                      details["device"], details["host"], details["storage"])  # fmt: skip
    return Served(tokens, ttft, itl, end - t0, cached, prompt - cached)


def http_serve(session: Any, url: str, reply_tokens: int, model: str | None) -> Serve:
    """``serve`` over ``session`` (an ``aiohttp.ClientSession``) against ``url``."""
    endpoint = url.rstrip("/") + "/v1/completions"

    async def serve(prompt: list[int]) -> Served:
        body: dict[str, Any] = {
            "prompt": prompt,
            "max_tokens": reply_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if model is not None:
            body["model"] = model
        tokens: list[int] = []
        stamps: list[float] = []
        usage: Any = None
        t0 = time.perf_counter()
        async with session.post(endpoint, json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"POST {endpoint}: HTTP {r.status}: {(await r.text())[:200]}")
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    new = parse_tokens(choice)
                    if new:
                        stamps.append(time.perf_counter())
                        tokens.extend(new)
        return _served(tokens, stamps, t0, time.perf_counter(), len(prompt), usage)

    return serve


async def _model_name(session: Any, url: str) -> str | None:
    """The first model ``GET /v1/models`` lists, if the server has that endpoint."""
    try:
        async with session.get(url.rstrip("/") + "/v1/models") as r:
            if r.status != 200:
                return None
            data = (await r.json()).get("data") or []
            return str(data[0]["id"]) if data else None
    except Exception:
        return None


async def serve_url(
    url: str,
    wl: Workload,
    pacing: Pacing,
    *,
    model: str | None = None,
    on_done: Callable[[Turn], None] | None = None,
) -> SideRun:
    """The workload against the server at ``url`` (one untimed warm-up request first)."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT)
    limits = aiohttp.TCPConnector(limit=max(1, pacing.max_in_flight) + 1)
    async with aiohttp.ClientSession(timeout=timeout, connector=limits) as session:
        name = model or await _model_name(session, url)
        serve = http_serve(session, url, wl.reply_tokens, name)
        await serve(wl.warmup)
        t0 = time.perf_counter()
        turns = await paced_drive(wl, serve, pacing, on_done)
        wall = time.perf_counter() - t0
    return SideRun(turns=turns, wall=wall, extra={"url": url, "model": name})
