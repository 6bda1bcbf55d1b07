"""TP groups and layouts checked before anything is agreed (found by an adversarial round).

* ``TorchTPGroup`` took a group this process is not a member of (rank and world size -1): the
  cache then ran alone, with no agreement, under a storage suffix of ``-tp-1--1``.
* Ranks configured differently issued agreement vectors of different lengths (see also
  ``test_tp_faults.py`` with real gloo ranks); here a one-process group stands in for a peer
  whose layout differs in one chosen field.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch.distributed as dist

import aiocache_kv as akv
from aiocache_kv.distributed.layout import digest, tp_layout
from aiocache_kv.errors import ConfigError
from aiocache_kv.lifecycle import Lifecycle
from aiocache_kv.testing import MemoryStorage
from tests.conftest import small_config


class Group:
    """A TP group of ``world_size`` in one process.  Its first collective (the start's layout
    check) is answered as if a peer had this rank's layout except for ``differ`` (a field
    name); the others return this rank's values."""

    def __init__(self, rank: Any = 0, world_size: Any = 2, differ: str | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.differ = differ
        self.names: list[str] = []
        self.calls = 0

    def all_reduce_min(self, values: list[int]) -> list[int]:
        self.calls += 1
        out = list(values)
        if self.calls == 1 and self.differ is not None:
            i = self.names.index(self.differ)
            peer = out[2 * i] + 1  # the peer's digest of that field
            out[2 * i], out[2 * i + 1] = min(out[2 * i], peer), min(out[2 * i + 1], -peer)
        return out


@pytest.mark.parametrize(("rank", "world"), [(-1, -1), (2, 2), (0, 0), ("0", 2), (True, 2)])
def test_a_group_without_this_rank_is_refused(rank: Any, world: Any) -> None:
    with pytest.raises(ConfigError, match=r"0 <= rank < world_size, got rank=.* world_size="):
        akv.HiCache(small_config(), tp_group=Group(rank, world))


def test_torch_group_of_which_this_process_is_no_member_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: -1)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: -1)
    with pytest.raises(ConfigError, match="not a member of the group 'g': rank -1, world size -1"):
        akv.TorchTPGroup("g")


@pytest.mark.parametrize("field", ["host_pages", "storage", "agreement queues", "components"])
async def test_a_peer_configured_differently_refuses_the_start(field: str) -> None:
    cfg = small_config(storage=MemoryStorage())
    group = Group(differ=field)
    group.names = sorted([*tp_layout(cfg), "agreement queues"])
    before = {t.name for t in threading.enumerate()}
    cache = akv.HiCache(cfg, tp_group=group)
    with pytest.raises(ConfigError, match=f"configured differently: {field} \\(this rank: "):
        await cache.start()
    assert cache._state is Lifecycle.NEW
    await cache.aclose()
    left = {t.name for t in threading.enumerate()} - before
    assert not {n for n in left if n.startswith(("aiocache-kv-copy", "akv-tp"))}, left
    group.differ = None  # the peer is configured alike now: a new cache starts
    group.calls = 0
    async with akv.HiCache(small_config(storage=MemoryStorage()), tp_group=group) as cache:
        cache.release(cache.insert([1, 2, 3, 4], cache.alloc(4)))
        await cache.flush()
        cache.check_invariants()


def test_the_layout_leaves_out_what_may_differ_per_rank() -> None:
    """A rank's shard (KV heads, head size), its device, dtype and its own storage object
    differ legitimately; settings that shape the tree's decisions must not."""
    a = tp_layout(small_config(storage=MemoryStorage(), num_kv_heads=2, head_dim=4))
    b = tp_layout(small_config(storage=MemoryStorage(), num_kv_heads=1, head_dim=8))
    assert a == b
    c = tp_layout(small_config(write_policy="write_back"))
    assert c["write_policy"] != tp_layout(small_config())["write_policy"]
    assert tp_layout(small_config(write_policy="write_through")) == tp_layout(
        small_config(write_policy=akv.WritePolicy.WRITE_THROUGH)
    )
    assert 0 <= digest("x") < 2**62


class BrokenStart:
    """A copy engine whose ``start`` fails (no thread, no CUDA stream)."""

    def start(self, loop: Any) -> None:
        raise RuntimeError("injected: the copy engine cannot start")

    def submit(self, job: Any, done: Any) -> None:
        raise AssertionError("never started")

    async def aclose(self) -> None:
        return None


async def test_a_start_whose_engine_fails_stops_the_agreement_thread() -> None:
    """Found by a review: the coordinator now starts before the copy engine, and a start
    that failed there left the TP agreement task and its thread running (a retry made a
    second one)."""
    before = {t for t in threading.enumerate()}
    cache = akv.HiCache(small_config(), tp_group=Group(), copy_engine=BrokenStart())
    with pytest.raises(RuntimeError, match="cannot start"):
        await cache.start()
    await cache.aclose()
    left = [t.name for t in set(threading.enumerate()) - before if t.name.startswith("akv-tp")]
    assert left == [], left
