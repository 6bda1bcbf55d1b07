"""``TokenStream``: one request's tokens as they are made, then its result."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from anyio.streams.memory import MemoryObjectReceiveStream

from aiocache_kv.serving.request import ENDED, GenerationResult, Request

__all__ = ["TokenStream"]


class TokenStream:
    """A submitted request (``Engine.open_stream``): read :meth:`tokens`, then await
    :meth:`result`; :meth:`close` aborts it if it has not ended (a client that went away)."""

    def __init__(
        self,
        request: Request,
        receives: MemoryObjectReceiveStream[int],
        abort: Callable[[Request], None],
    ) -> None:
        self._request = request
        self._receives = receives
        self._abort = abort

    @property
    def id(self) -> int:
        """The engine's id of the request."""
        return self._request.id

    async def tokens(self) -> AsyncIterator[int]:
        """Each generated token as the engine makes it (ends when the request ends).  A
        reader may stop early (``break``): the request goes on, and :meth:`result` has every
        token; :meth:`close` aborts it instead."""
        async with self._receives:
            async for token in self._receives:
                yield token

    async def result(self) -> GenerationResult:
        """The finished request.

        Raises:
            What ended the request otherwise (``EngineClosedError`` when aborted or closed,
            ``CapacityError``, ...).
        """
        result: GenerationResult = await self._request.future
        return result

    def close(self) -> None:
        """Abort the request if it has not ended; its rows go back after the forward pass
        in progress."""
        if self._request.state not in ENDED:
            self._abort(self._request)
