"""The storage-tier (L3) contract: :class:`StorageBackend`, :class:`PageBuffer`, statistics.

Backends are *blocking* and *batched*.  They never run on the event loop: the cache calls them
through :class:`aiocache_kv.storage.executor.StorageIO`, which runs each call on a bounded worker
pool.  A backend may therefore be called from several worker threads at once and must be
thread-safe.

Slot layout
-----------
The host pool hands the backend one :class:`PageBuffer` per key.  A buffer is a *slot*:
``[payload | trailer]`` where the trailer is :data:`~aiocache_kv.storage.integrity.FRAME_OVERHEAD`
bytes.  ``put`` writes the trailer into the slot's last bytes and then stores the whole slot in
one zero-copy call; ``get_into`` reads the whole slot and verifies the trailer.  The payload size
is always ``buffer.nbytes - FRAME_OVERHEAD``: a stored page whose length differs from the slot's
is a miss (counted as corrupt), never a partial read.

A buffer may carry a *presum* (:attr:`PageBuffer.presum`): the host pool's row for its page,
where the copy that wrote the page recorded the page's checksum in the same pass
(:mod:`aiocache_kv.storage.presum`).  ``put``'s seal then writes only the trailer.

Results are per key and never truncated: a failure in the middle of a batch is reported for that
key only and every other key still gets its own result.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from aiocache_kv.errors import InvalidInputError, InvalidTypeError

__all__ = [
    "ChainAwareStorage",
    "PageBuffer",
    "StatsCounter",
    "StorageBackend",
    "StorageStats",
    "TagRemovableStorage",
    "byte_chunks",
    "leading_run",
]


@dataclasses.dataclass(frozen=True, eq=False)
class PageBuffer:
    """One contiguous host byte range (a page slot), seen both as a pointer and a memoryview.

    ``ptr``/``nbytes`` serve zero-copy backends (Mooncake); ``view`` (a writable 1-D ``uint8``
    memoryview over the same bytes) serves file I/O; ``tensor`` keeps the memory alive and
    serves the checksum.  ``presum`` (optional): the 3 ``uint64`` ``(S1, S2, bytes)`` a copy
    recorded for this slot's payload (``bytes`` 0: none; see :mod:`.presum`).  Build it with
    :meth:`from_tensor`.
    """

    tensor: torch.Tensor
    ptr: int
    nbytes: int
    view: memoryview
    presum: np.ndarray[Any, Any] | None = None

    @classmethod
    def from_tensor(
        cls, tensor: torch.Tensor, presum: np.ndarray[Any, Any] | None = None
    ) -> PageBuffer:
        """Wrap a contiguous CPU ``torch.uint8`` tensor (e.g. a slice of the host pool), with
        the pool's checksum row for it (``presum``: 3 ``uint64``), if any.

        Raises:
            InvalidTypeError: ``tensor`` is not a ``torch.Tensor``.
            InvalidInputError: wrong dtype, device, not contiguous, not 1-D, or empty; a
                ``presum`` that is not a contiguous ``uint64`` array of 3.
        """
        if presum is not None and (
            not isinstance(presum, np.ndarray)
            or presum.dtype != np.uint64
            or presum.shape != (3,)
            or not presum.flags.c_contiguous
        ):
            raise InvalidInputError(
                f"presum must be a contiguous uint64 array of 3, got {presum!r:.80}"
            )
        if not isinstance(tensor, torch.Tensor):
            raise InvalidTypeError(f"PageBuffer needs a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype != torch.uint8:
            raise InvalidInputError(f"PageBuffer needs dtype torch.uint8, got {tensor.dtype}")
        if tensor.device.type != "cpu":
            raise InvalidInputError(f"PageBuffer needs a host (cpu) tensor, got {tensor.device}")
        if tensor.dim() != 1 or not tensor.is_contiguous():
            raise InvalidInputError(
                f"PageBuffer needs a contiguous 1-D tensor, got shape {tuple(tensor.shape)} "
                f"contiguous={tensor.is_contiguous()}"
            )
        if tensor.numel() == 0:
            raise InvalidInputError("PageBuffer needs a non-empty tensor")
        view = tensor.numpy().data.cast("B")
        return cls(
            tensor=tensor,
            ptr=int(tensor.data_ptr()),
            nbytes=int(tensor.numel()),
            view=view,
            presum=presum,
        )

    @classmethod
    def allocate(cls, nbytes: int) -> PageBuffer:
        """A fresh zeroed buffer of ``nbytes`` (tests, one-off reads).

        Raises:
            InvalidInputError: ``nbytes`` is not positive.
        """
        if nbytes <= 0:
            raise InvalidInputError(f"PageBuffer.allocate needs nbytes > 0, got {nbytes}")
        return cls.from_tensor(torch.zeros(nbytes, dtype=torch.uint8))

    def __repr__(self) -> str:
        return f"PageBuffer(ptr=0x{self.ptr:x}, nbytes={self.nbytes})"


@dataclasses.dataclass(frozen=True)
class StorageStats:
    """Frozen snapshot of a backend's counters (per key unless the name says bytes/calls)."""

    puts: int = 0  # keys offered to put
    put_ok: int = 0  # keys stored by this call
    put_skipped: int = 0  # keys already present, not re-sent (count as success)
    put_failed: int = 0  # keys that failed (after the retry, if any)
    put_retries: int = 0  # keys retried once after "no space"
    gets: int = 0  # keys asked for by get_into
    hits: int = 0  # keys read and verified
    misses: int = 0  # keys absent (not counting corrupt)
    corrupt: int = 0  # keys present but failing the integrity check (reported as misses)
    get_failed: int = 0  # keys whose read failed for another reason (unavailable, I/O error)
    bytes_written: int = 0  # slot bytes actually sent to the store
    bytes_read: int = 0  # slot bytes read and verified
    removed: int = 0  # keys removed (explicit remove or eviction)
    evictions: int = 0  # keys evicted by the backend's own capacity policy
    unavailable: int = 0  # keys that failed because the store was unreachable / timed out
    unregistered_buffers: int = 0  # buffers used outside registered memory (zero-copy backends)


class StatsCounter:
    """Thread-safe mutable counterpart of :class:`StorageStats` (backends own one)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, int] = {f.name: 0 for f in dataclasses.fields(StorageStats)}

    def add(self, **deltas: int) -> None:
        """Add ``deltas`` to the named counters (unknown names raise ``KeyError``)."""
        with self._lock:
            for name, delta in deltas.items():
                if name not in self._values:
                    raise KeyError(f"unknown storage counter {name!r}")
                self._values[name] += delta

    def snapshot(self) -> StorageStats:
        """A frozen copy of the counters."""
        with self._lock:
            return StorageStats(**self._values)


def byte_chunks(idx: list[int], nbytes: Sequence[int], target: int) -> list[list[int]]:
    """``idx`` cut, in order, into runs of about ``target`` bytes (``nbytes[i]`` each; at
    least one page a run).  Under ``2 * target`` in all it stays whole: a call more costs
    more than overlapping two halves wins."""
    if sum(nbytes[i] for i in idx) < 2 * target:
        return [idx]
    out: list[list[int]] = [[]]
    acc = 0
    for i in idx:
        if acc >= target:
            out.append([])
            acc = 0
        out[-1].append(i)
        acc += nbytes[i]
    return out


def leading_run(flags: Sequence[bool]) -> int:
    """Length of the leading run of ``True`` in ``flags``."""
    n = 0
    for flag in flags:
        if not flag:
            break
        n += 1
    return n


@runtime_checkable
class StorageBackend(Protocol):
    """A blocking, batched, thread-safe L3 store.  Run it via ``StorageIO``, never on the loop.

    Every batched method returns exactly one result per key, in order.
    """

    def open(self) -> None:
        """Connect / prepare (idempotent).  Other methods open lazily if needed.

        Raises:
            StorageUnavailableError: the store cannot be reached or the directory is unusable.
            ConfigError: the backend's options are inconsistent.
        """
        ...

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Per key: is it present?  Does not count as an access for eviction.

        Raises:
            StorageKeyError: a key is not a non-empty ``str``.
            StorageUnavailableError: the store could not answer for any key.
        """
        ...

    def leading_hits(self, keys: Sequence[str]) -> int:
        """Number of leading keys present (the usable prefix of a chained-hash run)."""
        ...

    def put(
        self,
        keys: Sequence[str],
        buffers: Sequence[PageBuffer],
        identities: Sequence[bytes] | None = None,
    ) -> list[bool]:
        """Store each slot under its key; write the integrity trailer into the slot first,
        binding ``identities[i]`` (32 bytes: what the page was computed from; the cache passes
        the page's chained hash) or, where ``None``, the digest of the key
        (:func:`~aiocache_kv.storage.integrity.key_identity`).

        A key already present is not re-sent and reports ``True``.

        Raises:
            StorageKeyError: a key is malformed.
            InvalidInputError: lengths differ, a buffer is smaller than the frame overhead, or
                an identity is not 32 bytes.
            StorageUnavailableError: the store was unreachable for every key of the batch.
        """
        ...

    def get_into(
        self,
        keys: Sequence[str],
        buffers: Sequence[PageBuffer],
        identities: Sequence[bytes] | None = None,
    ) -> list[bool]:
        """Read each key into its slot; ``True`` only for a present page that passes integrity
        and whose trailer binds ``identities[i]`` (as :meth:`put`; a page bound to another
        identity is a miss, counted as corrupt, never data).

        On ``False`` the slot's content is unspecified.

        Raises:
            StorageKeyError, InvalidInputError: as for :meth:`put`.
            StorageUnavailableError: the store was unreachable for every key of the batch.
        """
        ...

    def remove(self, keys: Sequence[str]) -> list[bool]:
        """Remove keys; per key ``True`` if it was present and is gone."""
        ...

    def register_buffer(self, tensor: torch.Tensor) -> None:
        """Register host memory once for zero-copy transfers (no-op where not needed)."""
        ...

    def statistics(self) -> StorageStats:
        """Frozen snapshot of the counters."""
        ...

    def close(self) -> None:
        """Release the connection / resources (idempotent)."""
        ...


@runtime_checkable
class ChainAwareStorage(Protocol):
    """A backend that bounds its capacity itself (``FileStorage``): told which page each page
    depends on, it evicts chain ends first, and it reports what it evicted so that the cache
    can say so (``BlockRemoved(STORAGE)``) and back the pages up again on a later hit.

    Backends without it (Mooncake: its master evicts on its own) are learned about on reads.
    """

    def put_chain(
        self,
        keys: Sequence[str],
        buffers: Sequence[PageBuffer],
        parents: Sequence[str | None],
        identities: Sequence[bytes] | None = None,
    ) -> list[bool]:
        """:meth:`StorageBackend.put`, with ``parents[i]`` the key page ``i`` depends on
        (``None``: a chain start).  A page evicted again before the call returns reports
        ``False``.

        Raises:
            As :meth:`StorageBackend.put`; ``InvalidInputError`` when ``parents`` does not
            match ``keys`` in length.
        """
        ...

    def take_evicted(self) -> list[str]:
        """The keys evicted since the last call (each reported once), oldest first."""
        ...


@runtime_checkable
class TagRemovableStorage(Protocol):
    """A backend that can remove every page of one namespace tag, including pages this
    process never wrote (another node's, a previous run's): ``HiCache.drop`` of a tenant.

    ``FileStorage`` scans its index, ``MooncakeStorage`` asks the master (``remove_by_regex``),
    ``MemoryStorage`` filters its dict.  Backends without it get the keys the cache knows.
    """

    def remove_tag(self, tag: str) -> int:
        """Remove every key ``"{tag}/..."``; return how many were removed.

        Raises:
            StorageKeyError: ``tag`` is not a valid namespace tag.
            StorageUnavailableError: the store cannot be reached.
        """
        ...
