"""Checks of caller input, done once before any state changes (typed errors, values named)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from aiocache_kv import fastcheck
from aiocache_kv.errors import InvalidInputError, InvalidTypeError


def token_list(tokens: Sequence[int] | torch.Tensor) -> list[int]:
    """``tokens`` as a non-empty list whose items are still to be checked
    (:func:`check_token_ints`): the form and the container, not the values.  An item of an
    ``int`` subclass is replaced by an exact ``int`` of its value (in a new list), so no code
    of the caller's runs while the tree walks the tokens.

    Raises:
        InvalidTypeError: not a list/tuple/1-D integer tensor.
        InvalidInputError: empty, or a tensor that is not 1-D integer or is off the CPU
            (reading it on the loop would wait for the device).
    """
    if type(tokens) is list:  # the common case first
        out: list[int] = tokens
    elif isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1 or tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
            raise InvalidInputError(
                f"tokens tensor must be 1-D integer, got {tokens.dtype} {tuple(tokens.shape)}"
            )
        if not tokens.is_cpu:
            raise InvalidInputError(f"tokens tensor must be on the CPU, got {tokens.device}")
        out = tokens.tolist()
    elif isinstance(tokens, (list, tuple)):
        out = list(tokens)
    else:
        raise InvalidTypeError(f"tokens must be a list of ints, got {type(tokens).__name__}")
    if not out:
        raise InvalidInputError("tokens must not be empty")
    # int subclasses (a bool, an IntEnum) become exact ints: no caller code runs in a walk
    return fastcheck.exact_ints(out)


def check_token_ints(tokens: list[Any], start: int = 0) -> None:
    """Raise unless every item of ``tokens[start:]`` is an int in ``[0, 2**63)``, the range
    page hashes encode (a tree walk that matched the items before ``start`` against cached
    keys with :func:`~aiocache_kv.tree.keycmp.int_common_len` has checked those).

    Raises:
        InvalidTypeError: an item is not an int (the first one is named, with its index).
        InvalidInputError: an item is out of range (the first one, with its index).
    """
    bad = fastcheck.first_bad_token(tokens, start)  # one C pass where the extension is built
    if bad >= 0:
        tok = tokens[bad]
        if not isinstance(tok, int):
            raise InvalidTypeError(
                f"tokens must be ints; found {tok!r} ({type(tok).__name__}) at {bad}"
            )
        raise InvalidInputError(f"tokens must be in [0, 2**63); found {tok} at {bad}")


def check_tokens(tokens: Sequence[int] | torch.Tensor) -> list[int]:
    """``tokens`` as a list of ints in ``[0, 2**63)``, the range page hashes encode.

    Raises:
        InvalidTypeError: not a list/tuple/1-D integer tensor, or an element is not an int.
        InvalidInputError: empty, out of range, or a tensor off the CPU (reading it on the
            loop would wait for the device).
    """
    out = token_list(tokens)
    check_token_ints(out)
    return out


def check_names(tenant: object, lora: object) -> tuple[str, str]:
    """Tenant and LoRA as namespace parts (``None`` is the empty default).

    Raises:
        InvalidTypeError: either is neither ``str`` nor ``None``.
        InvalidInputError: either is not text UTF-8 can encode (a lone surrogate): the
            names travel in KV events and storage tags.
    """
    for name, value in (("tenant", tenant), ("lora", lora)):
        if value is not None and type(value) is not str:
            raise InvalidTypeError(
                f"{name} must be a str or None, got {type(value).__name__} {value!r}"
            )
        if value and not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise InvalidInputError(
                    f"{name} must be text UTF-8 can encode, got {value!r} ({exc.reason} at "
                    f"{exc.start})"
                ) from None
    return tenant or "", lora or ""  # type: ignore[return-value]


def slots_to_pages(slots: Any, n: int, page_size: int, device_pages: int) -> torch.Tensor:
    """Page ids of device token slots covering ``n`` aligned tokens (slots from ``alloc``),
    in a new tensor.

    Raises:
        InvalidTypeError: ``slots`` is not a tensor.
        InvalidInputError: wrong dtype/shape/device, out of range, or not whole pages.
    """
    out = np.empty(n // page_size, dtype=np.int64)
    return torch.from_numpy(slot_page_ids(slots, n, page_size, device_pages, out))


def slot_page_ids(
    slots: Any, n: int, page_size: int, device_pages: int, out: np.ndarray
) -> np.ndarray:
    """:func:`slots_to_pages` into the leading ``n // page_size`` entries of ``out`` (a
    scratch array; the view of them is returned).

    Raises:
        InvalidTypeError: ``slots`` is not a tensor.
        InvalidInputError: wrong dtype/shape/device, out of range, or not whole pages.
    """
    arr = slot_array(slots, n)
    ids = out[: n // page_size]
    raise_for_slots(
        fastcheck.slot_pages(arr, page_size, device_pages * page_size, ids),
        arr,
        page_size,
        device_pages,
    )
    return ids


def slot_array(slots: Any, n: int) -> np.ndarray:
    """The leading ``n`` entries of the token slots ``slots`` as a C-contiguous int64 array
    (a view where possible).

    Raises:
        InvalidTypeError: ``slots`` is not a tensor.
        InvalidInputError: wrong dtype/shape, or a tensor off the CPU.
    """
    if not isinstance(slots, torch.Tensor):
        raise InvalidTypeError(f"kv_indices must be a torch.Tensor, got {type(slots).__name__}")
    if slots.dim() != 1 or slots.dtype not in (torch.int64, torch.int32):
        raise InvalidInputError(
            f"kv_indices must be 1-D int64, got {slots.dtype} {tuple(slots.shape)}"
        )
    if not slots.is_cpu:  # reading it would wait for the device on the loop
        raise InvalidInputError(f"kv_indices must be a CPU tensor, got {slots.device}")
    arr = slots.numpy()[:n]  # numpy slices cost a tenth of torch ones
    if arr.dtype != np.int64 or not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr, dtype=np.int64)
    return arr


def raise_for_insert(
    code: int, at: int, ids: np.ndarray, slots: np.ndarray, page_size: int, device_pages: int
) -> None:
    """Raise the typed error for a :func:`fastcheck.insert_pages` code (nothing for OK).

    Raises:
        InvalidInputError: a repeated page, a page the caller does not hold, a slot out of
            range, or runs that are not whole pages.
    """
    if code == fastcheck.INSERT_REPEAT:
        raise InvalidInputError(f"kv_indices repeat page {int(ids[at])}")
    if code == fastcheck.INSERT_NOT_HELD:
        raise InvalidInputError(
            f"kv_indices name page {int(ids[at])} (of token {at * page_size}), which the "
            "caller does not hold (not from alloc(), already inserted elsewhere, or freed)"
        )
    raise_for_slots(code, slots, page_size, device_pages)


def raise_for_slots(code: int, arr: np.ndarray, page_size: int, device_pages: int) -> None:
    """Raise the typed error for a :func:`fastcheck.slot_pages` code (nothing for OK).

    Raises:
        InvalidInputError: a slot out of range, or runs that are not whole pages.
    """
    if code == fastcheck.SLOTS_OUT_OF_RANGE:
        lo, hi = int(arr.min()), int(arr.max())
        limit = device_pages * page_size
        raise InvalidInputError(f"kv_indices out of range [0, {limit}): min {lo} max {hi}")
    if code != fastcheck.SLOTS_OK:
        p = page_size
        raise InvalidInputError(
            f"kv_indices must cover whole pages (page_size {p}): each run of {p} slots must "
            "be page*page_size + 0..page_size-1, as returned by alloc()"
        )


def page_slots(pages: torch.Tensor | np.ndarray, page_size: int) -> torch.Tensor:
    """Token slots of whole ``pages`` (int64, a tensor or an array):
    ``page * page_size + 0..page_size-1``, in order."""
    ids = pages.numpy() if isinstance(pages, torch.Tensor) else pages
    if page_size == 1:
        return pages if isinstance(pages, torch.Tensor) else torch.from_numpy(ids)
    out = np.empty(ids.size * page_size, dtype=np.int64)
    fastcheck.page_slots_into(ids, page_size, out)
    return torch.from_numpy(out)


__all__ = [
    "check_names",
    "check_token_ints",
    "check_tokens",
    "page_slots",
    "raise_for_insert",
    "raise_for_slots",
    "slot_array",
    "slot_page_ids",
    "slots_to_pages",
    "token_list",
]


def check_methods(name: str, value: object, methods: tuple[str, ...]) -> None:
    """``value`` has each of ``methods`` (a protocol's, checked where it is passed).

    Raises:
        InvalidTypeError: one is missing or not callable (named, with ``value``'s type).
    """
    missing = [m for m in methods if not callable(getattr(value, m, None))]
    if missing:
        raise InvalidTypeError(
            f"{name} must have {', '.join(methods)}; a {type(value).__name__} lacks "
            + ", ".join(missing)
        )
