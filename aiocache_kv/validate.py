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
        words = array("q", out)  # one C pass: non-ints and ids >= 2**63 raise
    except TypeError as exc:
        bad = next((t for t in out if type(t) is not int), None)
        raise InvalidTypeError(f"tokens must be ints; found {bad!r} ({exc})") from None
    except OverflowError:
        bad = next(t for t in out if not 0 <= t <= MAX_TOKEN_ID)
        raise InvalidInputError(f"tokens must be in [0, 2**63); found {bad}") from None
    low = int(np.frombuffer(words, dtype=np.int64).min())  # vectorised: no per-token boxing
    if low < 0:
        raise InvalidInputError(f"tokens must be in [0, 2**63); found {low}")
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
    slots = slots[:n]
    if slots.dtype != torch.int64:
        slots = slots.to(torch.int64)
    limit = device_pages * page_size
    arr = slots.numpy()
    if n and (arr.min() < 0 or arr.max() >= limit):
        lo, hi = int(arr.min()), int(arr.max())
        raise InvalidInputError(f"kv_indices out of range [0, {limit}): min {lo} max {hi}")
    p = page_size
    if p == 1:
        out: torch.Tensor = slots.clone()  # the tree keeps it; the caller may reuse theirs
        return out
    grid = slots.view(-1, p)
    first = grid[:, 0]
    if bool((first % p != 0).any()) or not torch.equal(grid, first[:, None] + torch.arange(p)):
        raise InvalidInputError(
            f"kv_indices must cover whole pages (page_size {p}): each run of {p} slots must "
            "be page*page_size + 0..page_size-1, as returned by alloc()"
        )
    pages: torch.Tensor = first // p
    return pages


__all__ = ["check_names", "check_tokens", "slots_to_pages"]
