"""An async HTTP server: greedy generation on a small GPT-2 whose KV lives in ``HiCache``.

Run::

    pip install -e .[server]                  # aiohttp, prometheus_client
    python examples/server.py --port 8000     # binds 127.0.0.1; FileStorage in a temp dir
    curl -s localhost:8000/generate -H 'Content-Type: application/json' \\
        -d '{"tokens": [1, 2, 3], "max_new_tokens": 8}'
    curl -s localhost:8000/metrics
    python examples/server.py --kv-events tcp://127.0.0.1:5557   # + KV events (vLLM ZMQ format)

Endpoints:

* ``POST /generate`` - ``{"tokens": [int, ...], "max_new_tokens": int}`` ->
  ``{"tokens": [...], "prompt_tokens", "cached_tokens": {"device", "host", "storage"},
  "computed_tokens", "ttft_ms", "total_ms"}``: ``cached_tokens`` are the prompt tokens the
  model did not recompute, by the tier their KV came from, so cached + computed is the prompt
  (a fully cached prompt still recomputes its last page).  Token ids only: GPT-2's tokenizer
  would have to be downloaded, and this server downloads nothing (the weights are random,
  seeded).
  A malformed request gets ``{"error": "..."}``: 400 (bad JSON, encoding or fields), 413 (body
  over ``--max-body-bytes``, 1 MiB), 415 (a Content-Type other than JSON, or a charset other
  than UTF-8/16/32).
* ``GET /health`` - ``{"status": "ok", ...}`` with the cache's page counts.
* ``POST /flush`` - waits until every copy and storage backup in flight when it was called has
  landed (so another node can read those pages from storage); requests that arrive meanwhile
  do not hold it up.
* ``GET /metrics`` - Prometheus text format: the cache's metrics from
  :class:`aiocache_kv.metrics.CacheCollector` (hits and prompt tokens per tier, bytes per
  direction, load-back / write-through / backup / prefetch latency, pool pages, evictions,
  storage errors, operations in flight, event queue depth) and the server's own (requests,
  generated tokens, TTFT, KV events drained).  Collected in the handler, on the loop thread.

Reaching storage in time: a request's prompt is prefetched (storage -> host) the moment it
arrives, while it waits for one of ``--max-running`` slots; on admission it is prefetched
again (what landed is already committed and cheap to skip; what another node stored since is
fetched now) and the generation uses whatever committed.
``aiocache_kv_storage_served_requests_total`` counts returning prompts served from storage;
``aiocache_kv_admission_wait_seconds`` is how long the arrival prefetch had to hide in.

Each request awaits the cache the way a serving loop does (:class:`CachedLM`): ``prefetch``
(storage -> host), ``match_prefix``, ``load_back`` (host -> device), prefill of the uncached
suffix and decode with the K/V in the device pool, ``insert`` (written through to host and
storage).  Forward passes run on one worker thread, so the loop keeps serving ``/health`` and
``/metrics`` and cache completions while a prefill runs; requests interleave between decode
steps.  Two live servers started with the same ``--model-seed`` and one Mooncake master reuse
each other's KV; a ``--storage-dir`` is shared across restarts (one live server owns it).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import shutil
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import NoReturn

import torch
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import generate_latest

from aiocache_kv import (
    BlockRemoved,
    BlockStored,
    FileStorage,
    HiCache,
    KVCacheError,
    KVEvent,
    MooncakeStorage,
    PrefetchResult,
    StorageBackend,
)
from aiocache_kv.events import ZmqEventPublisher
from aiocache_kv.events.zmq import EventEncoding
from aiocache_kv.logs import get_logger
from aiocache_kv.metrics import CacheCollector
from aiocache_kv.models import CachedLM, GPT2Spec, build_gpt2, cache_config_for
from aiocache_kv.models.generate import Generation

log = get_logger("aiocache_kv.examples.server")

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class ServerOptions:
    """Everything the server is configured with (flags of ``examples/server.py``)."""

    host: str = "127.0.0.1"
    port: int = 8000
    model: GPT2Spec = field(default_factory=GPT2Spec)
    page_size: int = 16
    device_pages: int = 256
    host_pages: int = 1024
    storage: str = "file"  #: file | none | mooncake
    storage_dir: str | None = None
    master: str | None = None
    metadata: str | None = None
    max_new_tokens: int = 256  #: upper bound a request may ask for
    max_body_bytes: int = 1 << 20  #: larger ``/generate`` bodies get 413
    model_thread: bool = True  #: forward passes on a worker thread (else inline on the loop)
    kv_events: str | None = None  #: ZMQ PUB endpoint for KV events (vLLM format), or off
    #: ``map``: vLLM's current KV-event protocol; ``array``: the one before vLLM#42892
    kv_events_encoding: EventEncoding = "map"
    #: requests generating at once; the rest wait in arrival order (their prefetch runs meanwhile)
    max_running: int = 4


class ServerMetrics:
    """What the server counts itself, in the registry that also holds the cache's collector.

    The cache's own metrics (hits per tier, prompt tokens per source, bytes, latencies, pool
    pages, evictions, storage errors, operations in flight, the event queue) come from
    :class:`aiocache_kv.metrics.CacheCollector`, registered once the cache is open.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "aiocache_kv_requests", "Generate requests by outcome.", ["outcome"], registry=registry
        )
        for outcome in ("ok", "bad_request", "error"):
            self.requests.labels(outcome=outcome)
        self.generated_tokens = Counter(
            "aiocache_kv_generated_tokens", "Tokens generated.", registry=registry
        )
        self.ttft = Histogram(
            "aiocache_kv_ttft_seconds",
            "Time to first token, per request.",
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.storage_served = Counter(
            "aiocache_kv_storage_served_requests",
            "Requests whose prompt was served in part from storage (a returning prompt).",
            registry=registry,
        )
        self.queued = Histogram(
            "aiocache_kv_admission_wait_seconds",
            "Time from arrival to admission, while the arrival prefetch runs.",
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.events = Counter(
            "aiocache_kv_events",
            "KV events drained by the server, by type and medium.",
            ["type", "medium"],
            registry=registry,
        )

    def record(self, gen: Generation) -> None:
        """Account one finished generation (its prompt attribution is the ``CachedLM``'s)."""
        self.requests.labels(outcome="ok").inc()
        self.generated_tokens.inc(len(gen.tokens))
        self.ttft.observe(gen.ttft)
        if gen.attribution.storage:
            self.storage_served.inc()


# ---------------------------------------------------------------------------- request parsing

#: charsets a ``/generate`` body may declare (none: UTF-8, as RFC 8259 requires of JSON)
JSON_CHARSETS = {
    "utf-8": "utf-8",
    "utf8": "utf-8",
    "us-ascii": "ascii",
    "ascii": "ascii",
    "utf-16": "utf-16",
    "utf-16le": "utf-16-le",
    "utf-16be": "utf-16-be",
    "utf-32": "utf-32",
    "utf-32le": "utf-32-le",
    "utf-32be": "utf-32-be",
}
GENERATE_FIELDS = frozenset({"tokens", "max_new_tokens"})
DEFAULT_MAX_NEW_TOKENS = 16


class BadRequest(Exception):
    """A malformed request: the HTTP status it gets and a short message naming the problem."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class GenerateRequest:
    """A validated ``POST /generate`` body."""

    tokens: list[int]
    max_new_tokens: int


@dataclass(frozen=True)
class RequestLimits:
    """What a ``/generate`` request may ask for."""

    vocab_size: int
    max_new_tokens: int  #: the server's bound on ``max_new_tokens``
    max_positions: int  #: prompt + reply, the model's context
    max_kv_slots: int  #: prompt + reply - 1 K/V rows, the device pool's size
    max_body_bytes: int


def _short(value: object, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _reject_constant(name: str) -> NoReturn:
    raise BadRequest(400, f"body is not valid JSON: {name} is not a JSON value")


async def parse_generate_request(request: web.Request, limits: RequestLimits) -> GenerateRequest:
    """Read, decode, parse and validate a ``/generate`` body.

    Raises:
        BadRequest: 413 body over ``limits.max_body_bytes``; 415 a content type other than
            JSON or a charset outside :data:`JSON_CHARSETS`; 400 anything else malformed
            (unreadable body, bad encoding, bad JSON, bad fields).
    """
    media = request.content_type  # "application/octet-stream" when the header is absent
    if "Content-Type" in request.headers and not (
        media == "application/json" or media.endswith("+json")
    ):
        raise BadRequest(415, f"content type must be application/json, got {_short(media)}")
    declared = request.charset
    codec = JSON_CHARSETS.get((declared or "utf-8").strip().lower())
    if codec is None:
        raise BadRequest(415, f"unsupported charset {_short(declared)} (send utf-8)")
    limit = limits.max_body_bytes
    too_large = BadRequest(413, f"body exceeds {limit} bytes")
    if (request.content_length or 0) > limit:
        raise too_large
    body = bytearray()
    try:
        async for chunk in request.content.iter_any():
            body += chunk
            if len(body) > limit:
                raise too_large
    except web.RequestPayloadError as exc:  # e.g. a corrupt Content-Encoding
        reason = str(exc).strip().splitlines()[-1].strip()  # drop aiohttp's "400, message:"
        raise BadRequest(400, f"body could not be read: {reason}") from None
    try:
        text = body.decode(codec)
    except UnicodeDecodeError as exc:
        raise BadRequest(400, f"body is not valid {codec}: {exc.reason}") from None
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise BadRequest(400, f"body is not valid JSON: {exc}") from None
    except RecursionError:
        raise BadRequest(400, "body is not valid JSON: nested too deep") from None
    except ValueError as exc:  # e.g. int()'s digit limit: "Exceeds the limit (4300 digits) ..."
        raise BadRequest(400, f"body is not valid JSON: {str(exc).split(':')[0]}") from None
    return validate_generate(obj, limits)


def validate_generate(obj: object, limits: RequestLimits) -> GenerateRequest:
    """A parsed JSON body -> :class:`GenerateRequest` (raises :class:`BadRequest`, 400)."""
    if not isinstance(obj, dict):
        raise BadRequest(400, "body must be a JSON object")
    unknown = sorted(set(obj) - GENERATE_FIELDS)
    if unknown:
        raise BadRequest(400, f"unknown fields {_short(unknown)}; known: tokens, max_new_tokens")
    tokens = obj.get("tokens")
    if not isinstance(tokens, list) or not tokens:
        raise BadRequest(400, "tokens must be a non-empty list of token ids")
    if len(tokens) >= limits.max_positions:
        raise BadRequest(
            400, f"tokens has {len(tokens)} ids; the model's context is {limits.max_positions}"
        )
    vocab = limits.vocab_size
    for i, t in enumerate(tokens):
        if type(t) is not int or not 0 <= t < vocab:  # bool is no int here
            raise BadRequest(
                400, f"tokens must be ints in [0, {vocab}), tokens[{i}] is {_short(t)}"
            )
    bound = limits.max_new_tokens
    max_new = obj.get("max_new_tokens", min(DEFAULT_MAX_NEW_TOKENS, bound))
    if type(max_new) is not int or not 1 <= max_new <= bound:
        raise BadRequest(
            400, f"max_new_tokens must be an int in [1, {bound}], got {_short(max_new)}"
        )
    if len(tokens) + max_new > limits.max_positions:
        raise BadRequest(
            400,
            f"{len(tokens)} tokens + max_new_tokens {max_new} exceed the model's context of "
            f"{limits.max_positions}",
        )
    if len(tokens) + max_new - 1 > limits.max_kv_slots:
        raise BadRequest(
            400,
            f"{len(tokens)} tokens + max_new_tokens {max_new} need more KV slots than the "
            f"device pool holds ({limits.max_kv_slots})",
        )
    return GenerateRequest(tokens=tokens, max_new_tokens=max_new)


# ---------------------------------------------------------------------------- the server


class GenerateServer:
    """The model, the cache and the HTTP handlers."""

    def __init__(self, opts: ServerOptions) -> None:
        self.opts = opts
        self.limits = RequestLimits(
            vocab_size=opts.model.vocab_size,
            max_new_tokens=opts.max_new_tokens,
            max_positions=opts.model.n_positions,
            max_kv_slots=opts.device_pages * opts.page_size,
            max_body_bytes=opts.max_body_bytes,
        )
        #: scraped on the loop (``/metrics``): the cache's collector reads loop-owned state
        self.registry = CollectorRegistry()
        self.metrics = ServerMetrics(self.registry)
        self.cache: HiCache | None = None
        self.lm: CachedLM | None = None
        self.started = time.monotonic()
        self.admission = asyncio.Semaphore(opts.max_running)
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    # ------------------------------------------------------------------ lifecycle

    @contextlib.asynccontextmanager
    async def _storage(self) -> AsyncIterator[Callable[[], StorageBackend | None]]:
        o = self.opts
        if o.storage == "file":
            path = o.storage_dir
            temp = path is None
            if path is None:
                path = await asyncio.to_thread(tempfile.mkdtemp, prefix="aiocache-kv-server-")
            try:
                yield lambda: FileStorage(path)
            finally:
                if temp:
                    await asyncio.to_thread(shutil.rmtree, path, True)
        elif o.storage == "mooncake":
            if o.master is None or o.metadata is None:
                raise SystemExit("--storage mooncake needs --master and --metadata")
            yield lambda: MooncakeStorage(
                master=o.master,
                metadata_server=o.metadata,
                local_hostname="127.0.0.1",
                protocol="tcp",
                device_name="",
                global_segment_size=256 << 20,
                local_buffer_size=64 << 20,
            )
        else:
            yield lambda: None

    async def lifespan(self, app: web.Application) -> AsyncIterator[None]:
        """aiohttp ``cleanup_ctx``: build the model, open the cache; close both at the end."""
        o = self.opts
        model = await asyncio.to_thread(build_gpt2, o.model)
        async with contextlib.AsyncExitStack() as stack:
            make_storage = await stack.enter_async_context(self._storage())
            publisher = None
            if o.kv_events:  # closed after the cache, so the last events go out
                publisher = ZmqEventPublisher(o.kv_events, event_encoding=o.kv_events_encoding)
                await stack.enter_async_context(publisher)
            cfg = cache_config_for(
                model,
                page_size=o.page_size,
                device="cpu",
                device_pages=o.device_pages,
                host_pages=o.host_pages,
                write_policy="write_through",
                namespace=o.model.name,
                host_memory_reserve_bytes=0,
                storage=make_storage(),
                prefetch_policy="timeout",
                prefetch_threshold_tokens=o.page_size,
            )
            self.cache = await stack.enter_async_context(HiCache(cfg))
            runner = None
            if o.model_thread:
                self._executor = concurrent.futures.ThreadPoolExecutor(1, "model")
                stack.callback(self._executor.shutdown, wait=False)
                runner = self._run_in_model_thread
            self.lm = CachedLM(model, self.cache, runner=runner)
            collector = CacheCollector(
                self.cache, prompts=self.lm.prompt_tokens, registry=self.registry
            )
            stack.callback(self.registry.unregister, collector)
            drain = asyncio.get_running_loop().create_task(
                self._drain_events(self.cache, publisher)
            )
            log.info("server_ready", model=o.model.name, storage=o.storage, page_size=o.page_size)
            try:
                yield
            finally:
                await self.cache.flush()
                await self.cache.aclose()  # ends the events stream
                await drain

    async def _run_in_model_thread(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        assert self._executor is not None
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    async def _drain_events(self, cache: HiCache, publisher: ZmqEventPublisher | None) -> None:
        if publisher is not None:  # the one consumer of the log: counts, then publishes
            await publisher.run(cache, on_batch=self._count_events)
            return
        async for ev in cache.events():
            self._count_events([ev])

    def _count_events(self, events: list[KVEvent]) -> None:
        for ev in events:
            medium = ev.medium if isinstance(ev, (BlockStored, BlockRemoved)) else ""
            self.metrics.events.labels(type=type(ev).__name__, medium=medium).inc()

    # ------------------------------------------------------------------ handlers

    async def generate(self, request: web.Request) -> web.Response:
        """``POST /generate``."""
        try:
            req = await parse_generate_request(request, self.limits)
        except BadRequest as exc:
            self.metrics.requests.labels(outcome="bad_request").inc()
            return web.json_response({"error": exc.message}, status=exc.status)
        assert self.lm is not None
        try:
            gen = await self._admit_and_generate(self.lm, req)
        except KVCacheError as exc:
            self.metrics.requests.labels(outcome="error").inc()
            status = 400 if isinstance(exc, ValueError) else 503
            return web.json_response({"error": f"{type(exc).__name__}: {exc}"}, status=status)
        self.metrics.record(gen)
        src = gen.attribution  # only reused tokens count as cached: cached + computed = prompt
        return web.json_response(
            {
                "tokens": gen.tokens,
                "prompt_tokens": gen.prompt_len,
                "cached_tokens": {"device": src.device, "host": src.host, "storage": src.storage},
                "computed_tokens": src.computed,
                "ttft_ms": round(gen.ttft * 1e3, 3),
                "total_ms": round(gen.total * 1e3, 3),
            }
        )

    async def _admit_and_generate(self, lm: CachedLM, req: GenerateRequest) -> Generation:
        """The prefetch pattern: prefetch on arrival, check again on admission, commit what
        landed.

        The arrival prefetch reads storage while the request waits for one of the
        ``max_running`` slots, so queueing hides the read.  On admission ``generate``
        prefetches again (cheap when everything landed: only pages still missing are asked
        for, and another node may have stored more since), matches, and loads back; the
        tokens the arrival prefetch committed are attributed to storage.
        """
        arrived = time.perf_counter()
        early: asyncio.Task[PrefetchResult] | None = None
        if lm.cache.config.storage is not None:
            early = asyncio.create_task(lm.cache.prefetch(req.tokens, tenant=lm.tenant))
        try:
            async with self.admission:
                self.metrics.queued.observe(time.perf_counter() - arrived)
                fetched = 0
                if early is not None:
                    fetched = (await early).hit_tokens  # bounded by the prefetch deadline
                return await lm.generate(req.tokens, req.max_new_tokens, prefetched_tokens=fetched)
        finally:
            if early is not None and not early.done():
                early.cancel()  # the request went away while queued

    async def flush(self, request: web.Request) -> web.Response:
        """``POST /flush``: the write-throughs and storage backups pending at the call settled
        (``HiCache.flush``: bounded, new requests meanwhile do not hold it up)."""
        assert self.cache is not None
        t0 = time.perf_counter()
        await self.cache.flush()
        st = self.cache.statistics()
        return web.json_response(
            {
                "flushed_ms": round((time.perf_counter() - t0) * 1e3, 3),
                "backup_pages_ok": st.backup_pages_ok,
                "backup_pages_failed": st.backup_pages_failed,
            }
        )

    async def health(self, request: web.Request) -> web.Response:
        """``GET /health``."""
        if self.cache is None:
            return web.json_response({"status": "starting"}, status=503)
        st = self.cache.statistics()
        return web.json_response(
            {
                "status": "ok",
                "model": self.opts.model.name,
                "uptime_s": round(time.monotonic() - self.started, 3),
                "device_pages": {"total": st.device.total_pages, "free": st.device.free_pages},
                "host_pages": {"total": st.host.total_pages, "free": st.host.free_pages},
                "storage": self.opts.storage,
            }
        )

    async def metrics_handler(self, request: web.Request) -> web.Response:
        """``GET /metrics`` (Prometheus text format 0.0.4), collected here on the loop thread."""
        if self.cache is None:
            return web.json_response({"status": "starting"}, status=503)
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


SERVER: web.AppKey[GenerateServer] = web.AppKey("server", GenerateServer)


def make_app(opts: ServerOptions) -> web.Application:
    """The aiohttp application (the model is built and the cache opened at start-up)."""
    server = GenerateServer(opts)
    app = web.Application()
    app[SERVER] = server
    app.cleanup_ctx.append(server.lifespan)
    app.router.add_post("/generate", server.generate)
    app.router.add_post("/flush", server.flush)
    app.router.add_get("/health", server.health)
    app.router.add_get("/metrics", server.metrics_handler)
    return app


def parse_args(argv: Sequence[str] | None = None) -> ServerOptions:
    """Flags -> :class:`ServerOptions`."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--device-pages", type=int, default=256)
    p.add_argument("--host-pages", type=int, default=1024)
    p.add_argument("--storage", choices=("file", "none", "mooncake"), default="file")
    p.add_argument("--storage-dir", help="FileStorage directory (default: a temp dir)")
    p.add_argument("--master", help="Mooncake master host:port")
    p.add_argument("--metadata", help="Mooncake metadata server URL")
    p.add_argument("--layers", type=int, default=GPT2Spec.n_layer)
    p.add_argument("--heads", type=int, default=GPT2Spec.n_head)
    p.add_argument("--hidden", type=int, default=GPT2Spec.n_embd)
    p.add_argument("--positions", type=int, default=GPT2Spec.n_positions)
    p.add_argument("--model-seed", type=int, default=0, help="weights seed (same on every node)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=ServerOptions.max_body_bytes,
        help="larger /generate bodies get 413 (default 1 MiB)",
    )
    p.add_argument(
        "--inline-model", action="store_true", help="run forward passes on the loop thread"
    )
    p.add_argument(
        "--kv-events",
        metavar="ENDPOINT",
        help="publish KV events in vLLM's ZMQ format, e.g. tcp://127.0.0.1:5557 "
        "(needs pip install -e .[events])",
    )
    p.add_argument(
        "--kv-events-encoding",
        choices=("map", "array"),
        default=ServerOptions.kv_events_encoding,
        help="map: vLLM's current KV-event protocol (tagged-map events, topic in replay "
        "replies); array: the older one (positional events) for older consumers",
    )
    p.add_argument(
        "--max-running",
        type=int,
        default=ServerOptions.max_running,
        help="requests generating at once; later ones queue while their prefetch runs",
    )
    a = p.parse_args(argv)
    if a.max_running < 1:
        p.error(f"--max-running must be >= 1, got {a.max_running}")
    return ServerOptions(
        host=a.host,
        port=a.port,
        model=GPT2Spec(
            n_layer=a.layers,
            n_head=a.heads,
            n_embd=a.hidden,
            n_positions=a.positions,
            seed=a.model_seed,
        ),
        page_size=a.page_size,
        device_pages=a.device_pages,
        host_pages=a.host_pages,
        storage=a.storage,
        storage_dir=a.storage_dir,
        master=a.master,
        metadata=a.metadata,
        max_new_tokens=a.max_new_tokens,
        max_body_bytes=a.max_body_bytes,
        model_thread=not a.inline_model,
        kv_events=a.kv_events,
        kv_events_encoding=a.kv_events_encoding,
        max_running=a.max_running,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Serve until interrupted."""
    from aiocache_kv.cli import configure_logging

    configure_logging("info")
    opts = parse_args(argv)
    log.info("server_listening", url=f"http://{opts.host}:{opts.port}")
    web.run_app(make_app(opts), host=opts.host, port=opts.port, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
