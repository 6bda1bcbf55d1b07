"""``BlockingCallDetector``: fails blocking calls made on a thread running an event loop.

Besides sleeps, files, sockets, joins and explicit CUDA synchronizations, it catches the
implicit ones: reading a CUDA tensor's values on the host (``.item()``, ``.tolist()``,
``.cpu()``, ``bool()``/``int()``/``float()``, a blocking ``.to("cpu")``) waits for every
kernel queued before it.
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import inspect
import io
import os
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch

from aiocache_kv.errors import BlockingCallError

_ASYNCIO_BASE = os.path.join("asyncio", "base_events.py")


def _caller_file(depth: int) -> str:
    """File name of the frame ``depth`` levels above this function's caller."""
    frame = inspect.currentframe()
    for _ in range(depth):
        if frame is None:
            return ""
        frame = frame.f_back
    return frame.f_code.co_filename if frame is not None else ""


def _on_loop_thread() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class BlockingCallDetector:
    """Context manager: blocking calls made on a running loop's thread raise and are recorded."""

    def __init__(self) -> None:
        self.violations: list[str] = []
        self._saved: list[tuple[Any, str, Any]] = []

    def _guard(self, owner: Any, name: str, blocks: Callable[..., bool] | None = None) -> None:
        original = getattr(owner, name)
        detector = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if _on_loop_thread() and (blocks is None or blocks(*args, **kwargs)):
                what = f"{getattr(owner, '__name__', owner)}.{name}"
                detector.violations.append(what)
                raise BlockingCallError(f"blocking call {what}() on the event-loop thread")
            return original(*args, **kwargs)

        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        # an inherited attribute is restored by deleting the override, not by shadowing it
        inherited = isinstance(owner, type) and name not in vars(owner)
        self._saved.append((owner, name, None if inherited else original))
        setattr(owner, name, wrapper)

    def __enter__(self) -> BlockingCallDetector:
        def sock_blocks(sock: socket.socket, *a: Any, **k: Any) -> bool:
            return sock.gettimeout() != 0.0

        def fut_blocks(fut: concurrent.futures.Future[Any], timeout: float | None = None) -> bool:
            return not fut.done() and timeout != 0

        def wait_blocks(obj: Any, timeout: float | None = None, *a: Any, **k: Any) -> bool:
            return timeout != 0

        def join_blocks(thread: threading.Thread, timeout: float | None = None) -> bool:
            # asyncio's own shutdown_default_executor joins a finished helper thread
            caller = _caller_file(3)
            return thread.is_alive() and timeout != 0 and not caller.endswith(_ASYNCIO_BASE)

        def sleep_blocks(seconds: float) -> bool:
            return seconds > 0

        self._guard(time, "sleep", sleep_blocks)

        def open_blocks(file: object, *a: Any, **k: Any) -> bool:
            return not isinstance(file, int)  # wrapping a pipe's fd (asyncio subprocess) is fine

        self._guard(builtins, "open", open_blocks)
        self._guard(io, "open", open_blocks)
        self._guard(os, "fsync")
        for meth in ("connect", "recv", "recv_into", "send", "sendall", "accept"):
            self._guard(socket.socket, meth, sock_blocks)
        self._guard(concurrent.futures.Future, "result", fut_blocks)
        # (threading.Event.wait is left alone: Thread.start waits on one, briefly)
        self._guard(threading.Thread, "join", join_blocks)
        self._guard(subprocess.Popen, "wait", wait_blocks)
        self._guard(subprocess.Popen, "communicate")
        self._guard(subprocess, "run")
        self._guard(urllib.request, "urlopen")

        # implicit syncs: reading a CUDA tensor's values on the host waits for the device
        def on_device(t: torch.Tensor, *a: Any, **k: Any) -> bool:
            return t.is_cuda

        for meth in ("item", "tolist", "cpu", "__bool__", "__int__", "__float__", "__index__"):
            self._guard(torch.Tensor, meth, on_device)

        def to_host(t: torch.Tensor, *a: Any, **k: Any) -> bool:
            if not t.is_cuda or k.get("non_blocking", False):
                return False
            targets = [*a, k.get("device")]
            return any(
                isinstance(x, (str, torch.device)) and torch.device(x).type == "cpu"
                for x in targets
            )

        self._guard(torch.Tensor, "to", to_host)
        self._guard(torch.cuda, "synchronize")
        self._guard(torch.cuda.Event, "synchronize")
        self._guard(torch.cuda.Stream, "synchronize")
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for owner, name, original in reversed(self._saved):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._saved.clear()
