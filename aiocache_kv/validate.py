"""Checks of caller input, done once before any state changes (typed errors, values named)."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from aiocache_kv.errors import InvalidInputError, InvalidTypeError
from aiocache_kv.tree.hashing import MAX_TOKEN_ID


def check_tokens(tokens: Sequence[int] | torch.Tensor) -> list[int]:
    """``tokens`` as a list of ints in ``[0, 2**63)``, the range page hashes encode.

    Raises:
        InvalidTypeError: not a list/tuple/1-D integer tensor, or an element is not an int.
        InvalidInputError: empty, out of range, or a tensor off the CPU (reading it on the
            loop would wait for the device).
    """
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1 or tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
            raise InvalidInputError(
                f"tokens tensor must be 1-D integer, got {tokens.dtype} {tuple(tokens.shape)}"
            )
        if not tokens.is_cpu:
            raise InvalidInputError(f"tokens tensor must be on the CPU, got {tokens.device}")
        out: list[int] = tokens.tolist()
    elif isinstance(tokens, (list, tuple)):
        out = tokens if isinstance(tokens, list) else list(tokens)
    else:
        raise InvalidTypeError(f"tokens must be a list of ints, got {type(tokens).__name__}")
    if not out:
        raise InvalidInputError("tokens must not be empty")
    try:
        # one C pass (3x faster unsigned than signed): non-ints, negatives and ids >= 2**64
        words = array("Q", out)
    except TypeError as exc:
        bad = next((t for t in out if type(t) is not int), None)
        raise InvalidTypeError(f"tokens must be ints; found {bad!r} ({exc})") from None
    except OverflowError:
        bad = next(t for t in out if not 0 <= t <= MAX_TOKEN_ID)
        raise InvalidInputError(f"tokens must be in [0, 2**63); found {bad}") from None
    high = int(np.frombuffer(words, dtype=np.uint64).max())  # vectorised, no boxing per token
    if high > MAX_TOKEN_ID:
        raise InvalidInputError(f"tokens must be in [0, 2**63); found {high}")
    return out


def check_names(tenant: object, lora: object) -> tuple[str, str]:
    """Tenant and LoRA as namespace parts (``None`` is the empty default).

    Raises:
        InvalidTypeError: either is neither ``str`` nor ``None``.
    """
    for name, value in (("tenant", tenant), ("lora", lora)):
        if value is not None and type(value) is not str:
            raise InvalidTypeError(
                f"{name} must be a str or None, got {type(value).__name__} {value!r}"
            )
    return tenant or "", lora or ""  # type: ignore[return-value]


def slots_to_pages(slots: Any, n: int, page_size: int, device_pages: int) -> torch.Tensor:
    """Page ids of device token slots covering ``n`` aligned tokens (slots from ``alloc``).

    Raises:
        InvalidTypeError: ``slots`` is not a tensor.
        InvalidInputError: wrong dtype/shape/device, out of range, or not whole pages.
    """
    if not isinstance(slots, torch.Tensor):
        raise InvalidTypeError(f"kv_indices must be a torch.Tensor, got {type(slots).__name__}")
    if slots.dim() != 1 or slots.dtype not in (torch.int64, torch.int32):
        raise InvalidInputError(
            f"kv_indices must be 1-D int64, got {slots.dtype} {tuple(slots.shape)}"
        )
    if not slots.is_cpu:  # reading it would wait for the device on the loop
        raise InvalidInputError(f"kv_indices must be a CPU tensor, got {slots.device}")
    # numpy, not torch: a few microseconds less per op, and this runs on every insert
    arr = slots[:n].numpy().astype(np.int64, copy=False)
    limit = device_pages * page_size
    if n and (arr.min() < 0 or arr.max() >= limit):
        lo, hi = int(arr.min()), int(arr.max())
        raise InvalidInputError(f"kv_indices out of range [0, {limit}): min {lo} max {hi}")
    p = page_size
    if p == 1:
        return torch.from_numpy(arr.copy())  # the tree keeps it; the caller may reuse theirs
    grid = arr.reshape(-1, p)
    first = grid[:, 0]
    if (first % p).any() or (np.diff(grid, axis=1) != 1).any():
        raise InvalidInputError(
            f"kv_indices must cover whole pages (page_size {p}): each run of {p} slots must "
            "be page*page_size + 0..page_size-1, as returned by alloc()"
        )
    return torch.from_numpy(first // p)


def page_slots(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """Token slots of whole ``pages``: ``page * page_size + 0..page_size-1``, in order."""
    if page_size == 1:
        return pages
    arr = pages.numpy()
    slots = (arr[:, None] * page_size + np.arange(page_size, dtype=np.int64)).reshape(-1)
    return torch.from_numpy(slots)


__all__ = ["check_names", "check_tokens", "page_slots", "slots_to_pages"]
