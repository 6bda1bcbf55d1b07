"""Device page ids are numpy int64 arrays inside the cache (issue #27): the per-request path
(match, alloc, insert with ``prefix=``, release) crosses to torch only in ``alloc``'s return
value, and the handles' properties still hand out tensors (copies where the cache keeps the
array for itself)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import aiocache_kv as akv
from tests.conftest import small_config

P = 2  # small_config's page size


async def test_serving_step_makes_no_tensor_but_alloc(monkeypatch: pytest.MonkeyPatch) -> None:
    async with akv.HiCache(small_config(device_pages=32, host_pages=0)) as cache:
        first = cache.alloc(8)
        cache.release(cache.insert(list(range(8)), first))
        made: list[int] = []
        real = torch.from_numpy

        def counting(arr: np.ndarray) -> torch.Tensor:
            made.append(arr.size)
            return real(arr)

        monkeypatch.setattr(torch, "from_numpy", counting)
        toks = [*range(8), 50, 51, 52, 53]
        m = cache.match_prefix(toks)
        assert m.device_len == 8
        own = cache.alloc(len(toks) - m.device_len)
        assert len(made) == 1, "alloc makes its one tensor"
        r = cache.insert(toks, own, prefix=m)
        cache.release(r)
        cache.release(m)
        assert len(made) == 1, f"the insert made tensors of sizes {made[1:]}"
        cache.check_invariants()


async def test_nodes_keep_arrays_and_handles_give_tensors() -> None:
    async with akv.HiCache(small_config(device_pages=32, host_pages=0)) as cache:
        toks = list(range(8))
        a = cache.alloc(8)
        ra = cache.insert(toks, a)
        assert isinstance(ra.node.device_pages, np.ndarray)
        assert ra.node.device_pages.dtype == np.int64
        b = cache.alloc(8)  # the same pages computed again: the tree keeps a's, b's retained
        rb = cache.insert(toks, b)
        kept = rb.retained_pages
        assert isinstance(kept, torch.Tensor) and sorted(kept.tolist()) == sorted(
            {int(s) // P for s in b[::P]}
        )
        kept.fill_(0)  # a copy: writing it changes nothing the cache keeps
        assert sorted(rb.retained_pages.tolist()) == sorted({int(s) // P for s in b[::P]})
        m = cache.match_prefix(toks)
        assert isinstance(m.device_pages, torch.Tensor) and isinstance(
            m.device_indices, torch.Tensor
        )
        assert m.device_indices.tolist() == a.tolist() == rb.device_indices.tolist()
        for h in (m, ra, rb):
            cache.release(h)
        cache.check_invariants()
        assert cache.statistics().device.retained_pages == 0
