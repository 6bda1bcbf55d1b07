"""Chunked Mooncake calls overlapped with the integrity work (the mechanics of
:class:`~aiocache_kv.storage.mooncake.MooncakeStorage`'s ``put`` and ``get_into``).

A batch is cut into runs of about :data:`PIPELINE_BYTES` (:func:`~.base.byte_chunks`).  One run
(the common case: a batch under twice that) is sealed and sent, or read and verified, on the
calling thread: no hand-off at all.  Several runs are pipelined over a helper thread: chunk k
is sent while chunk k + 1 is sealed (put), chunk k + 1 is read while chunk k is verified (get).
Whatever happens (an exception included), these functions return only once no helper call
reads or writes the caller's buffers any more.

Sizing.  Each Mooncake call costs ~60-130 us of master round trips on loopback; sealing from
memory competes with the store's memcpy for memory bandwidth (measured on 2 vCPU: a 128 MiB
put 8.3 ms alone, 13 ms with a concurrent seal of other pages, so overlap from DRAM buys
little), while a chunk sealed just before it is sent is still in the cache for the copy.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from typing import Any

from aiocache_kv.storage import integrity
from aiocache_kv.storage.base import PageBuffer, byte_chunks
from aiocache_kv.storage.deferred import verify_trailers
from aiocache_kv.storage.presum import covers

__all__ = ["PIPELINE_BYTES", "Submit", "pipelined_get", "pipelined_put", "put_chunks", "settle"]

#: bytes per call of a pipelined put/get: one chunk is sent while the next is sealed
PIPELINE_BYTES = 16 << 20

#: ``submit(fn, *args)``: ``fn(*args)`` on a helper thread, or ``None`` (closed: run inline)
Submit = Callable[..., "concurrent.futures.Future[Any] | None"]
#: ``call(idx)``: the Mooncake call for those indices, one return code per index
Call = Callable[[list[int]], list[int]]


def settle(future: concurrent.futures.Future[Any] | None) -> None:
    """Wait for a helper's call to end, whatever it returns (the buffers it uses are given
    back to the caller only then)."""
    if future is not None:
        concurrent.futures.wait([future])


def _result(idx: list[int], future: concurrent.futures.Future[Any] | None, call: Call) -> list[int]:
    if future is None:
        return call(idx)
    codes: list[int] = future.result()
    return codes


def put_chunks(
    idx: list[int], buffers: Sequence[PageBuffer], target: int = PIPELINE_BYTES
) -> list[list[int]]:
    """The calls a put of ``buffers[i]`` for ``i`` in ``idx`` goes out in: runs of about
    ``target`` bytes (each sealed while the one before is sent), or one call when every
    page's copy took its checksum (:func:`.presum.covers`: a seal that only writes trailers
    has nothing to overlap with, and each call more is more master round trips)."""
    if all(covers(buffers[i]) for i in idx):
        return [idx]
    return byte_chunks(idx, [b.nbytes for b in buffers], target)


def pipelined_put(
    chunks: list[list[int]],
    keys: Sequence[str],
    buffers: Sequence[PageBuffer],
    idents: Sequence[bytes],
    send: Call,
    submit: Submit,
    *,
    sealed: int = 0,
    todo: set[int] | None = None,
) -> dict[int, int]:
    """Seal every chunk of a checked batch (``integrity.check_batch`` passed; ``idents[i]``,
    from ``identities_for``: what page ``i`` was computed from) and send its
    members that are in ``todo`` (all: ``None``); the first ``sealed`` chunks are sealed
    already.  Returns index -> put code.  ``chunks`` come from :func:`put_chunks` (one when
    every page's copy took its checksum)."""
    codes: dict[int, int] = {}

    def seal(k: int) -> list[int]:
        chunk = chunks[k]
        if k >= sealed:
            integrity.seal_checked(
                [buffers[i] for i in chunk], [keys[i] for i in chunk], [idents[i] for i in chunk]
            )
        return chunk if todo is None else [i for i in chunk if i in todo]

    if len(chunks) == 1:  # no pipeline: no hand-off
        out = seal(0)
        if out:
            codes.update(zip(out, send(out), strict=True))
        return codes
    in_flight: tuple[list[int], concurrent.futures.Future[Any] | None] | None = None
    try:
        for k in range(len(chunks)):
            out = seal(k)  # while chunk k - 1 is in flight
            if in_flight is not None:
                idx, fut = in_flight
                in_flight = None
                codes.update(zip(idx, _result(idx, fut, send), strict=True))
            if out:
                in_flight = (out, submit(send, out))
        if in_flight is not None:
            idx, fut = in_flight
            in_flight = None
            codes.update(zip(idx, _result(idx, fut, send), strict=True))
    finally:
        settle(None if in_flight is None else in_flight[1])  # no send reads the buffers
    return codes


def pipelined_get(
    chunks: list[list[int]],
    keys: Sequence[str],
    buffers: Sequence[PageBuffer],
    idents: Sequence[bytes],
    get: Call,
    submit: Submit,
    defer: bool = False,
) -> tuple[list[int], list[int], list[integrity.Verdict]]:
    """Read every chunk (chunk k + 1 on a helper while chunk k is verified against
    ``idents``: in full, or with ``defer`` only the trailers, :func:`.deferred.verify_trailers`:
    then, where every page has a checksum row, there is nothing to overlap and the batch goes
    in one call).
    Returns the codes of every index in order, the indices read (code > 0) and their
    verdicts."""
    verify = verify_trailers if defer else integrity.verify_many
    if defer and len(chunks) > 1 and all(buffers[i].presum is not None for c in chunks for i in c):
        chunks = [[i for c in chunks for i in c]]  # nothing to overlap: one call, as raw does
    codes: list[int] = []
    read: list[int] = []
    verdicts: list[integrity.Verdict] = []
    ahead: concurrent.futures.Future[Any] | None = None
    try:
        for k, chunk in enumerate(chunks):
            got = _result(chunk, ahead, get) if k else get(chunk)
            ahead = None
            if k + 1 < len(chunks):
                ahead = submit(get, chunks[k + 1])
            codes += got
            # one chunk is every index in order (chunks partition the batch in order): when
            # every page was read, verify the caller's lists as they are
            if len(chunks) == 1 and len(chunk) == len(buffers) and all(c > 0 for c in got):
                read += chunk
                verdicts += verify(buffers, keys, got, idents)
                continue
            done = [i for i, code in zip(chunk, got, strict=True) if code > 0]
            read += done
            verdicts += verify(
                [buffers[i] for i in done],
                [keys[i] for i in done],
                [codes[i] for i in done],
                [idents[i] for i in done],
            )
    finally:
        settle(ahead)  # the buffers are the caller's again only once no read is writing
    return codes, read, verdicts
