"""One prefetch's record (:class:`PrefetchJob`) and the small run computations the prefetch
path makes over its pages: leading runs of flags, consecutive spans of a read's batch."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from aiocache_kv.storage.worker_pages import WorkerPages
from aiocache_kv.tree.node import Node

if TYPE_CHECKING:
    from aiocache_kv.namespace import Namespace

__all__ = ["PrefetchJob", "last_true", "leading_run", "report_batch", "span_of"]


@dataclass(eq=False)
class PrefetchJob:
    """One prefetch: its reservation, what storage had, what arrived, what was committed."""

    rid: int
    ns: Namespace
    tokens: list[int]
    cached: int  #: tokens already in the tree (the anchor's path)
    anchor: Node
    pages: torch.Tensor  #: reserved host pages (their slots in every pool)
    keys: list[list[str]]  #: per pool, one key per page after ``cached``
    hashes: list[bytes]
    deadline: float
    #: per trailing component: pages before ``cached`` that count for its window, and how
    #: many of those the tree holds (consecutive, ending at ``cached``)
    before: list[tuple[int, int]] = field(default_factory=list)
    #: pages it may reserve in all (one rank: it starts with the free ones and evicts for
    #: more only once storage said it has them)
    want: int = 0
    hits: int = 0  #: leading pages present for the KV and every ALL_PAGES component
    loaded: list[list[bool]] = field(default_factory=list)  #: per pool, page arrived intact
    committed: int = 0  #: pages attached to the tree
    error: str | None = None
    failed: bool = False
    #: pages storage listed but could not deliver intact (gone or corrupt: the backend drops
    #: a corrupt page), reported as STORAGE ``BlockRemoved``
    vanished: list[int] = field(default_factory=list)
    #: hashes of pages storage does not have that an earlier ``BlockStored(STORAGE)`` of a node
    #: no longer in the tree claimed (evicted silently, e.g. by a Mooncake master)
    unclaimed: list[bytes] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    #: a drop of its namespace or of a page it reads ran meanwhile: commit nothing
    dropped: bool = False
    #: the reserved pages each read worker writes (leased once the wait for it ends)
    holds: list[WorkerPages] = field(default_factory=list)


def span_of(part: list[tuple[int, int]]) -> tuple[int, int, int] | None:
    """``(pool, first, end)`` when ``part`` is the consecutive pages ``first..end-1`` of one
    pool (plans list pools in order, pages ascending), else ``None``."""
    pool, a = part[0]
    last_pool, z = part[-1]
    return (pool, a, z + 1) if last_pool == pool and z + 1 - a == len(part) else None


def leading_run(flags: Sequence[bool]) -> int:
    """Length of the leading run of true flags (bools), in one C-level scan."""
    try:
        return (flags if isinstance(flags, list) else list(flags)).index(False)
    except ValueError:
        return len(flags)


def last_true(flags: list[bool]) -> int:
    """The index of the last true flag (-1: none), without a step per flag."""
    return len(flags) - 1 - flags[::-1].index(True) if True in flags else -1


#: one read batch: a range of KV pages, or ``(pool, page)`` pairs
Part = range | list[tuple[int, int]]


def report_batch(
    landed: Callable[[Part, list[bool] | BaseException], None],
    parts: list[Part],
    i: int,
    res: list[bool] | BaseException,
) -> None:
    """``on_batch`` of a worker's batches: batch ``i`` is ``parts[i]``."""
    landed(parts[i], res)
