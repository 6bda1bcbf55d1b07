"""The blocking-call detector itself must be able to fail a test."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

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


async def test_cpu_tensor_reads_are_fine_and_tensor_is_restored() -> None:
    before = dict(vars(torch.Tensor))
    with BlockingCallDetector() as det:
        t = torch.arange(3)
        assert t.tolist() == [0, 1, 2] and t[1].item() == 1 and bool(t[2]) and int(t[2]) == 2
        assert t.to("cpu").cpu() is not None
        assert det.violations == []
    assert dict(vars(torch.Tensor)).keys() == before.keys()  # no override left behind


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_implicit_cuda_syncs_on_the_loop_are_caught() -> None:
    t = torch.ones(4, device="cuda")
    with BlockingCallDetector() as det:
        for read in (
            lambda: t.sum().item(),
            t.tolist,
            t.cpu,
            lambda: bool(t[0]),
            lambda: float(t[0]),
            lambda: t.to("cpu"),
        ):
            with pytest.raises(BlockingCallError):
                read()
        t.to("cpu", non_blocking=True)  # asynchronous: allowed
        assert await asyncio.to_thread(lambda: t.sum().item()) == 4.0  # off the loop: fine
        assert det.violations == [
            "Tensor.item",
            "Tensor.tolist",
            "Tensor.cpu",
            "Tensor.__bool__",
            "Tensor.__float__",
            "Tensor.to",
        ]
        det.violations.clear()
