"""Tensor-parallel groups: the one collective the cache needs, a packed MIN all-reduce.

``all_reduce_min`` is blocking; the cache calls it only from its agreement thread, never on the
event loop, and always in the same order on every rank (see :mod:`.agreement`).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from aiocache_kv.errors import ConfigError


@runtime_checkable
class TPGroup(Protocol):
    """The ranks that shard one model and must agree on every tree-shaping decision."""

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        ...

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        ...

    def all_reduce_min(self, values: list[int]) -> list[int]:
        """Element-wise minimum of ``values`` over all ranks (blocking; same length everywhere)."""
        ...


class SingleRank:
    """The identity group of a single-process cache."""

    rank = 0
    world_size = 1

    def all_reduce_min(self, values: list[int]) -> list[int]:
        """Nothing to agree with: the values themselves."""
        return list(values)


class TorchTPGroup:
    """A ``torch.distributed`` process group (gloo on CPU for the control plane).

    Raises:
        ConfigError: ``torch.distributed`` is not initialized, or this process is not a
            member of ``group``.
    """

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("TorchTPGroup needs torch.distributed.init_process_group() first")
        self._dist = dist
        self._group = group
        self._rank = dist.get_rank(group)
        self._world = dist.get_world_size(group)
        if not 0 <= self._rank < self._world:  # (-1 and -1 for a group without this process)
            raise ConfigError(
                f"this process is not a member of the group {group!r}: rank {self._rank}, "
                f"world size {self._world}"
            )
        self.calls = 0  #: collectives issued (one per agreement)

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return self._world

    def all_reduce_min(self, values: list[int]) -> list[int]:
        """One ``all_reduce(MIN)`` of an int64 tensor (blocking)."""
        t = torch.tensor(values, dtype=torch.int64)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MIN, group=self._group)
        self.calls += 1
        out: list[int] = t.tolist()
        return out
