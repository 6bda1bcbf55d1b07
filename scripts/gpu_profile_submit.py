"""Where a CUDA copy job's submit spends the loop's time (run by scripts/gpu-check on a GPU).

Profiles the submits of 1 GiB of 1 MiB pages each way (slots with sums, scattered device
pages) after a warm-up, and prints the functions with the most own time.
"""

from __future__ import annotations

import asyncio
import cProfile
import pstats

import torch

from aiocache_kv.bench.cuda_copies import CopySetup, transfer
from aiocache_kv.transfer.engine import CudaCopyEngine, Direction


async def main() -> None:
    setup = CopySetup(1 << 20, 1024, torch.Generator().manual_seed(0))
    engine = CudaCopyEngine(torch.device("cuda"))
    engine.start(asyncio.get_running_loop())
    for direction in (Direction.D2H, Direction.H2D):
        jobs = [setup.job("slots+sums", direction, d, h) for d, h in setup.jobs]
        await transfer(engine, jobs)  # warm-up
        jobs = [setup.job("slots+sums", direction, d, h) for d, h in setup.jobs]
        prof = cProfile.Profile()
        prof.enable()
        wall, loop_s, _ = await transfer(engine, jobs)
        prof.disable()
        print(f"{direction.value}: wall {wall * 1e3:.1f} ms, loop in submit {loop_s * 1e3:.1f} ms")
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    await engine.aclose()


asyncio.run(main())
