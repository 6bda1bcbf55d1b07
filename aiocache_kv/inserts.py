"""``HiCache.insert`` below the facade: the ``prefix=`` handle's checks, the insert, the
write-through it starts, and the result with the rows it retains.

``prefix=`` may be a :class:`MatchResult` (the request's match) or an
:class:`InsertResult` (the request's previous insert of a shorter prefix of the same
sequence, e.g. after each prefill chunk or decoded page).  Either way the caller passes only
the slots after a page boundary the handle's path holds on device, and the core refuses
tokens whose leading pages are not that path's on device.  An insert result passed as the
prefix hands its retained rows on: the new result retains them too, so the old one may be
released at once while the request keeps attending over its own rows.

The prefix's pages may leave the tree while the request computes its suffix: an operator's
``drop`` detaches them (``tree/detach.py``), a page a loading node waited for fails its
verification at load-back (``storage/deferred.py``) or its copy fails.  The insert is then
refused as the core refuses tokens that do not extend the prefix, and :func:`prefix_gone`,
run only on that refusal's path (nothing on the normal one), turns the refusal into
:class:`PrefixDroppedError`: the caller did nothing wrong, and should match again.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from aiocache_kv.config import WritePolicy
from aiocache_kv.core import CacheCore
from aiocache_kv.errors import InvalidInputError, KVCacheError, PrefixDroppedError
from aiocache_kv.handles import (
    HANDLE_TYPES,
    PINNED,
    Handle,
    InsertResult,
    MatchResult,
    WriteAck,
    check_handle,
)
from aiocache_kv.namespace import Namespace
from aiocache_kv.pins import HandleTable
from aiocache_kv.transfer.ops import OpKind, Transfers
from aiocache_kv.tree.node import ABSENT
from aiocache_kv.tree.pathwalk import path_lens
from aiocache_kv.tree.retention import check_priority
from aiocache_kv.validate import check_token_ints, slot_array

__all__ = ["insert_tokens", "prefix_gone", "rows_dropped"]

_NO_IDS = np.empty(0, dtype=np.int64)
_WRITE_THROUGH = WritePolicy.WRITE_THROUGH  # bound once: an enum attribute read is slow


def check_prefix(core: CacheCore, prefix: Handle, ns: Namespace, skip: int) -> None:
    """Raise unless an insert in ``ns`` whose slots start at token ``skip`` may lean on the
    pinned handle ``prefix``: a page boundary within what its path holds on device (a match:
    its device run; an insert result: its path up to the first node not on device), in its
    namespace.

    Raises:
        InvalidInputError: another namespace, or ``skip`` is not such a boundary.
        PrefixDroppedError: ``skip`` is beyond the device part because pages of it left the
            tree since the handle was taken (:func:`prefix_gone`).
    """
    node = prefix.node
    if node.ns is not ns and node.ns != ns:
        kind = "match" if isinstance(prefix, MatchResult) else "insert result"
        raise InvalidInputError(f"insert prefix is an {kind} in namespace {node.ns!r}, not {ns!r}")
    if isinstance(prefix, MatchResult):
        # (lens() without trailing windows, inline: every insert after a match passes here)
        dev = prefix.lens()[0] if core.trailing else path_lens(node)[0]
        what = f"the prefix match's {dev} device tokens"
    else:
        dev = 0
        for n in core.tree.path(node):
            if n.device is ABSENT:
                break
            dev += len(n.key)
        what = f"the {dev} tokens the prefix insert result holds on device"
    if skip < 0 or skip % core.page_size or skip > dev:
        gone = prefix_gone(core, prefix, skip) if skip > dev else None
        if gone is not None:
            raise gone
        raise InvalidInputError(
            f"kv_indices must hold the slots of the tokens from a page boundary at or "
            f"before {what}; they start at token {skip}"
        )


def prefix_gone(core: CacheCore, prefix: Handle, skip: int) -> PrefixDroppedError | None:
    """The error for an insert refused while its first ``skip`` tokens lean on ``prefix``,
    when a page among them left since the handle was taken; ``None`` when none did (the
    caller's tokens, slots or ``skip`` are at fault).  Run on the refusal's path only.

    A page left when its node is ``corrupt`` (it failed its verification at load-back: the
    tree drops it in the background), no longer ``alive`` (a ``drop`` detached it, or its
    subtree), or, for an insert result, off device below its ``inserted_len`` (the node the
    insert stopped at was still loading back, and that load failed).
    """
    pos = 0
    for n in core.tree.path(prefix.node):
        if pos >= skip:
            return None
        if n.corrupt:
            why, reason = "failed their verification at load-back", "corrupt"
        elif not n.alive:
            why, reason = "were dropped from the cache", "dropped"
        elif (
            n.device is ABSENT and isinstance(prefix, InsertResult) and skip <= prefix.inserted_len
        ):
            why, reason = (
                "were still loading back when inserted, and the load failed",
                "load failed",
            )
        else:
            pos += len(n.key)
            continue
        kind = "match" if isinstance(prefix, MatchResult) else "insert result"
        return PrefixDroppedError(
            f"insert: the prefix {kind} leaves its {skip} leading tokens to the tree, but "
            f"tokens {pos}..{pos + len(n.key)} of them {why} after the handle was taken "
            f"({n!r}): release the handle, match again and recompute what is gone",
            tokens=skip,
            at=pos,
            reason=reason,
        )
    return None


def rows_dropped(core: CacheCore, slots: np.ndarray) -> PrefixDroppedError | None:
    """The error for an insert refused while its ``slots`` name device rows of a node a
    ``drop`` detached (rows a match handed out, e.g. ``m.device_indices`` passed back without
    ``prefix=``); ``None`` when none do.  Run on the refusal's path only."""
    p = core.page_size
    pages = slots[::p] // p
    for node in core.tree.walk_detached():
        dp = node.device_pages
        if dp is None or not dp.size:
            continue
        hit = np.isin(pages, dp)
        if hit.any():
            at = int(np.argmax(hit)) * p
            last = (len(hit) - int(np.argmax(hit[::-1]))) * p
            return PrefixDroppedError(
                f"insert: kv_indices name the rows of tokens {at}..{last}, which were dropped "
                f"from the cache after they were matched ({node!r}): match again and "
                "recompute what is gone",
                tokens=last,
                at=at,
                reason="dropped",
            )
    return None


def insert_tokens(
    core: CacheCore,
    transfers: Transfers,
    handles: HandleTable,
    release: Callable[[Any], None],
    toks: list[int],
    kv_indices: torch.Tensor,
    prefix: MatchResult | InsertResult | None,
    ns: Namespace,
    priority: tuple[object, object] = (None, None),
) -> InsertResult:
    """:meth:`HiCache.insert` of ``toks`` in ``ns`` (see there; the walk checks their items
    before anything changes), raising the path to
    ``priority = (priority, retention)`` (checked here first; ``tree/retention.py``), and the
    tenant's quota enforced after it (``quotas.py``).

    Raises:
        InvalidTypeError / InvalidInputError: bad tokens, slots, prefix or priority, or a
            retention time with tensor parallelism (a rank's clock must not shape the tree;
            nothing changed).
        HandleError: ``prefix`` was released or belongs to another cache.
        PrefixDroppedError: pages of ``prefix`` the insert leans on left the tree since it
            was taken (dropped, or failed at load-back): nothing changed.
    """
    try:  # the tokens' own errors come first, as when they were checked before these
        unset = priority[0] is None and priority[1] is None  # nothing to check
        prio = None if unset else check_priority(*priority)
        if prio is not None and prio[1] != math.inf and core.coordinator.deferred:
            raise InvalidInputError(
                f"retention={priority[1]!r} is refused with tensor parallelism: a deadline is one "
                "rank's clock, and ranks that evicted differently would differ"
            )
        p = core.page_size
        n = len(toks) // p * p
        skip = 0
        if prefix is not None and not (
            type(prefix) in HANDLE_TYPES and prefix.core is core and prefix.state is PINNED
        ):  # (check_handle's passing case, inline: every insert with a prefix passes here)
            check_handle(prefix, Handle, core)
        if isinstance(kv_indices, torch.Tensor) and kv_indices.dim() == 1:
            skip = len(toks) - kv_indices.numel()
            if prefix is not None:
                if not (  # (check_prefix's passing case for a match, inline)
                    type(prefix) is MatchResult
                    and prefix.node.ns is ns
                    and not core.trailing
                    and 0 <= skip <= path_lens(prefix.node)[0]
                    and not skip % p
                ):
                    check_prefix(core, prefix, ns, skip)
            elif skip:
                raise InvalidInputError(
                    f"kv_indices has {kv_indices.numel()} slots for {len(toks)} tokens"
                )
        anchor = None
        inherit = _NO_IDS
        if prefix is not None:
            anchor = prefix.node
            if isinstance(prefix, InsertResult):
                held = handles.retained_by(prefix)
                inherit = _NO_IDS if held is None else held
        arr = core.dev_alloc.handed_slots(kv_indices) if core.dev_alloc is not None else None
        slots = slot_array(kv_indices, n - skip) if arr is None else arr[: n - skip]
    except KVCacheError:
        check_token_ints(toks)
        raise
    try:
        node, before, got, retained = core.insert_device(
            ns, toks, n, slots, skip // p, anchor, inherit
        )
    except InvalidInputError as exc:  # refused, nothing changed: was the prefix dropped?
        check_token_ints(toks)  # the tokens were at fault, whatever became of the prefix
        gone = None if prefix is None or not skip else prefix_gone(core, prefix, skip)
        if gone is None and core.tree.detached:  # rows a match gave, dropped since
            gone = rows_dropped(core, slots)
        if gone is not None:
            raise gone from exc
        raise
    if prio is not None:
        core.tree.deadlines.raise_path(node, *prio)
    if core.tree.tenants is not None:  # the path is pinned: the tenant's other pages go
        core.enforce_quotas()
    ack = None
    if core.config.write_policy is _WRITE_THROUGH and n and core.host_pool:
        op = transfers.backup(core.tree.path(node), OpKind.WRITE_THROUGH)
        if op is not None:
            ack = WriteAck(op.future)
    r = InsertResult(core, node, before, got, ack, release, len(toks) - got, retained)
    handles.add(r, retained)
    return r
