"""The publisher's replay socket: every answer whole and in order, or abandoned for its peer.

A ZeroMQ ROUTER drops a message silently once the peer's pipe is full (its send high-water
mark), so answering a large replay or snapshot in one tight loop used to lose its tail and its
end marker.  :class:`ReplayServer` serves a ROUTER socket set to ``ROUTER_MANDATORY``: a send
to a full pipe fails with ``EAGAIN`` (nothing is queued) and a send to a peer that has gone
with ``EHOSTUNREACH``.  Each peer's answer is kept as a cursor over its replies; the server
sends non-blocking, at most :data:`REPLAY_BURST` replies to a peer before the next peer's turn
(yielding to the event loop in between, so the PUB stream and other tasks keep running), and
retries a peer whose pipe is full after a short back-off, waking at once for new requests.

Bounds:

* a peer whose pipe stays full for :data:`REPLAY_STALL_TIMEOUT` seconds (it stopped reading,
  or its host vanished without closing the connection) is abandoned: its answer (and what it
  had queued) is dropped, so it never sees that answer's end marker; what ZeroMQ had already
  queued for it stays at most its high-water mark;
* a peer that disconnects mid-answer is dropped quietly (logged at info level);
* a peer has at most :data:`MAX_QUEUED_REQUESTS` requests waiting behind the one being
  answered (more are ignored, logged), and an answer holds references to the buffered
  payloads it replays, so the memory the server holds is at most one buffer's worth of
  references per peer with work in progress.
"""

from __future__ import annotations

import asyncio
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
_BACKOFF_MIN = 0.001
_BACKOFF_MAX = 0.02
_RECV_BURST = 64

Answer = tuple[Sequence[tuple[int, bytes]], bytes]
"""An answer: its replies as ``(seq, payload)``, then the last frame of its end marker."""
Answerer = Callable[[bytes], Answer | float | None]
"""Turns a request's last frame into an :data:`Answer`, a delay in seconds after which to ask
again (a snapshot not due yet), or ``None`` (nothing to send)."""


class _Peer:
    __slots__ = ("due", "end", "identity", "pos", "replies", "requests", "stalled_since")

    def __init__(self, identity: bytes) -> None:
        self.identity = identity
        self.requests: deque[bytes] = deque()
        self.replies: Sequence[tuple[int, bytes]] | None = None  # the answer being sent
        self.end = b""
        self.pos = 0  # the next reply to send; len(replies): the end marker
        self.due: float | None = None  # waiting for the answerer until then
        self.stalled_since: float | None = None  # the pipe has been full since then


class ReplayServer:
    """Serves requests on a ``ROUTER_MANDATORY`` socket with ``answer``; see the module.

    ``reply_prefix`` is put between the empty delimiter and each reply's ``seq`` (the topic
    frame, or nothing), ``end_prefix`` before the end marker's last frame (the empty topic
    frame and ``END_SEQ``, or ``END_SEQ`` alone).  ``zmq`` is the pyzmq module.
    """

    def __init__(
        self,
        sock: zmq.asyncio.Socket,
        zmq: Any,
        answer: Answerer,
        reply_prefix: tuple[bytes, ...],
        end_prefix: tuple[bytes, ...],
    ) -> None:
        self._sock = sock
        self._zmq = zmq
        self._answer = answer
        self._reply_prefix = reply_prefix
        self._end_prefix = end_prefix
        self._peers: dict[bytes, _Peer] = {}  # in arrival order: the round-robin order
        #: answers sent whole, end marker included
        self.completed = 0
        #: answers given up: the peer stopped reading for too long or went away
        self.abandoned = 0

    async def serve(self) -> None:
        """Serve until cancelled."""
        backoff = _BACKOFF_MIN
        while True:
            await self._take_requests()
            if await self._send_round():
                backoff = _BACKOFF_MIN
                continue
            timeout = self._idle_timeout(time.monotonic(), backoff)
            # wait for a request (POLLIN, the default flags), or until a peer is retried
            if timeout is None:
                await self._sock.poll()
            else:
                await self._sock.poll(max(1, round(timeout * 1000)))
                backoff = min(2 * backoff, _BACKOFF_MAX)

    async def _take_requests(self) -> None:
        zmq = self._zmq
        for _ in range(_RECV_BURST):
            try:
                frames = await self._sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3:
                log.warning("kv_events_bad_replay_request", frames=len(frames))
                continue
            identity, _, body = frames
            peer = self._peers.get(identity)
            if peer is None:
                peer = self._peers[identity] = _Peer(identity)
            if len(peer.requests) >= MAX_QUEUED_REQUESTS:
                log.warning("kv_events_replay_request_ignored", queued=len(peer.requests))
                continue
            peer.requests.append(body)

    async def _send_round(self) -> bool:
        """One turn for every peer; whether any reply went out."""
        progressed = False
        for peer in list(self._peers.values()):
            now = time.monotonic()
            if not self._next_answer(peer, now):
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
                self._drop(peer)
                log.warning(
                    "kv_events_replay_abandoned",
                    sent=peer.pos,
                    left=len(peer.replies or ()) + 1 - peer.pos,
                    stalled_s=round(now - peer.stalled_since, 3),
                )
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
            except Exception:
                log.warning("kv_events_replay_request_failed", exc_info=True)
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
                self._drop(peer)
                if exc.errno == zmq.EHOSTUNREACH:  # the peer disconnected
                    log.info("kv_events_replay_peer_gone", sent=peer.pos)
                else:
                    log.warning("kv_events_replay_failed", error=str(exc))
                return sent
            peer.stalled_since = None
            if peer.pos == len(replies):  # the end marker went: this answer is complete
                peer.replies = None
                self.completed += 1
                return sent + 1
            peer.pos += 1
        return REPLAY_BURST

    def _drop(self, peer: _Peer) -> None:
        self._peers.pop(peer.identity, None)
        self.abandoned += 1

    def _idle_timeout(self, now: float, backoff: float) -> float | None:
        """Seconds to wait for a request before the next round (``None``: until one comes)."""
        waits = [backoff for peer in self._peers.values() if peer.stalled_since is not None]
        waits += [peer.due - now for peer in self._peers.values() if peer.due is not None]
        return max(0.0, min(waits)) if waits else None
