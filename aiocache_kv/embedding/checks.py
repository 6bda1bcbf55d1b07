"""Validation of the embedding cache's batches, done before any state changes.

Each public call of :class:`~aiocache_kv.embedding.EmbeddingCache` validates its whole batch
first, so a bad batch changes nothing.  Hashes are checked by
:func:`~aiocache_kv.embedding.keys.canonical_hashes`; these check the rest.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence

import torch

from aiocache_kv.embedding.entries import Entry
from aiocache_kv.embedding.errors import DuplicateHashError, EmbeddingMismatchError
from aiocache_kv.embedding.layout import EntryShape
from aiocache_kv.errors import InvalidInputError, InvalidTypeError

__all__ = ["check_duplicates", "check_existing", "check_tensors", "own_copies"]


def check_tensors(
    tensors: Sequence[torch.Tensor], n: int, dtype: torch.dtype
) -> list[torch.Tensor]:
    """``tensors`` as a list of ``n`` 2-D tensors of ``dtype`` with no empty dimension.

    Raises:
        InvalidTypeError: ``tensors`` is a single tensor, or an item is not a tensor.
        InvalidInputError: a count, rank, empty dimension or dtype is wrong.
    """
    given: object = tensors
    if isinstance(given, torch.Tensor):
        raise InvalidTypeError(
            "tensors must be a sequence of tensors (one per hash), got a single Tensor"
        )
    ts = list(tensors)
    if len(ts) != n:
        raise InvalidInputError(f"{n} hashes but {len(ts)} tensors")
    for i, t in enumerate(ts):
        if not isinstance(t, torch.Tensor):
            raise InvalidTypeError(f"tensors[{i}] must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise InvalidInputError(
                f"tensors[{i}] must be 2-D (num_tokens, dim), got shape {tuple(t.shape)}"
            )
        if t.shape[0] < 1 or t.shape[1] < 1:
            raise InvalidInputError(f"tensors[{i}] has an empty dimension: {tuple(t.shape)}")
        if t.dtype != dtype:
            raise InvalidInputError(f"tensors[{i}] has dtype {t.dtype}, the cache holds {dtype}")
    return ts


def check_duplicates(hs: list[bytes]) -> None:
    """Raises:
    DuplicateHashError: a hash appears twice in ``hs``.
    """
    if len(set(hs)) != len(hs):
        counts = collections.Counter(hs)
        dups = [h for h, c in counts.items() if c > 1]
        raise DuplicateHashError(
            f"{len(dups)} duplicate hash(es) in one insert_batch: {dups[:3]!r}"
        )


def check_existing(
    entries: Mapping[bytes, Entry], hs: list[bytes], shapes: list[EntryShape]
) -> None:
    """Raises:
    EmbeddingMismatchError: a hash of ``hs`` is in ``entries`` with another shape.
    """
    bad: list[str] = []
    for h, shape in zip(hs, shapes, strict=True):
        e = entries.get(h)
        if e is not None and e.shape is not None and e.shape != shape:
            bad.append(
                f"{h[:32]!r}: cached {e.shape.num_tokens}x{e.shape.dim} {e.shape.dtype}, "
                f"given {shape.num_tokens}x{shape.dim} {shape.dtype}"
            )
    if bad:
        raise EmbeddingMismatchError(
            f"{len(bad)} hash(es) already cached with another shape: {'; '.join(bad[:3])}"
        )


def own_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The batch's own copies of ``tensors``, each on its device (a CUDA copy is queued on
    the current stream: it reads what the caller's earlier work wrote, nothing later)."""
    return [t.detach().clone() for t in tensors]
