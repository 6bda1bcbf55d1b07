"""The publisher's replay socket: every answer whole and in order, or abandoned for its peer.

A ZeroMQ ROUTER drops a message silently once the peer's pipe is full (its send high-water
mark), so answering a large replay or snapshot in one tight loop used to lose its tail and its
end marker.  :class:`ReplayServer` serves a ROUTER socket set to ``ROUTER_MANDATORY``: a send
to a full pipe fails with ``EAGAIN`` (nothing is queued) and a send to a peer that has gone
with ``EHOSTUNREACH``.  Each peer's answer is kept as a cursor over its replies; the server
sends non-blocking, at most :data:`REPLAY_BURST` replies to a peer before the next peer's turn
(yielding to the event loop in between, so the PUB stream and other tasks keep running), and
retries a peer whose pipe is full after a short back-off, waking at once for new requests.

A cursor belongs to one connection, not to a routing id: a consumer that reconnects with the
same explicit routing id (``ZMQ_ROUTING_ID``) gets its new requests' answers, never the rest of
the old connection's.  The server watches the socket's connections (a socket monitor: each
accepted and each closed connection's descriptor) and notes which connection every request came
on (the descriptor libzmq reports for the message); a connection that closes loses its answer
and its queued requests at once, and a request that comes on another connection than the one
its routing id's answer is for drops that answer.  What libzmq does not let it tell apart:

* the ROUTER routes a reply by routing id alone, and gives a closed connection's id to a new
  one while it processes its commands, inside a send too: the server looks for closed
  connections before every burst, so a new connection whose handshake completes in the same
  instant as the old one's close is noticed, while a burst of the old answer is going out,
  may receive the rest of that one burst (at most :data:`REPLAY_BURST` replies, the old end
  marker among them when the answer was that close to done);
* a request the old connection sent just before it closed, still unread when a new connection
  with the same routing id has been accepted on the same descriptor number, counts as the new
  connection's and is answered to it;
* over ``inproc://`` there are no descriptors and no connection events: connections with the
  same routing id are told apart only by a failed send (``EHOSTUNREACH``).

A connection that arrives while the ROUTER still gives its routing id to another (the old one
closed, but libzmq had not processed that yet) is not given the id (``ROUTER_HANDOVER`` is off,
as it must be: a handover cuts the old connection off without a close event): libzmq never reads
its requests nor routes anything to it, so the consumer gets no answer on that connection and
must reconnect.

Bounds:

* a request is an 8-byte start seq or the snapshot marker; any other body (an empty one
  included: it does not mean "everything") or framing is refused when it arrives, never
  queued, and a frame over :data:`MAX_REQUEST_SIZE` bytes is refused by libzmq itself
  (``MAXMSGSIZE``: the sender is disconnected);
* a peer has at most :data:`MAX_QUEUED_REQUESTS` requests waiting behind the one being
  answered (more are ignored), so at most a few hundred bytes of requests per peer;
* refused and ignored requests, and requests whose answer failed, are logged at warning
  level the first time, then at most once per :data:`LOG_INTERVAL` seconds with how many were
  not logged since (``suppressed``), however fast a peer sends them;
* a peer whose pipe stays full for :data:`REPLAY_STALL_TIMEOUT` seconds (it stopped reading,
  or its host vanished without closing the connection) is abandoned: its answer (and what it
  had queued) is dropped, so it never sees that answer's end marker; what ZeroMQ had already
  queued for it stays at most its high-water mark;
* a peer that disconnects mid-answer is dropped quietly (logged at info level);
* an answer holds references to the buffered payloads it replays, so the memory the server
  holds is at most one buffer's worth of references per peer with work in progress;
* the monitor's pipe has no high-water mark (libzmq's I/O thread, which the PUB stream shares,
  would block on a full one): it holds the events of connections made and closed while the
  loop is busy, a few dozen bytes each, until the next round reads them.

``completed`` counts answers sent whole, end marker included; ``abandoned`` counts answers
begun (taken from the queue and built) and not finished, whatever the reason, each once.
Requests dropped before their answer began are not answers and count in neither.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import struct
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from aiocache_kv.logs import get_logger

if TYPE_CHECKING:
    import zmq.asyncio

log = get_logger("aiocache_kv.events.zmq")

REPLAY_STALL_TIMEOUT = 30.0
"""Seconds a peer may leave its pipe full (taking no reply at all) before its answer is
abandoned; read at each check, so it can be changed at run time.  ZeroMQ frees room in a pipe
in steps of about half its high-water mark, so a consumer counts as reading if it takes some
500 replies (the default 1000-message marks) in that time.  A stalled peer is retried every
20 ms at most."""
REPLAY_BURST = 64
"""At most this many replies to one peer in a row before the next peer's turn and a yield to
the event loop."""
MAX_QUEUED_REQUESTS = 16
"""Requests a peer may have waiting behind the one being answered; further ones are ignored."""
MAX_REQUEST_SIZE = 1024
"""The socket's ``MAXMSGSIZE``: libzmq disconnects a peer that sends a larger frame.  Far above
a request (8 bytes, or the snapshot marker), above the handshake's own frames (a 255-byte
routing id travels in one)."""
LOG_INTERVAL = 10.0
"""Seconds between two warnings of one kind about a remote peer's requests (see the module)."""
_BACKOFF_MIN = 0.001
_BACKOFF_MAX = 0.02
_RECV_BURST = 64
_EVENT = struct.Struct("=Hi")  # a monitor event's first frame: event id, value (here the fd)
_MONITORS = itertools.count()  # numbers the monitors' inproc addresses

Answer = tuple[Sequence[tuple[int, bytes]], bytes]
"""An answer: its replies as ``(seq, payload)``, then the last frame of its end marker."""
Answerer = Callable[[bytes], Answer | float | None]
"""Turns a request's last frame into an :data:`Answer`, a delay in seconds after which to ask
again (a snapshot not due yet), or ``None`` (nothing to send)."""


async def cancel_and_wait(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` and wait until it has ended, without taking its ``CancelledError`` for
    the caller's own (``await task`` in ``suppress(CancelledError)`` would swallow a
    cancellation of the caller).  A caller cancelled meanwhile still waits for ``task`` to end,
    then its ``CancelledError`` propagates; otherwise an exception ``task`` ended with, other
    than its cancellation, is raised."""
    task.cancel()
    cancelled: asyncio.CancelledError | None = None
    while not task.done():
        try:
            await asyncio.wait((task,))
        except asyncio.CancelledError as exc:
            cancelled = exc
    error = None if task.cancelled() else task.exception()  # retrieved, in any case
    if cancelled is not None:
        raise cancelled
    if error is not None:
        raise error


class _RateLimitedWarning:
    """A warning about remote peers' requests, logged the first time, then at most once per
    :data:`LOG_INTERVAL` seconds with the count of those not logged since."""

    __slots__ = ("event", "last", "suppressed")

    def __init__(self, event: str) -> None:
        self.event = event
        self.last = float("-inf")
        self.suppressed = 0

    def __call__(self, **fields: Any) -> None:
        now = time.monotonic()
        if now - self.last < LOG_INTERVAL:
            self.suppressed += 1
            return
        if self.suppressed:
            fields["suppressed"] = self.suppressed
        log.warning(self.event, **fields)
        self.last = now
        self.suppressed = 0


class _Peer:
    __slots__ = ("conn", "due", "end", "identity", "pos", "replies", "requests", "stalled_since")

    def __init__(self, identity: bytes, conn: int | None) -> None:
        self.identity = identity
        self.conn = conn  # the connection its requests came on (None: not known)
        self.requests: deque[bytes] = deque()
        self.replies: Sequence[tuple[int, bytes]] | None = None  # the answer being sent
        self.end = b""
        self.pos = 0  # the next reply to send; len(replies): the end marker
        self.due: float | None = None  # waiting for the answerer until then
        self.stalled_since: float | None = None  # the pipe has been full since then


class ReplayServer:
    """Serves requests on a ROUTER socket with ``answer``; see the module.

    Sets the socket's options (``LINGER`` 0, ``ROUTER_MANDATORY``, ``MAXMSGSIZE``) and attaches
    a monitor to it, so it is made before the socket binds; :meth:`close` it before the socket
    and its context.  ``reply_prefix`` is put between the empty delimiter and each reply's
    ``seq`` (the topic frame, or nothing), ``end_prefix`` before the end marker's last frame
    (the empty topic frame and ``END_SEQ``, or ``END_SEQ`` alone).  A request's body is an
    8-byte start seq or ``snapshot_request``.  ``zmq`` is the pyzmq module.
    """

    def __init__(
        self,
        sock: zmq.asyncio.Socket,
        zmq: Any,
        answer: Answerer,
        reply_prefix: tuple[bytes, ...],
        end_prefix: tuple[bytes, ...],
        snapshot_request: bytes,
    ) -> None:
        self._sock = sock
        self._zmq = zmq
        self._answer = answer
        self._reply_prefix = reply_prefix
        self._end_prefix = end_prefix
        self._snapshot_request = snapshot_request
        self._peers: dict[bytes, _Peer] = {}  # in arrival order: the round-robin order
        self._conns: dict[int, int] = {}  # descriptor -> the connection now on it
        self._last_conn = 0
        sock.setsockopt(zmq.LINGER, 0)
        # a full pipe fails a send (EAGAIN) instead of dropping it silently
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_SIZE)
        addr = f"inproc://aiocache_kv.replay-monitor.{next(_MONITORS)}"
        sock.monitor(addr, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._monitor = sock.context.socket(zmq.PAIR)
        # unbounded: libzmq's I/O thread (the PUB stream's too) would block on a full pipe
        # of events while the loop is busy; an event is a few dozen bytes
        self._monitor.setsockopt(zmq.RCVHWM, 0)
        self._monitor.setsockopt(zmq.LINGER, 0)
        self._monitor.connect(addr)
        self._poller = zmq.asyncio.Poller()
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._bad_request = _RateLimitedWarning("kv_events_bad_replay_request")
        self._ignored = _RateLimitedWarning("kv_events_replay_request_ignored")
        self._failed = _RateLimitedWarning("kv_events_replay_request_failed")
        #: answers sent whole, end marker included
        self.completed = 0
        #: answers begun and given up: the peer stopped reading for too long or went away
        self.abandoned = 0

    def close(self) -> None:
        """Detach and close the monitor (before the socket and its context close).
        Idempotent."""
        if not self._monitor.closed:
            with contextlib.suppress(self._zmq.ZMQError):  # the socket closed first
                self._sock.monitor(None, 0)
            self._monitor.close(linger=0)

    async def serve(self) -> None:
        """Serve until cancelled."""
        backoff = _BACKOFF_MIN
        while True:
            await self._take_events()
            await self._take_requests()
            if await self._send_round():
                backoff = _BACKOFF_MIN
                continue
            timeout = self._idle_timeout(time.monotonic(), backoff)
            # wait for a request or a connection event, or until a peer is retried
            if timeout is None:
                await self._poller.poll()
            else:
                await self._poller.poll(max(1, round(timeout * 1000)))
                backoff = min(2 * backoff, _BACKOFF_MAX)

    async def _take_events(self) -> None:
        """Note the connections accepted and closed since the last call; a closed one's
        peer is dropped (its answer abandoned, its requests forgotten)."""
        zmq = self._zmq
        while True:
            try:
                frames = await self._monitor.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            event, fd = _EVENT.unpack_from(frames[0])
            if event == zmq.EVENT_ACCEPTED:
                self._last_conn += 1
                self._conns[fd] = self._last_conn
            elif event == zmq.EVENT_DISCONNECTED:
                conn = self._conns.pop(fd, None)
                if conn is None:
                    continue
                for peer in [p for p in self._peers.values() if p.conn == conn]:
                    self._gone(peer)

    async def _connection(self, frame: Any) -> int | None:
        """The connection ``frame`` came on (``None``: not known, e.g. over inproc)."""
        try:
            fd = frame.get(self._zmq.SRCFD)
        except self._zmq.ZMQError:  # no descriptor
            return None
        # the events up to this request: its connection's acceptance, and the close of one
        # that had the same descriptor before it
        await self._take_events()
        return self._conns.get(fd)

    async def _take_requests(self) -> None:
        zmq = self._zmq
        for _ in range(_RECV_BURST):
            try:
                frames = await self._sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            body = frames[-1].bytes
            if len(frames) != 3 or (len(body) != 8 and body != self._snapshot_request):
                self._bad_request(frames=len(frames), size=len(body))
                continue
            conn = await self._connection(frames[-1])
            identity = frames[0].bytes
            peer = self._peers.get(identity)
            if peer is not None and peer.conn != conn:
                # a new connection with the routing id: the old one's answer is not for it
                self._gone(peer, reconnected=True)
                peer = None
            if peer is None:
                peer = self._peers[identity] = _Peer(identity, conn)
            if len(peer.requests) >= MAX_QUEUED_REQUESTS:
                self._ignored(queued=len(peer.requests))
                continue
            peer.requests.append(body)

    async def _send_round(self) -> bool:
        """One turn for every peer; whether any reply went out."""
        progressed = False
        for peer in list(self._peers.values()):
            now = time.monotonic()
            if self._peers.get(peer.identity) is not peer or not self._next_answer(peer, now):
                continue
            # a connection that closed loses its answer before another can take its routing id
            await self._take_events()
            if self._peers.get(peer.identity) is not peer:
                continue
            sent = await self._send_burst(peer)
            if sent:
                progressed = True
                await asyncio.sleep(0)  # the loop runs between two peers' bursts
            elif (
                self._peers.get(peer.identity) is peer  # not dropped by the send
                and peer.stalled_since is not None
                and now - peer.stalled_since >= REPLAY_STALL_TIMEOUT
            ):
                log.warning(
                    "kv_events_replay_abandoned",
                    sent=peer.pos,
                    left=len(peer.replies or ()) + 1 - peer.pos,
                    stalled_s=round(now - peer.stalled_since, 3),
                )
                self._drop(peer)
        return progressed

    def _next_answer(self, peer: _Peer, now: float) -> bool:
        """Whether ``peer`` has an answer to send now (taking its next request if needed);
        a peer with nothing left is forgotten."""
        while peer.replies is None:
            if peer.due is not None and now < peer.due:
                return False
            if not peer.requests:
                del self._peers[peer.identity]
                return False
            try:
                answer = self._answer(peer.requests[0])
            except Exception as exc:
                self._failed(error=repr(exc))
                answer = None
            if isinstance(answer, float):
                peer.due = now + answer
                return False
            peer.requests.popleft()
            peer.due = None
            if answer is not None:
                peer.replies, peer.end = answer
                peer.pos = 0
                peer.stalled_since = None
        return True

    async def _send_burst(self, peer: _Peer) -> int:
        """Send ``peer`` up to :data:`REPLAY_BURST` replies without blocking; how many went."""
        zmq = self._zmq
        replies = peer.replies
        assert replies is not None
        head = (peer.identity, b"")
        for sent in range(REPLAY_BURST):
            if peer.pos < len(replies):
                seq, payload = replies[peer.pos]
                frames = (*head, *self._reply_prefix, seq.to_bytes(8, "big"), payload)
            else:
                frames = (*head, *self._end_prefix, peer.end)
            try:
                await self._sock.send_multipart(frames, flags=zmq.NOBLOCK)
            except zmq.Again:  # the pipe is full: retried later
                if peer.stalled_since is None:
                    peer.stalled_since = time.monotonic()
                return sent
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EHOSTUNREACH:  # the peer disconnected
                    self._gone(peer)
                else:
                    log.warning("kv_events_replay_failed", error=str(exc))
                    self._drop(peer)
                return sent
            peer.stalled_since = None
            if peer.pos == len(replies):  # the end marker went: this answer is complete
                peer.replies = None
                self.completed += 1
                return sent + 1
            peer.pos += 1
        return REPLAY_BURST

    def _gone(self, peer: _Peer, **fields: Any) -> None:
        """Drop ``peer``, whose connection has gone (logged at info level)."""
        if peer.replies is not None or peer.requests:
            sent = 0 if peer.replies is None else peer.pos
            log.info("kv_events_replay_peer_gone", sent=sent, **fields)
        self._drop(peer)

    def _drop(self, peer: _Peer) -> None:
        """Forget ``peer``: its requests, and its answer in progress (one abandoned)."""
        if self._peers.get(peer.identity) is peer:
            del self._peers[peer.identity]
        peer.requests.clear()
        if peer.replies is not None:
            peer.replies = None
            self.abandoned += 1

    def _idle_timeout(self, now: float, backoff: float) -> float | None:
        """Seconds to wait for a request before the next round (``None``: until one comes)."""
        waits = [backoff for peer in self._peers.values() if peer.stalled_since is not None]
        waits += [peer.due - now for peer in self._peers.values() if peer.due is not None]
        return max(0.0, min(waits)) if waits else None
