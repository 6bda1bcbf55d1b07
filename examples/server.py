"""An async HTTP server: greedy generation on a small GPT-2 whose KV lives in ``HiCache``.

Run::

    pip install -e .[server]                  # aiohttp, prometheus_client
    python examples/server.py --port 8000     # binds 127.0.0.1; FileStorage in a temp dir
    curl -s localhost:8000/generate -H 'Content-Type: application/json' \\
        -d '{"tokens": [1, 2, 3], "max_new_tokens": 8}'
    curl -s localhost:8000/metrics
    python examples/server.py --kv-events tcp://127.0.0.1:5557   # + KV events (vLLM ZMQ format)

Endpoints:

* ``POST /generate`` - ``{"tokens": [int, ...], "max_new_tokens": int}`` (optional:
  ``"priority"``, an int in [0, 1000], and ``"retention_seconds"``: the retention priority of
  the request's cached pages, see ``HiCache.insert``) ->
  ``{"tokens": [...], "prompt_tokens", "cached_tokens": {"device", "host", "storage"},
  "computed_tokens", "ttft_ms", "total_ms"}``: ``cached_tokens`` are the prompt tokens the
  model did not recompute, by the tier their KV came from, so cached + computed is the prompt
  (a fully cached prompt still recomputes its last page).  Token ids only: GPT-2's tokenizer
  would have to be downloaded, and this server downloads nothing (the weights are random,
  seeded).
  A malformed request (``examples/server_requests.py``) gets ``{"error": "..."}``: 400 (bad
  JSON, encoding or fields), 413 (body over ``--max-body-bytes``, 1 MiB), 415 (a
  Content-Type other than JSON, or a charset other than UTF-8/16/32), 408 (the body took
  over ``--read-timeout`` seconds after the headers).  aiohttp's own errors (no such route
  404, a wrong method 405) get the OpenAI API's JSON error shape.
* ``GET /health`` - ``{"status": "ok", ...}`` with the cache's page counts and the engine's
  requests by state.
* ``POST /flush`` - waits until every copy and storage backup in flight when it was called has
  landed (so another node can read those pages from storage); requests that arrive meanwhile
  do not hold it up.
* ``POST /v1/completions``, ``GET /v1/models`` - the OpenAI API on token ids, for OpenAI
  clients (``examples/openai_api.py``: the prompt and the reply are token ids; the tenant is
  the ``X-Tenant`` header, else the ``user`` field; ``usage.prompt_tokens_details
  .cached_tokens`` are the prompt tokens not recomputed).
* ``POST /cache/pin``, ``/cache/unpin``, ``/cache/warm`` - operator controls: keep a prompt's
  prefix resident for a ttl, end it, warm a prompt from storage (``examples/cache_admin.py``).
* ``GET /metrics`` - Prometheus text format: the cache's metrics from
  :class:`aiocache_kv.metrics.CacheCollector` (hits and prompt tokens per tier, bytes per
  direction, load-back / write-through / backup / prefetch latency, pool pages, evictions,
  storage errors, operations in flight, event queue depth), the engine's (forward passes,
  tokens run, requests per pass, requests waiting / admitting / running, preemptions, step
  latency: ``aiocache_kv_engine_*``) and the server's own (requests, generated tokens, TTFT,
  KV events drained).  Collected in the handler, on the loop thread.

Requests are served by one :class:`aiocache_kv.serving.Engine`, so concurrent requests are
batched: prefill chunks and decodes of different requests share forward passes (at most
``--max-batch-tokens`` tokens, ``--max-running`` requests; the others queue), which run on
the engine's model thread while the loop keeps serving.  The engine prefetches a prompt from
storage on arrival (the read overlaps the queue) and again on admission (pages another node
stored since), matches, loads back, computes the uncached suffix in the device pool and
inserts every page a request completes while it runs (written through to host and storage).
``aiocache_kv_storage_served_requests_total`` counts returning prompts served from storage;
``aiocache_kv_admission_wait_seconds`` is how long requests queued before joining the batch.
A client that disconnects aborts its request (streamed or not: handlers are cancelled) and
frees its pages.  Slow clients: a connection gets ``--read-timeout`` seconds (30) to send a
request's headers, and as long again for its body; an idle keep-alive connection is closed
after it too.  The header deadline is aiohttp's keep-alive timer, which only runs from the
moment a connection opens in aiohttp releases with aio-libs/aiohttp#13681 (3.14 does): on
older ones, or for stronger slow-client protection, run behind a reverse proxy.
Two live servers started with the same ``--model-seed`` and one Mooncake master reuse each
other's KV; a ``--storage-dir`` is shared across restarts (one live server owns it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import shutil
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric

from aiocache_kv import (
    BlockRemoved,
    BlockStored,
    FileStorage,
    HiCache,
    KVCacheError,
    KVEvent,
    MooncakeStorage,
    StorageBackend,
)
from aiocache_kv.events import ZmqEventPublisher
from aiocache_kv.events.zmq import EventEncoding
from aiocache_kv.events.zmq import check_endpoint as check_zmq_endpoint
from aiocache_kv.logs import get_logger
from aiocache_kv.metrics import CacheCollector, histogram_buckets
from aiocache_kv.models import GPT2Spec, build_gpt2, cache_config_for
from aiocache_kv.serving import Engine

if str(Path(__file__).resolve().parent) not in sys.path:  # loaded by path (tests): its sibling
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from cache_admin import CacheAdminRoutes
from openai_api import OpenAIRoutes, json_errors
from server_metrics import ServerMetrics
from server_requests import BadRequest, ClientGone, RequestLimits, parse_generate_request

log = get_logger("aiocache_kv.examples.server")


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
    kv_events: str | None = None  #: ZMQ PUB endpoint for KV events (vLLM format), or off
    #: ``map``: vLLM's current KV-event protocol; ``array``: the one before vLLM#42892
    kv_events_encoding: EventEncoding = "map"
    #: requests in the engine's batch at once; the rest queue in arrival order (their prefetch
    #: runs meanwhile)
    max_running: int = 4
    max_batch_tokens: int = 256  #: tokens one forward pass runs at most (prefills and decodes)
    #: seconds a client has to send a request's headers, then its body (408); also the
    #: keep-alive timeout of an idle connection
    read_timeout: float = 30.0


#: ``EngineStatistics`` counters exported as ``aiocache_kv_engine_<name>_total``
ENGINE_COUNTERS = {
    "steps": "Forward passes run.",
    "step_tokens": "Tokens run through the model (prefill chunks and decodes).",
    "preemptions": "Requests taken out of the batch for room.",
    "shared_in_flight_tokens": "Prompt tokens reused once another running request computed them.",
}


class EngineCollector:
    """:meth:`Engine.statistics` as ``aiocache_kv_engine_*`` families: the counters above,
    requests by state, requests per forward pass and its latency.  One snapshot per scrape,
    collected on the loop thread like the cache's."""

    def __init__(self, engine: Engine, registry: CollectorRegistry) -> None:
        self.engine = engine
        registry.register(self)

    def collect(self) -> Iterator[Metric]:
        """The families of one :meth:`Engine.statistics` snapshot."""
        st = self.engine.statistics()
        p = "aiocache_kv_engine_"
        for name, doc in ENGINE_COUNTERS.items():
            yield CounterMetricFamily(p + name, doc, value=getattr(st, name))
        queues = GaugeMetricFamily(p + "requests", "Requests by state.", labels=["state"])
        for state in ("waiting", "admitting", "running"):
            queues.add_metric([state], getattr(st, state))
        yield queues
        for name, doc, snap in (
            ("batch_size", "Requests per forward pass.", st.batch_size),
            ("step_seconds", "One forward pass.", st.step),
        ):
            hist = HistogramMetricFamily(p + name, doc)
            hist.add_metric([], histogram_buckets(snap), snap.sum)
            yield hist


# ---------------------------------------------------------------------------- the server


class GenerateServer:
    """The model, the cache, the engine and the HTTP handlers."""

    def __init__(self, opts: ServerOptions) -> None:
        self.opts = opts
        self.limits = RequestLimits(
            vocab_size=opts.model.vocab_size,
            max_new_tokens=opts.max_new_tokens,
            max_positions=opts.model.n_positions,
            max_kv_slots=opts.device_pages * opts.page_size,
            max_body_bytes=opts.max_body_bytes,
            read_timeout=opts.read_timeout,
        )
        #: scraped on the loop (``/metrics``): the cache's collector reads loop-owned state
        self.registry = CollectorRegistry()
        self.metrics = ServerMetrics(self.registry)
        self.cache: HiCache | None = None
        self.engine: Engine | None = None
        self.started = time.monotonic()

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
            self.cache = cache = await stack.enter_async_context(HiCache(cfg))
            engine = Engine(
                model, cache, max_batch_tokens=o.max_batch_tokens, max_running=o.max_running
            )
            stop_engine = await stack.enter_async_context(engine_task(engine))
            self.engine = engine
            collectors = (
                CacheCollector(
                    cache, prompts=engine.counters.prompt_tokens, registry=self.registry
                ),
                EngineCollector(engine, self.registry),
            )
            for collector in collectors:
                stack.callback(self.registry.unregister, collector)
            drain = asyncio.get_running_loop().create_task(self._drain_events(cache, publisher))
            log.info("server_ready", model=o.model.name, storage=o.storage, page_size=o.page_size)
            try:
                yield
            finally:
                await stop_engine()  # requests still running fail with EngineClosedError
                await cache.flush()
                await cache.aclose()  # ends the events stream
                await drain

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
        """``POST /generate`` (a client that leaves, mid-body or while its request runs,
        cancels this handler: its request is aborted and counted as an ``error``)."""
        try:
            return await self._generate(request)
        except asyncio.CancelledError:
            self.metrics.requests.labels(outcome="error").inc()
            raise

    async def _generate(self, request: web.Request) -> web.Response:
        try:
            req = await parse_generate_request(request, self.limits)
        except BadRequest as exc:  # ClientGone: nobody reads the reply
            outcome = "error" if isinstance(exc, ClientGone) else "bad_request"
            self.metrics.requests.labels(outcome=outcome).inc()
            return web.json_response({"error": exc.message}, status=exc.status)
        assert self.engine is not None
        try:  # prefetch on arrival, queue, admission, batched steps: all the engine's
            res = await self.engine.generate(
                req.tokens,
                max_new_tokens=req.max_new_tokens,
                priority=req.priority,
                retention=req.retention,
            )
        except KVCacheError as exc:
            self.metrics.requests.labels(outcome="error").inc()
            status = 400 if isinstance(exc, ValueError) else 503
            return web.json_response({"error": f"{type(exc).__name__}: {exc}"}, status=status)
        self.metrics.record(res)
        src = res.attribution  # only reused tokens count as cached: cached + computed = prompt
        return web.json_response(
            {
                "tokens": res.tokens,
                "prompt_tokens": res.prompt_len,
                "cached_tokens": {"device": src.device, "host": src.host, "storage": src.storage},
                "computed_tokens": src.computed,
                "ttft_ms": round(res.ttft * 1e3, 3),
                "total_ms": round(res.total * 1e3, 3),
            }
        )

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
        if self.cache is None or self.engine is None:
            return web.json_response({"status": "starting"}, status=503)
        st = self.cache.statistics()
        es = self.engine.statistics()
        return web.json_response(
            {
                "status": "ok",
                "model": self.opts.model.name,
                "uptime_s": round(time.monotonic() - self.started, 3),
                "device_pages": {"total": st.device.total_pages, "free": st.device.free_pages},
                "host_pages": {"total": st.host.total_pages, "free": st.host.free_pages},
                "storage": self.opts.storage,
                "requests": {
                    "waiting": es.waiting,
                    "admitting": es.admitting,
                    "running": es.running,
                },
            }
        )

    async def metrics_handler(self, request: web.Request) -> web.Response:
        """``GET /metrics`` (Prometheus text format 0.0.4), collected here on the loop thread."""
        if self.cache is None:
            return web.json_response({"status": "starting"}, status=503)
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


@contextlib.asynccontextmanager
async def engine_task(engine: Engine) -> AsyncIterator[Callable[[], Awaitable[None]]]:
    """Run ``engine`` (``async with``) in a task of its own until the stop function returned
    here is awaited (it also runs on exit).  An engine is entered and left in one task, and
    aiohttp may run a cleanup context's start and end in different ones."""
    ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    stop = asyncio.Event()

    async def own() -> None:
        async with engine:
            ready.set_result(None)
            await stop.wait()

    task = asyncio.create_task(own(), name="aiocache_kv.server.engine")
    done, _ = await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        await task  # raises what starting the engine raised

    async def stop_engine() -> None:
        stop.set()
        await task

    try:
        yield stop_engine
    finally:
        await stop_engine()


SERVER: web.AppKey[GenerateServer] = web.AppKey("server", GenerateServer)


def runner_kwargs(opts: ServerOptions) -> dict[str, Any]:
    """What ``web.run_app`` (or a ``web.AppRunner``) serves :func:`make_app`'s app with: a
    handler is cancelled when its client disconnects (the engine aborts its request), a
    connection is closed after ``opts.read_timeout`` s without a complete request, and the
    unread rest of a refused body (413, 408) is drained for at most as long (10 s)."""
    return {
        "handler_cancellation": True,
        "keepalive_timeout": opts.read_timeout,
        "lingering_time": min(opts.read_timeout, 10.0),
    }


def make_app(opts: ServerOptions) -> web.Application:
    """The aiohttp application (the model is built and the cache opened at start-up); serve
    it with :func:`runner_kwargs`."""
    server = GenerateServer(opts)
    app = web.Application(middlewares=[json_errors])
    app[SERVER] = server
    app.cleanup_ctx.append(server.lifespan)
    app.router.add_post("/generate", server.generate)
    app.router.add_post("/flush", server.flush)
    app.router.add_get("/health", server.health)
    app.router.add_get("/metrics", server.metrics_handler)
    OpenAIRoutes(server, opts.model.name).add_to(app)  # /v1/completions, /v1/models
    CacheAdminRoutes(server).add_to(app)  # /cache/pin, /cache/unpin, /cache/warm
    return app


def check_flags(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """``p.error`` (exit 2) on a flag the server could not start, or serve a request, with."""
    for flag in (
        "page_size", "device_pages", "host_pages", "layers", "heads", "hidden", "positions",
        "max_new_tokens", "max_body_bytes", "max_running", "max_batch_tokens",
    ):  # fmt: skip
        if getattr(a, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(a, flag)}")
    if a.hidden % a.heads:
        p.error(f"--hidden {a.hidden} must be a multiple of --heads {a.heads}")
    if not 0 <= a.port <= 65535:
        p.error(f"--port must be in [0, 65535], got {a.port}")
    if not 0 < a.read_timeout < math.inf:
        p.error(f"--read-timeout must be a positive number of seconds, got {a.read_timeout}")
    if a.kv_events is not None:
        try:
            check_zmq_endpoint("--kv-events", a.kv_events)
        except KVCacheError as exc:
            p.error(str(exc))


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
        help="requests in the engine's batch at once; later ones queue while their prefetch runs",
    )
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        default=ServerOptions.max_batch_tokens,
        help="tokens one forward pass runs at most, prefill chunks and decodes (default 256)",
    )
    p.add_argument(
        "--read-timeout",
        type=float,
        default=ServerOptions.read_timeout,
        help="seconds a client has to send a request's headers, then as long for its body "
        "(408); an idle keep-alive connection is closed after it too (default 30)",
    )
    a = p.parse_args(argv)
    check_flags(p, a)
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
        kv_events=a.kv_events,
        kv_events_encoding=a.kv_events_encoding,
        max_running=a.max_running,
        max_batch_tokens=a.max_batch_tokens,
        read_timeout=a.read_timeout,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Serve until interrupted."""
    from aiocache_kv.cli import configure_logging
    from aiocache_kv.loop import new_event_loop

    configure_logging("info")
    opts = parse_args(argv)
    log.info("server_listening", url=f"http://{opts.host}:{opts.port}")
    # timers to the microsecond: asyncio's default loop rounds its waits up to whole ms
    loop = new_event_loop()
    web.run_app(
        make_app(opts), host=opts.host, port=opts.port, print=None, loop=loop, **runner_kwargs(opts)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
