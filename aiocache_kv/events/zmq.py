"""Publish KV events over ZeroMQ in vLLM's wire format (``vllm/distributed/kv_events.py``).

Needs the ``events`` extra (``pip install 'aiocache_kv[events]'``: pyzmq and msgpack); both are
imported when a :class:`ZmqEventPublisher` is created, not when this module is.

Wire format (what a vLLM KV-event subscriber decodes).  ``event_encoding`` picks between vLLM's
current protocol (``"map"``, the default) and the one before vllm-project/vllm#42892
(``"array"``, for consumers that still decode positional events):

* PUB socket, one 3-frame message per batch: ``[topic, seq, payload]``.  ``topic`` is the UTF-8
  topic, ``seq`` the batch number as an 8-byte big-endian unsigned int (0, 1, 2, ...),
  ``payload`` the msgpack of the batch.
* A batch is the positional array ``[ts, [event, ...], data_parallel_rank]`` in both encodings
  (vLLM's ``EventBatch`` stays ``array_like``): ``ts`` a float64 of ``time.time()``, the rank 0
  unless set (vLLM's default), ``nil`` only when set to ``None``.
* ``"map"``: each event is a map tagged under ``"type"`` (msgspec ``tag=True``,
  ``omit_defaults=True``): ``{"type": "BlockStored", "block_hashes", "parent_block_hash",
  "token_ids", "block_size", "lora_id", "medium", "lora_name"}`` (these always present, ``nil``
  when unset), then, only for pages of a LoRA namespace (or a tenant when
  ``publish_cache_salt``), ``"event_version": 1`` and ``"extra_keys"``: one entry per block, a
  list of typed keys ``{"type": "lora", "name": ...}`` on every block and
  ``{"type": "cache_salt", "salt": ...}`` on the first block of the sequence (a run whose
  ``parent_block_hash`` is ``nil``), ``nil`` for a block with no key.  ``{"type":
  "BlockRemoved", "block_hashes", "medium"}``, ``{"type": "AllBlocksCleared"}``.  The fields
  vLLM added for its own features (``group_idx`` and ``kv_cache_spec_*`` of hybrid KV-cache
  groups, ``locality``, ``ownership``) are left at their defaults, so omitted: the sidecars of
  hybrid models here publish no events of their own, and every event describes this process's
  own tiers.
* ``"array"``: each event is an array led by its class name, every field in vLLM's declaration
  order - ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
  medium, lora_name]`` plus ``extra_keys`` in vLLM's older raw form (per block a list of bare
  values: the LoRA name, then the tenant salt on the first block) when there are any,
  ``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]``.  msgspec decoders of
  older vLLM schemas ignore trailing elements they do not know.
* Replay (optional ROUTER socket): a request ``[identity, b"", start_seq]`` (what a REQ or
  DEALER client sends, ``start_seq`` 8-byte big-endian; any other body, an empty one too, is
  refused unanswered) is answered with each buffered batch with ``seq >= start_seq``, oldest
  first, then an end marker (``END_SEQ``: -1 as an 8-byte signed big-endian int).  ``"map"``
  answers as vLLM does today, each reply carrying the topic like a published message:
  ``[identity, b"", topic, seq, payload]``, ending with ``[identity, b"", b"", END_SEQ, b""]``.
  ``"array"`` answers in the older framing without the topic: ``[identity, b"", seq,
  payload]``, ending with ``[identity, b"", END_SEQ, b""]``.  An answer (replay or snapshot)
  is sent from a cursor of its connection without blocking, peers taking turns, never cut
  short by ZeroMQ's high-water mark (:mod:`aiocache_kv.events.zmq_replay`: how, and its
  bounds).  It arrives whole and in order, then its end marker; or, for a peer that
  disconnects (dropped quietly) or leaves its pipe full for
  :data:`~aiocache_kv.events.zmq_replay.REPLAY_STALL_TIMEOUT` seconds (30), it is abandoned,
  without its end marker, and not sent on to a new connection with the same routing id.
* Snapshot (on the replay socket, for a consumer that joined late or lost more than the replay
  buffer): the request ``[identity, b"", SNAPSHOT_REQUEST]`` (the bytes
  ``b"aiocache_kv/snapshot"``, never an 8-byte sequence number) is answered with the cache's
  state as ``BlockStored`` events (one per node and medium, parents first; the same encoding
  and the same batch layout as published batches, at most :data:`SNAPSHOT_CHUNK` events per
  message) framed like replay replies whose ``seq`` is ``S``, then the end marker whose last
  frame is ``S`` (8 bytes) instead of empty.  ``S`` is the sequence number of the first batch
  not reflected in the snapshot: apply the snapshot, then every batch with ``seq >= S`` (from
  the live stream, or a replay request for ``S``).  Stored events are idempotent, so a batch
  ``>= S`` whose effect the snapshot already holds changes nothing.  A publisher with no
  snapshot source (:meth:`ZmqEventPublisher.run` sets the cache as one), or whose source
  raised (logged), answers the end marker alone with an empty last frame.  Snapshots are
  built (or tried) at most once per ``snapshot_interval`` seconds (a request sooner waits,
  reuses the last one when nothing was published since, or after a failed build gets the end
  marker alone), so a flood of requests cannot monopolize the loop.  Each
  :meth:`ZmqEventPublisher.run` makes its cache the source (a publisher reused for a new
  cache snapshots the new one), unless :meth:`ZmqEventPublisher.serve_snapshots` chose one.
  A closed cache stays a source: its snapshot is then what the stream left claimed, its
  storage pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import re
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from aiocache_kv.errors import (
    CacheClosedError,
    ConfigError,
    InvalidTypeError,
    MissingDependencyError,
)
from aiocache_kv.events.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from aiocache_kv.events.zmq_replay import Answer, ReplayServer, cancel_and_wait
from aiocache_kv.logs import get_logger
from aiocache_kv.numeric import check_int, check_real

if TYPE_CHECKING:
    import zmq.asyncio

log = get_logger("aiocache_kv.events.zmq")

EventEncoding = Literal["array", "map"]

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The ``seq`` frame that ends a replay answer (its payload frame is empty)."""

_INSTALL_HINT = "pip install 'aiocache_kv[events]'"

SNAPSHOT_REQUEST = b"aiocache_kv/snapshot"
"""The replay-socket request frame that asks for a snapshot instead of a replay."""
SNAPSHOT_CHUNK = 1000
"""At most this many events per snapshot message."""
MAX_OPTION_INT = (1 << 31) - 1
"""The largest ``buffer_steps``, ``hwm`` and ``data_parallel_rank`` (ZeroMQ's high-water mark
is a C ``int``; a larger rank or buffer is no deployment's)."""
_ENDPOINT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://\S+")


class EventSource(Protocol):
    """What :meth:`ZmqEventPublisher.run` drains (:class:`~aiocache_kv.HiCache`)."""

    def events(self) -> AsyncIterator[KVEvent]: ...

    def take_events(self) -> list[KVEvent]: ...


@runtime_checkable
class SnapshotSource(Protocol):
    """What a snapshot request is answered from (:class:`~aiocache_kv.HiCache`)."""

    def snapshot_events(self) -> list[BlockStored]: ...


def _require(module: str, package: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(
            f"ZmqEventPublisher needs {package} ({module!r} could not be imported: {exc}); "
            f"install the events extra: {_INSTALL_HINT}"
        ) from exc


EVENT_VERSION = 1
"""vLLM's ``BlockStored.event_version`` for events whose ``extra_keys`` are typed keys."""


def encode_event(
    event: KVEvent, encoding: EventEncoding = "map", *, publish_cache_salt: bool = False
) -> list[Any] | dict[str, Any]:
    """``event`` as the msgpack-ready value vLLM's msgspec encoder produces for it.

    ``publish_cache_salt``: put a namespace's tenant salt into ``extra_keys`` (off by default:
    the salt is a secret that storage keys never reveal either).
    """
    if isinstance(event, BlockStored):
        fields: list[tuple[str, Any]] = [
            ("block_hashes", list(event.block_hashes)),
            ("parent_block_hash", event.parent_block_hash),
            ("token_ids", list(event.token_ids)),
            ("block_size", event.block_size),
            ("lora_id", event.lora_id),
            ("medium", event.medium),
            ("lora_name", event.lora_name),
        ]
        extra = _extra_keys(event, encoding, publish_cache_salt)
        if extra is not None:
            if encoding == "map":
                fields.append(("event_version", EVENT_VERSION))
            fields.append(("extra_keys", extra))
    elif isinstance(event, BlockRemoved):
        fields = [("block_hashes", list(event.block_hashes)), ("medium", event.medium)]
    elif isinstance(event, AllBlocksCleared):
        fields = []
    else:
        raise InvalidTypeError(f"not a KV event: {event!r}")
    tag = type(event).__name__
    if encoding == "array":
        return [tag, *(value for _, value in fields)]
    return {"type": tag, **dict(fields)}


def _extra_keys(
    event: BlockStored, encoding: EventEncoding, publish_cache_salt: bool
) -> list[Any] | None:
    """vLLM's per-block ``extra_keys`` for ``event`` (``None`` when no block has any).

    vLLM hashes the LoRA name into every block and the cache salt into the first block of a
    sequence only; the entries follow that (LoRA first, then the salt).
    """
    salt = event.cache_salt if publish_cache_salt else None
    first_block_salt = salt if event.parent_block_hash is None else None
    if event.lora_name is None and first_block_salt is None:
        return None
    typed = encoding == "map"
    lora: list[Any] = []
    if event.lora_name is not None:
        lora = [{"type": "lora", "name": event.lora_name} if typed else event.lora_name]
    keys: list[Any] = []
    for i in range(len(event.block_hashes)):
        block = list(lora)
        if i == 0 and first_block_salt is not None:
            block.append({"type": "cache_salt", "salt": first_block_salt} if typed else salt)
        keys.append(block or None)
    return keys


def encode_batch(
    events: Sequence[KVEvent],
    ts: float,
    data_parallel_rank: int | None = 0,
    encoding: EventEncoding = "map",
    *,
    publish_cache_salt: bool = False,
) -> bytes:
    """The msgpack payload of one batch (``[ts, [events...], data_parallel_rank]``)."""
    msgpack = _require("msgpack", "msgpack")
    return _pack(msgpack, events, ts, data_parallel_rank, encoding, publish_cache_salt)


def _pack(
    msgpack: Any,
    events: Sequence[KVEvent],
    ts: float,
    data_parallel_rank: int | None,
    encoding: EventEncoding,
    publish_cache_salt: bool,
) -> bytes:
    encoded = [encode_event(ev, encoding, publish_cache_salt=publish_cache_salt) for ev in events]
    payload: bytes = msgpack.packb([float(ts), encoded, data_parallel_rank], use_bin_type=True)
    return payload


class ZmqEventPublisher:
    """Publishes batches of KV events on a ZeroMQ PUB socket, vLLM-compatible.

    Everything runs on the event loop through ``zmq.asyncio``: a PUB socket never blocks (it
    drops messages beyond ``hwm`` for a slow subscriber), and replay requests are served by a
    task of their own, peer by peer, never blocking the loop (see the module docstring).
    ``endpoint`` (and ``replay_endpoint``) are bound; a ``*`` port binds a free one (see
    :attr:`endpoint` after :meth:`start`).  ``event_encoding`` picks vLLM's current
    protocol (``"map"``) or the older positional one with its replay framing (``"array"``);
    ``publish_cache_salt`` adds each namespace's tenant salt to ``extra_keys`` (see the module
    docstring).  ``data_parallel_rank`` defaults to 0, as vLLM's does.

    Use::

        async with ZmqEventPublisher("tcp://127.0.0.1:5557") as pub:
            task = asyncio.create_task(pub.run(cache))   # until the cache closes
            ...
    """

    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:5557",
        topic: str = "kv-events",
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        data_parallel_rank: int | None = 0,
        *,
        hwm: int = 100_000,
        event_encoding: EventEncoding = "map",
        publish_cache_salt: bool = False,
        snapshot_interval: float = 1.0,
    ) -> None:
        """Raises:
        ConfigError: ``snapshot_interval`` not a finite number of seconds >= 0,
            ``buffer_steps``, ``hwm`` or ``data_parallel_rank`` (unless ``None``) not an int
            in ``[0, MAX_OPTION_INT]`` (2**31-1: ZeroMQ's and vLLM's C ints), an endpoint not
            of the form ``transport://address``, a topic that is not UTF-8 encodable, or an
            unknown ``event_encoding``.
        InvalidTypeError: ``topic`` or an endpoint not a ``str``, or ``publish_cache_salt``
            not a ``bool``.
        MissingDependencyError: pyzmq or msgpack is not installed.
        """
        check_real("snapshot_interval", snapshot_interval, error=ConfigError)
        for name, value in (("buffer_steps", buffer_steps), ("hwm", hwm)):
            check_int(name, value, maximum=MAX_OPTION_INT, error=ConfigError)
        if data_parallel_rank is not None:
            check_int(
                "data_parallel_rank", data_parallel_rank, maximum=MAX_OPTION_INT, error=ConfigError
            )
        if event_encoding not in ("array", "map"):
            raise ConfigError(f"event_encoding must be 'array' or 'map', got {event_encoding!r}")
        check_endpoint("endpoint", endpoint)
        if replay_endpoint is not None:
            check_endpoint("replay_endpoint", replay_endpoint)
        if type(publish_cache_salt) is not bool:
            raise InvalidTypeError(f"publish_cache_salt must be a bool, got {publish_cache_salt!r}")
        topic_bytes = _topic_bytes(topic)
        self._zmq = _require("zmq", "pyzmq")
        self._zmq_asyncio = _require("zmq.asyncio", "pyzmq")
        self._msgpack = _require("msgpack", "msgpack")
        self._endpoint = endpoint
        self._replay_endpoint = replay_endpoint
        self.topic = topic
        self._topic_bytes = topic_bytes
        self.data_parallel_rank = data_parallel_rank
        self.event_encoding: EventEncoding = event_encoding
        self.publish_cache_salt = publish_cache_salt
        self._hwm = hwm
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self._ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self._replay_server: ReplayServer | None = None
        self._lock = asyncio.Lock()
        self._closed = asyncio.Event()
        self.batches_published = 0
        self.events_published = 0
        self.snapshot_interval = snapshot_interval
        self.snapshots_built = 0
        self._snapshot_source: SnapshotSource | None = None
        #: the source was chosen with :meth:`serve_snapshots`: ``run`` leaves it alone
        self._source_chosen = False
        #: the last snapshot (S, messages, source), the source whose last build failed, and
        #: when the last build was tried (monotonic)
        self._last_snapshot: tuple[int, list[bytes], SnapshotSource] | None = None
        self._failed_source: SnapshotSource | None = None
        self._built_at = float("-inf")

    # ------------------------------------------------------------------ lifecycle

    @property
    def endpoint(self) -> str:
        """The PUB address (the bound one once started, so a ``*`` port is resolved)."""
        if self._pub is not None:
            return str(self._pub.getsockopt_string(self._zmq.LAST_ENDPOINT))
        return self._endpoint

    @property
    def replay_endpoint(self) -> str | None:
        """The replay ROUTER address (bound one once started), or ``None``."""
        if self._replay is not None:
            return str(self._replay.getsockopt_string(self._zmq.LAST_ENDPOINT))
        return self._replay_endpoint

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch will carry."""
        return self._next_seq

    @property
    def replays_completed(self) -> int:
        """Replay and snapshot answers sent whole, end marker included."""
        return 0 if self._replay_server is None else self._replay_server.completed

    @property
    def replays_abandoned(self) -> int:
        """Replay and snapshot answers begun and given up: the peer's connection went, or it
        left its pipe full for :data:`~aiocache_kv.events.zmq_replay.REPLAY_STALL_TIMEOUT` s."""
        return 0 if self._replay_server is None else self._replay_server.abandoned

    async def start(self) -> None:
        """Bind the PUB (and replay) sockets; start serving replay requests.

        Raises:
            CacheClosedError: the publisher was closed.
            ConfigError: an endpoint could not be bound (in use, no such interface, ...; the
                message names it and the ``zmq.ZMQError`` is its cause); nothing stays bound.
        """
        if self._closed.is_set():
            raise CacheClosedError("ZmqEventPublisher is closed")
        if self._ctx is not None:
            return
        zmq = self._zmq
        self._ctx = self._zmq_asyncio.Context()
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.SNDHWM, self._hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._bind(self._pub, "endpoint", self._endpoint)
            if self._replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                # vLLM's current replies carry the topic like a published message
                topic: tuple[bytes, ...] = (
                    (self._topic_bytes,) if self.event_encoding == "map" else ()
                )
                self._replay_server = ReplayServer(
                    self._replay,
                    zmq,
                    self._answer,
                    reply_prefix=topic,
                    end_prefix=(b"", END_SEQ) if topic else (END_SEQ,),
                    snapshot_request=SNAPSHOT_REQUEST,
                )  # sets the socket's options: before it binds
                self._bind(self._replay, "replay_endpoint", self._replay_endpoint)
                self._replay_task = asyncio.get_running_loop().create_task(
                    self._replay_server.serve(), name="zmq-kv-events-replay"
                )
        except BaseException:
            self._close_sockets()
            raise
        log.info("kv_events_publisher_started", endpoint=self.endpoint, topic=self.topic)

    def _bind(self, sock: zmq.asyncio.Socket, name: str, endpoint: str) -> None:
        try:
            sock.bind(endpoint)
        except self._zmq.ZMQError as exc:
            raise ConfigError(f"{name} {endpoint!r} could not be bound: {exc}") from exc

    async def aclose(self) -> None:
        """Stop serving replay, end :meth:`run`, close the sockets.  Idempotent.  A caller
        cancelled meanwhile: the sockets still close, then its ``CancelledError`` propagates."""
        if self._closed.is_set():
            return
        self._closed.set()
        task, self._replay_task = self._replay_task, None
        try:
            if task is not None:
                await cancel_and_wait(task)  # a cancelled caller: still closes, then raises
        finally:
            async with self._lock:  # a publish in progress finishes first
                self._close_sockets()

    def _close_sockets(self) -> None:
        if self._replay_server is not None:
            self._replay_server.close()  # its monitor, before the socket and the context
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def __aenter__(self) -> ZmqEventPublisher:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ publishing

    async def publish(self, events: Sequence[KVEvent], ts: float | None = None) -> int:
        """Send ``events`` as one batch; return its sequence number.  Never blocks the loop.

        Raises:
            InvalidInputError: ``ts`` is neither ``None`` nor a finite number >= 0.
            CacheClosedError: the publisher is not started or closed.
        """
        if ts is not None:
            check_real("ts", ts, maximum=float("inf"))
        payload = _pack(
            self._msgpack,
            events,
            time.time() if ts is None else ts,
            self.data_parallel_rank,
            self.event_encoding,
            self.publish_cache_salt,
        )
        async with self._lock:
            if self._closed.is_set():
                raise CacheClosedError("ZmqEventPublisher is closed")
            if self._pub is None:
                raise CacheClosedError("ZmqEventPublisher is not started (await start() first)")
            seq = self._next_seq
            self._next_seq += 1
            await self._pub.send_multipart((self._topic_bytes, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            self.batches_published += 1
            self.events_published += len(events)
        return seq

    async def run(
        self, cache: EventSource, on_batch: Callable[[list[KVEvent]], None] | None = None
    ) -> None:
        """Publish the events of ``cache`` as they happen until it or this publisher closes.

        Every event appended to the cache's log by the time this task wakes goes into one batch
        (so a batch is what one loop tick produced).  ``on_batch`` sees each batch before it is
        sent (e.g. to count events: this task is then the log's only consumer).  Events not yet
        taken when the publisher closes stay in the cache's log.  ``cache`` becomes the source
        of snapshot requests (unless :meth:`serve_snapshots` chose one), and stays it after
        this returns.

        Raises:
            CacheClosedError: this publisher was closed before it started.
            ConfigError: a socket could not be bound (when this call starts the publisher).
        """
        if self._pub is None:
            await self.start()
        if not self._source_chosen and isinstance(cache, SnapshotSource):
            self._snapshot_source = cache  # the cache published now, even on a reused publisher
        stream = cache.events()
        closed = asyncio.ensure_future(self._closed.wait())
        try:
            while True:
                nxt = asyncio.ensure_future(_next_event(stream))
                await asyncio.wait((nxt, closed), return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():
                    with contextlib.suppress(StopAsyncIteration):
                        await cancel_and_wait(nxt)
                    return
                try:
                    first = nxt.result()
                except StopAsyncIteration:
                    return
                batch = [first, *cache.take_events()]
                if on_batch is not None:
                    on_batch(batch)
                if self._closed.is_set():
                    return
                await self.publish(batch)
        finally:
            await cancel_and_wait(closed)
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()

    # ------------------------------------------------------------------ replay, snapshots

    def serve_snapshots(self, source: SnapshotSource | None) -> None:
        """Answer snapshot requests from ``source`` from now on, whatever cache :meth:`run`
        publishes; ``None``: from the cache ``run`` publishes (each ``run(cache)`` sets its
        cache, so a publisher reused for a new cache snapshots the new one)."""
        self._snapshot_source = source
        self._source_chosen = source is not None

    def _snapshot(self, source: SnapshotSource) -> tuple[int, list[bytes]] | None:
        """Build and encode a snapshot now (on the loop, no await: the state and ``S`` are
        taken at one instant); ``None``: the source raised (logged)."""
        self._built_at = time.monotonic()
        try:
            events = source.snapshot_events()
        except Exception as exc:
            self._failed_source = source
            log.warning("kv_events_snapshot_failed", error=repr(exc))
            return None
        self._failed_source = None
        start = self._next_seq
        ts = time.time()
        how = (self.data_parallel_rank, self.event_encoding, self.publish_cache_salt)
        chunks = [events[i : i + SNAPSHOT_CHUNK] for i in range(0, len(events), SNAPSHOT_CHUNK)]
        payloads = [_pack(self._msgpack, chunk, ts, *how) for chunk in chunks]
        self.snapshots_built += 1
        self._last_snapshot = (start, payloads, source)
        log.info("kv_events_snapshot", events=len(events), messages=len(payloads), seq=start)
        return start, payloads

    def _answer(self, request: bytes) -> Answer | float | None:
        """What the replay socket sends for ``request`` (see :class:`ReplayServer`): a
        snapshot, or the buffered batches from a start seq; for a snapshot not due yet, the
        seconds to wait."""
        if request != SNAPSHOT_REQUEST:
            start = int.from_bytes(request, "big")
            # a copy of the references: publish() may append while the answer is sent
            return [item for item in self._buffer if item[0] >= start], b""
        source = self._snapshot_source
        if source is None:
            return [], b""  # the end marker alone
        last = self._last_snapshot
        if last is not None and last[0] == self._next_seq and last[2] is source:
            start, payloads = last[0], last[1]  # nothing published since: still exact
        elif (wait := self._built_at + self.snapshot_interval - time.monotonic()) > 0:
            # not due yet; after a failed build, no snapshot at all until it is
            return wait if self._failed_source is not source else ([], b"")
        else:
            built = self._snapshot(source)
            if built is None:
                return [], b""  # the source failed (logged): the end marker alone
            start, payloads = built
        return [(start, payload) for payload in payloads], start.to_bytes(8, "big")


def check_endpoint(name: str, endpoint: object) -> None:
    """Raise unless ``endpoint`` is a ZeroMQ address, ``transport://address``.

    Raises:
        InvalidTypeError: not a ``str``.
        ConfigError: not of that form.
    """
    if type(endpoint) is not str:
        raise InvalidTypeError(f"{name} must be a str, got {type(endpoint).__name__} {endpoint!r}")
    if _ENDPOINT.fullmatch(endpoint) is None:
        raise ConfigError(
            f"{name} must be a ZeroMQ endpoint 'transport://address' "
            f"(e.g. 'tcp://127.0.0.1:5557'), got {endpoint!r}"
        )


def _topic_bytes(topic: object) -> bytes:
    """``topic`` as the UTF-8 of the topic frame.

    Raises:
        InvalidTypeError: not a ``str``.
        ConfigError: not encodable (a lone surrogate).
    """
    if type(topic) is not str:
        raise InvalidTypeError(f"topic must be a str, got {type(topic).__name__} {topic!r}")
    try:
        return topic.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ConfigError(f"topic must be UTF-8 encodable, got {topic!r}: {exc}") from None


async def _next_event(stream: AsyncIterator[KVEvent]) -> KVEvent:
    return await stream.__anext__()
