"""The event log: events appended on the loop, drained by ``take`` or an async iterator."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator

from aiocache_kv.events.kv_events import KVEvent


class EventLog:
    """Buffer of KV events.  Every method runs on the loop thread."""

    def __init__(self, enabled: bool = True, max_buffered: int = 1 << 20) -> None:
        self.enabled = enabled
        self._buf: deque[KVEvent] = deque()
        self._max = max_buffered
        self._wakeup: asyncio.Event | None = None
        self._closed = False
        self.published = 0
        self.dropped = 0

    @property
    def pending(self) -> int:
        """Events buffered and not yet taken or streamed."""
        return len(self._buf)

    def append(self, event: KVEvent) -> None:
        """Record one event (dropping the oldest beyond ``max_buffered``)."""
        if len(self._buf) >= self._max:
            self._buf.popleft()
            self.dropped += 1
        self._buf.append(event)
        self.published += 1
        if self._wakeup is not None:
            self._wakeup.set()

    def take(self) -> list[KVEvent]:
        """Drain and return every buffered event, oldest first."""
        buf, self._buf = self._buf, deque()  # one swap: nothing appended in between is lost
        return list(buf)

    def close(self) -> None:
        """End every ``stream()`` once it has drained what is buffered."""
        self._closed = True
        if self._wakeup is not None:
            self._wakeup.set()

    async def stream(self) -> AsyncIterator[KVEvent]:
        """Yield events as they are appended until the log is closed."""
        if self._wakeup is None:
            self._wakeup = asyncio.Event()
        wakeup = self._wakeup
        while True:
            while self._buf:
                yield self._buf.popleft()
            if self._closed:
                return
            wakeup.clear()
            await wakeup.wait()
