"""CUDA paths (copy stream + one event per copy, pinned host pool).  Run where a GPU exists."""

from __future__ import annotations

import pytest
import torch

import aiocache_kv as akv
from aiocache_kv.transfer import CudaCopyEngine
from tests.conftest import small_config

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


async def test_cuda_write_through_and_load_back_are_bit_identical() -> None:
    cfg = small_config(device="cuda", page_size=4, device_pages=8)
    async with akv.HiCache(cfg) as cache:
        assert isinstance(cache._engine, CudaCopyEngine)
        assert cache.host_pool is not None and cache.host_pool.raw.is_pinned()
        tokens = list(range(16))
        slots = cache.alloc(16)
        written = []
        for layer in range(cfg.num_layers):
            for buf in cache.device_kv(layer):
                vals = torch.randn((16, *buf.shape[1:]), device="cuda")
                buf[slots.cuda()] = vals
                written.append(vals)
        r = cache.insert(tokens, slots)
        assert r.write_through is not None
        await r.write_through
        cache.release(r)
        cache.evict(100)
        cache.device_pool.buffer.zero_()  # type: ignore[union-attr]
        m = cache.match_prefix(tokens)
        await cache.load_back(m)  # the event was synchronized before the ack: data is there
        idx = m.device_indices.cuda()
        got = [buf[idx] for layer in range(cfg.num_layers) for buf in cache.device_kv(layer)]
        for a, b in zip(got, written, strict=True):
            assert torch.equal(a, b)
        cache.release(m)
        cache.check_invariants()
