"""The library is silent unless the application configures logging; tools print to stderr."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from aiocache_kv.logs import configure_console, get_logger

SCRIPT = """
import asyncio, torch
import aiocache_kv as akv

async def main():
    cfg = akv.CacheConfig(page_size=2, num_layers=1, num_kv_heads=1, head_dim=2,
                          dtype=torch.float32, device_pages=8, host_pages=8,
                          host_memory_reserve_bytes=0)
    async with akv.HiCache(cfg) as cache:
        slots = cache.alloc(4)
        r = cache.insert([1, 2, 3, 4], slots)
        await r.write_through
        cache.release(r)
        cache.evict(100)

asyncio.run(main())
"""


def test_library_prints_nothing_by_default() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout == "" and out.stderr == "", (out.stdout, out.stderr)


def test_events_reach_stdlib_logging(caplog: pytest.LogCaptureFixture) -> None:
    log = get_logger("aiocache_kv.test")
    with caplog.at_level(logging.INFO, logger="aiocache_kv"):
        log.info("cache_started", pages=3)
        log.debug("hidden")
    assert [r.getMessage() for r in caplog.records] == ["cache_started pages=3"]
    assert caplog.records[0].event_dict == {"event": "cache_started", "pages": 3}


def test_console_goes_to_the_given_stream_once(capsys: pytest.CaptureFixture[str]) -> None:
    root = logging.getLogger("aiocache_kv")
    before = list(root.handlers), root.level
    try:
        configure_console("warning", sys.stderr)
        configure_console("warning", sys.stderr)  # twice: still one line per event
        get_logger("aiocache_kv.test").warning("slow_store", ms=12)
        err = capsys.readouterr().err
        assert err.count("slow_store") == 1 and "ms=12" in err
    finally:
        root.handlers[:], _ = before[0], root.setLevel(before[1])


def test_console_follows_sys_stderr(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a stream, log lines go to the current ``sys.stderr`` (a progress bar that
    redirects it prints them above itself)."""
    import io

    root = logging.getLogger("aiocache_kv")
    before = list(root.handlers), root.level
    try:
        configure_console("warning")
        redirected = io.StringIO()
        monkeypatch.setattr(sys, "stderr", redirected)
        get_logger("aiocache_kv.test").warning("slow_store", ms=12)
        assert "slow_store ms=12" in redirected.getvalue()
    finally:
        root.handlers[:], _ = before[0], root.setLevel(before[1])
