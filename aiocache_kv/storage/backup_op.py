"""``BackupOp``: one backup of the storage tier (:mod:`aiocache_kv.storage.tier`), from the
write ack that started it until its verdicts land on the tree; and the put of a group of
them (:func:`put_lists`, :func:`put_parts`)."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from aiocache_kv.storage.base import PageBuffer

if TYPE_CHECKING:
    from aiocache_kv.storage.executor import StorageIO
    from aiocache_kv.tree.node import Node

__all__ = ["BackupOp", "put_lists", "put_parts"]


class BackupOp:
    """A batch of nodes whose pages are being put to storage, in page order."""

    __slots__ = (
        "bufs",
        "deadline",
        "dropped",
        "entry_pages",
        "error",
        "future",
        "idents",
        "keys",
        "lost",
        "nbytes",
        "pages",
        "parents",
        "results",
        "started",
        "targets",
    )

    def __init__(self, targets: list[Node], future: asyncio.Future[None]) -> None:
        self.targets = targets
        self.future = future  # set when the verdicts are applied to the tree
        #: per stored key (KV and sidecars), the index of its page in the op's page order
        self.entry_pages: list[int] = []
        self.results: list[bool] = []
        #: indices in ``keys`` of pages evicted before the op landed (by any put): not stored
        self.lost: set[int] = set()
        self.error: str | None = None
        self.started = time.monotonic()
        #: what the put sends (set by ``backup``): keys, parents, identities, slots, their bytes
        self.keys: list[str] = []
        self.parents: list[str | None] = []
        self.idents: list[bytes] = []
        self.bufs: list[PageBuffer] = []
        self.nbytes = 0  #: the pages' bytes, trailers aside (what batches puts)
        #: the host pages its put reads, per node: storage-FILLING nodes' (nothing evicts or
        #: frees them while it runs), leased only if the loop stops waiting for its workers
        self.pages: list[torch.Tensor] = []
        self.deadline = 0.0  #: loop time by which its put must have answered
        #: targets dropped (``HiCache.drop``) while it ran: what it put of them is removed
        #: again once its workers are done
        self.dropped: list[Node] = []


def put_lists(
    group: list[BackupOp],
) -> tuple[list[str], list[str | None], list[bytes], list[PageBuffer]]:
    """The keys, parents, identities and buffers of ``group``'s put, in order."""
    if len(group) == 1:  # (the lists are only read from here on)
        op = group[0]
        return op.keys, op.parents, op.idents, op.bufs
    chain = itertools.chain.from_iterable  # (C loops, not one Python step a page)
    return (
        list(chain(op.keys for op in group)),
        list(chain(op.parents for op in group)),
        list(chain(op.idents for op in group)),
        list(chain(op.bufs for op in group)),
    )


async def put_parts(
    io: StorageIO,
    keys: list[str],
    bufs: list[PageBuffer],
    parents: list[str | None],
    idents: list[bytes],
    timeout: float,
    release: Callable[[], None],
    parts: int,
) -> list[bool]:
    """``io.put`` of a backup's pages in ``parts`` consecutive slices at once; ``release`` runs
    once every slice's worker is done.  A slice that fails fails the whole put (raised
    once every slice has returned), as one put would.

    Raises:
        KVCacheError: what a slice's put raised (the first one).
    """
    if parts <= 1:
        return await io.put(
            keys, bufs, timeout=timeout, on_release=release, parents=parents, identities=idents
        )
    n = len(keys)
    cuts = [n * i // parts for i in range(parts + 1)]
    left = [parts]

    def one_released() -> None:
        left[0] -= 1
        if not left[0]:
            release()

    outs = await asyncio.gather(
        *(
            io.put(
                keys[a:b],
                bufs[a:b],
                timeout=timeout,
                on_release=one_released,
                parents=parents[a:b],
                identities=idents[a:b],
            )
            for a, b in itertools.pairwise(cuts)
        ),
        return_exceptions=True,
    )
    results: list[bool] = []
    for out in outs:
        if isinstance(out, BaseException):
            raise out
        results += out
    return results
