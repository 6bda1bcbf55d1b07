"""``aiocache_kv.loop``: the precise selector returns the same events as epoll, waits as long
as asked (never rounded to the millisecond, never shorter), and ``run`` drives a real loop
(timers, threads, TCP on 127.0.0.1) and shuts it down as ``asyncio.run`` does."""

from __future__ import annotations

import asyncio
import select
import selectors
import socket
import threading
import time
from typing import Any

import pytest

from aiocache_kv import loop as aloop

pytestmark = pytest.mark.skipif(not aloop.PRECISE, reason="epoll only (Linux)")


def _selector() -> aloop.PreciseEpollSelector:
    return aloop.PreciseEpollSelector()


def test_events_are_the_ones_epoll_reports() -> None:
    a, b = socket.socketpair()
    sel = _selector()
    try:
        key = sel.register(a, selectors.EVENT_READ | selectors.EVENT_WRITE, data="a")
        got = sel.select(0.5)  # writable at once
        assert [(k.data, ev) for k, ev in got] == [("a", selectors.EVENT_WRITE)]
        sel.modify(a, selectors.EVENT_READ, data="a")
        assert sel.select(0.002) == []  # nothing to read yet
        b.send(b"x")
        got = sel.select(5.0)
        assert [(k.fileobj, ev) for k, ev in got] == [(key.fileobj, selectors.EVENT_READ)]
        assert sel.select(None) == got  # still readable: no wait at all
        assert sel.select(-1.0) == got
    finally:
        sel.close()
        a.close()
        b.close()


def test_a_wait_is_never_shorter_than_asked() -> None:
    """An early return with nothing ready would make the loop spin."""
    a, b = socket.socketpair()
    sel = _selector()
    try:
        sel.register(a, selectors.EVENT_READ)
        for timeout in (0.0003, 0.0017, 0.004):
            t0 = time.monotonic()
            assert sel.select(timeout) == []
            assert time.monotonic() - t0 >= timeout * 0.999, timeout
    finally:
        sel.close()
        a.close()
        b.close()


def test_the_wait_is_not_rounded_to_the_millisecond(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wait goes to ``select()`` as asked, in microseconds (the stdlib's epoll selector
    asks ``epoll_wait`` for ``ceil(timeout * 1000)`` ms), and epoll is then only polled."""
    waits: list[float | None] = []
    polls: list[float] = []
    real_select = select.select

    def spy(r: Any, w: Any, x: Any, timeout: float | None = None) -> Any:
        waits.append(timeout)
        return real_select(r, w, x, timeout)

    monkeypatch.setattr(select, "select", spy)
    sel = _selector()
    inner = sel._selector  # type: ignore[attr-defined]

    class Poll:  # the epoll object, counting its polls
        def poll(self, timeout: float = -1, maxevents: int = -1) -> Any:
            polls.append(timeout)
            return inner.poll(timeout, maxevents)

        def __getattr__(self, name: str) -> Any:
            return getattr(inner, name)

    a, b = socket.socketpair()
    try:
        sel.register(a, selectors.EVENT_READ)
        sel._selector = Poll()  # type: ignore[attr-defined]
        assert sel.select(0.00025) == []
        assert waits == [0.00025]
        assert polls == [0]  # the events are collected without a second wait
    finally:
        sel._selector = inner  # type: ignore[attr-defined]
        sel.close()
        a.close()
        b.close()


def test_a_high_numbered_epoll_set_waits_the_stdlib_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """``select()`` cannot take a descriptor >= FD_SETSIZE: then epoll waits itself."""
    monkeypatch.setattr(aloop, "FD_SETSIZE", 0)
    called: list[object] = []
    monkeypatch.setattr(select, "select", lambda *a: called.append(a))
    a, b = socket.socketpair()
    sel = _selector()
    try:
        sel.register(a, selectors.EVENT_READ)
        t0 = time.monotonic()
        assert sel.select(0.003) == []
        assert time.monotonic() - t0 >= 0.003 * 0.999
        b.send(b"x")
        assert len(sel.select(1.0)) == 1
        assert called == []
    finally:
        sel.close()
        a.close()
        b.close()


async def _echo_roundtrips(n: int) -> list[bytes]:
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while data := await r.read(100):
            w.write(data)
            await w.drain()
        w.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    got = []
    for i in range(n):
        writer.write(f"ping {i}".encode())
        got.append(await reader.read(100))
    writer.close()
    await writer.wait_closed()
    server.close()
    await server.wait_closed()
    return got


async def _main() -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    fired: list[float] = []
    t0 = loop.time()
    loop.call_later(0.0005, lambda: fired.append(loop.time() - t0))
    await asyncio.sleep(0.002)
    woke = asyncio.Event()

    def worker() -> None:  # a thread wakes the loop, as a copy engine's completion does
        time.sleep(0.001)
        loop.call_soon_threadsafe(woke.set)

    threading.Thread(target=worker).start()
    await asyncio.wait_for(woke.wait(), 5)
    off_loop = await loop.run_in_executor(None, lambda: threading.get_ident())

    async def agen() -> Any:
        try:
            yield 1
            yield 2
        finally:
            closed.append(True)

    closed: list[bool] = []
    gen = agen()
    assert await gen.__anext__() == 1  # left open: run's shutdown closes it
    return {
        "selector": type(loop._selector).__name__,  # type: ignore[attr-defined]
        "fired": fired,
        "echo": await _echo_roundtrips(3),
        "executor": off_loop != threading.get_ident(),
        "closed": closed,
    }


@pytest.mark.parametrize("runner", [True, False], ids=["Runner", "policy"])
def test_run_drives_a_real_loop_and_shuts_it_down(
    runner: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both ways ``run`` makes its loop (``asyncio.Runner``; the policy, Python 3.10)."""
    monkeypatch.setattr(aloop, "_RUNNER", runner)
    before = asyncio.get_event_loop_policy()
    out = aloop.run(_main())
    assert out["selector"] == "PreciseEpollSelector"
    assert len(out["fired"]) == 1 and out["fired"][0] >= 0.0005 * 0.999
    assert out["echo"] == [b"ping 0", b"ping 1", b"ping 2"]
    assert out["executor"]
    assert out["closed"] == [True]  # the open async generator was closed at shutdown
    assert asyncio.get_event_loop_policy() is before  # the policy is put back


@pytest.mark.parametrize("runner", [True, False], ids=["Runner", "policy"])
def test_run_raises_what_main_raises_and_refuses_a_running_loop(
    runner: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(aloop, "_RUNNER", runner)

    async def boom() -> None:
        await asyncio.sleep(0)
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        aloop.run(boom())

    async def nested() -> None:
        coro = asyncio.sleep(0)
        try:
            aloop.run(coro)
        finally:
            coro.close()

    with pytest.raises(RuntimeError, match="running event loop"):
        aloop.run(nested())


def test_new_event_loop_serves_the_cache() -> None:
    """The runtime on the precise loop: a cache round trip with a write-through copy."""
    import torch

    from aiocache_kv import HiCache
    from tests.conftest import small_config

    async def main() -> int:
        async with HiCache(small_config(write_policy="write_through")) as cache:
            toks = list(range(8))
            slots = cache.alloc(len(toks))
            r = cache.insert(toks, slots)
            if r.write_through is not None:
                await r.write_through
            cache.release(r)
            m = cache.match_prefix(toks)
            n = m.device_len
            cache.release(m)
            assert isinstance(slots, torch.Tensor)
            return n

    assert aloop.run(main()) == 8
