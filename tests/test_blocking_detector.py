"""The blocking-call detector itself must be able to fail a test."""

from __future__ import annotations

import asyncio
import time

import pytest

from aiocache_kv.errors import BlockingCallError
from aiocache_kv.testing import BlockingCallDetector


async def test_sleep_on_the_loop_is_caught() -> None:
    with BlockingCallDetector() as det:
        with pytest.raises(BlockingCallError, match="sleep"):
            time.sleep(0.01)  # noqa: ASYNC251
        with pytest.raises(BlockingCallError, match="open"):
            open(__file__)  # noqa: ASYNC230, SIM115
        assert det.violations == ["time.sleep", "builtins.open"]
        det.violations.clear()


async def test_same_calls_off_the_loop_are_fine() -> None:
    with BlockingCallDetector() as det:
        await asyncio.to_thread(time.sleep, 0.001)

        def read() -> str:
            with open(__file__) as f:
                return f.read(10)

        assert await asyncio.to_thread(read)
        assert det.violations == []


def test_sync_code_is_not_policed() -> None:
    with BlockingCallDetector() as det:
        time.sleep(0.001)
        assert det.violations == []
