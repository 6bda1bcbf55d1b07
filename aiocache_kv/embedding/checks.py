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
from aiocache_kv.embedding.keys import batch_items
from aiocache_kv.embedding.layout import EntryShape
from aiocache_kv.errors import InvalidInputError, InvalidTypeError

__all__ = ["check_duplicates", "check_existing", "check_tensors", "own_copies"]


def check_tensors(
    tensors: Sequence[torch.Tensor], n: int, dtype: torch.dtype
) -> list[torch.Tensor]:
    """``tensors`` as a list of ``n`` dense 2-D tensors of ``dtype`` with no empty dimension,
    each one that can be copied into the host pool.

    Raises:
        InvalidTypeError: ``tensors`` is a single tensor, not a sequence (``None``, an int,
            ...) or a ``str``/``bytes``; or an item is not a tensor.
        InvalidInputError: a count, rank, empty dimension or dtype is wrong; or a tensor has
            no data to copy: a ``meta`` tensor, a sparse / mkldnn (non-strided) layout, a
            nested tensor or a tensor subclass with its own dispatch (e.g. a fake tensor).
    """
    given: object = tensors
    if isinstance(given, torch.Tensor):
        raise InvalidTypeError(
            "tensors must be a sequence of tensors (one per hash), got a single Tensor"
        )
    items = batch_items("tensors", given, "torch.Tensor (one per hash)")
    if len(items) != n:
        raise InvalidInputError(f"{n} hashes but {len(items)} tensors")
    ts: list[torch.Tensor] = []
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise InvalidTypeError(f"tensors[{i}] must be a torch.Tensor, got {type(t).__name__}")
        _check_copyable(i, t)
        if t.dim() != 2:
            raise InvalidInputError(
                f"tensors[{i}] must be 2-D (num_tokens, dim), got shape {tuple(t.shape)}"
            )
        if t.shape[0] < 1 or t.shape[1] < 1:
            raise InvalidInputError(f"tensors[{i}] has an empty dimension: {tuple(t.shape)}")
        if t.dtype != dtype:
            raise InvalidInputError(f"tensors[{i}] has dtype {t.dtype}, the cache holds {dtype}")
        ts.append(t)
    return ts


_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__


def _check_copyable(i: int, t: torch.Tensor) -> None:
    """Raises:
    InvalidInputError: ``t`` holds no dense data the pool copy can read (checked before its
        shape: a nested tensor has none).
    """
    if type(t).__torch_dispatch__ is not _PLAIN_DISPATCH:
        kind = "nested tensor" if t.is_nested else f"tensor subclass {type(t).__name__}"
        raise InvalidInputError(f"tensors[{i}] is a {kind}; pass a plain dense tensor with data")
    if t.is_nested:
        raise InvalidInputError(f"tensors[{i}] is a nested tensor; pass a plain dense tensor")
    if t.layout is not torch.strided:
        raise InvalidInputError(
            f"tensors[{i}] has layout {t.layout}; pass a dense (torch.strided) tensor, "
            "e.g. t.to_dense()"
        )
    if t.is_meta:
        raise InvalidInputError(
            f"tensors[{i}] is on the meta device (no data); pass a tensor with data"
        )


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
