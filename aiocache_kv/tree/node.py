"""Tree nodes and their per-tier state.

A node owns a run of whole pages of one namespace.  Its presence in each tier is an explicit
:class:`TierState`; the legal combinations are listed in :func:`check_node` and changed only
by :class:`~aiocache_kv.tree.radix.RadixTree` methods.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import torch

from aiocache_kv.gcfree import keep


class TierState(enum.IntEnum):
    """Presence of a node's pages in one tier."""

    ABSENT = 0  #: no pages in this tier
    FILLING = 1  #: pages reserved, a copy into this tier is in flight
    RESIDENT = 2  #: pages hold valid data


class Tier(enum.IntEnum):
    """Tiers of the hierarchy (the KV-event ``medium`` names them)."""

    DEVICE = 1
    HOST = 2
    STORAGE = 3

    @property
    def medium(self) -> str:
        """The vLLM event medium of this tier."""
        return _MEDIUM[self]


_MEDIUM = {Tier.DEVICE: "GPU", Tier.HOST: "CPU", Tier.STORAGE: "STORAGE"}

ABSENT = TierState.ABSENT
FILLING = TierState.FILLING
RESIDENT = TierState.RESIDENT


_VALID: frozenset[str] = frozenset()
_NEVER = float("inf")


def lacking(node: Node) -> frozenset[str]:
    """The trailing-window components whose pages the copy a match serves from lacks:
    ``node.invalid``, unless the device copy is complete (then none)."""
    return _VALID if node.device_complete else node.invalid


def continues(node: Node, prefix: list[int], page_size: int) -> bool:
    """Whether ``node`` holds the last page of ``prefix`` (page-aligned tokens) or a page
    after it on that path: its tokens from the root, found through its parents (which a node
    keeps after it left the tree, so a late put's evicted target can be asked too), start
    with ``prefix`` as far as both go, and it ends past ``prefix``'s last page's start."""
    chain: list[Node] = []
    cur: Node | None = node
    while cur is not None and cur.parent is not None:
        chain.append(cur)
        cur = cur.parent
    n = len(prefix)
    pos = 0
    for part in reversed(chain):
        k = len(part.key)
        upto = min(k, n - pos)
        if upto > 0 and part.key[:upto] != prefix[pos : pos + upto]:
            return False
        pos += k
    return pos > n - page_size


class Node:
    """A radix-tree node: ``key`` tokens (whole pages) and the pages that hold their KV."""

    # __weakref__: the storage tier indexes stored pages by hash, weakly
    __slots__ = (
        "__weakref__",
        "alive",
        "backup",
        "children",
        "corrupt",
        "cpu_hidden",
        "device",
        "device_complete",
        "device_pages",
        "hashes",
        "hit_count",
        "host",
        "host_pages",
        "host_pins",
        "invalid",
        "key",
        "last_access",
        "n_dev_children",
        "ns",
        "op",
        "parent",
        "pins",
        "priority",
        "retain_until",
        "start",
        "storage",
    )

    def __init__(self, key: list[int], parent: Node | None, ns: Any) -> None:
        self.key = keep(key)  # never mutated: a split gives both halves new lists
        self.parent = parent
        #: tokens on the path before this node (a split moves the tail's start on)
        self.start: int = 0 if parent is None else parent.start + len(parent.key)
        self.ns = ns
        self.children: dict[Any, Node] = {}
        self.device = ABSENT
        self.host = ABSENT
        #: device page ids (int64 array: numpy, not torch, on the per-request path)
        self.device_pages: np.ndarray | None = None
        self.host_pages: torch.Tensor | None = None
        self.pins = 0
        #: hard host pins (``hardpins.py``) on this node's path: its host copy stays (not a
        #: host victim, host pages protected) while its device copy may still be demoted
        self.host_pins = 0
        self.last_access = 0
        self.hit_count = 0
        self.n_dev_children = 0
        self.hashes: list[bytes] | None = None
        self.op: Any = None  # the in-flight device<->host transfer touching this node
        self.storage = ABSENT  # presence in L3 as far as this cache wrote or read it
        self.backup: Any = None  # the in-flight host->storage backup reading this node
        #: trailing-window components whose pages this node lacks (it came from storage
        #: without them); a prefix may not end where such a page is inside the window
        self.invalid: frozenset[str] = _VALID  # shared: a new empty set per node costs
        #: the device copy holds every component's pages although ``invalid`` says the host
        #: (and storage) copy lacks some: an insert gave the node pages the model computed
        #: whole.  Reset whenever the device copy goes; see :func:`lacking`
        self.device_complete = False
        #: host-resident but not announced on CPU (its parent was not on CPU when it landed):
        #: announced once the parent is, never reported removed otherwise
        self.cpu_hidden = False
        self.alive = True
        #: a page of its host copy failed verification at load-back (``storage/deferred.py``):
        #: no match extends through it (``MatchResult``); it is being dropped
        self.corrupt = False
        #: retention priority (``tree/retention.py``): evicted after lower ones; falls back
        #: to the default at ``retain_until`` (monotonic seconds; ``inf``: never)
        self.priority = 0
        self.retain_until = _NEVER

    @property
    def is_root(self) -> bool:
        """Whether this is a namespace root (holds no pages)."""
        return self.parent is None

    def __repr__(self) -> str:
        return (
            f"<Node tokens={len(self.key)} device={self.device.name} host={self.host.name} "
            f"storage={self.storage.name} "
            f"pins={self.pins} host_pins={self.host_pins} children={len(self.children)}>"
        )


def check_node(node: Node, page_size: int) -> None:
    """The legal combinations of one non-root node's tier states, pages and in-flight
    operations (``RadixTree.check_invariants`` checks the rest: links, the parent's state,
    counts).

    Raises:
        AssertionError: naming the broken invariant and the node.
    """
    n = len(node.key) // page_size
    assert node.key and len(node.key) % page_size == 0, f"unaligned key on {node!r}"
    parent = node.parent
    assert parent is not None, f"check_node of a root {node!r}"
    before = parent.start + len(parent.key)  # the tokens on its path before it
    assert node.start == before, f"{node!r} starts at token {node.start}, not {before}"
    assert node.device is not ABSENT or node.host is not ABSENT, f"empty {node!r}"
    if node.device is not ABSENT:
        assert node.device_pages is not None and node.device_pages.size == n, (
            f"device pages mismatch {node!r}"
        )
    else:
        assert node.device_pages is None, f"stale device pages {node!r}"
    if node.host is not ABSENT:
        assert node.host_pages is not None and node.host_pages.numel() == n, (
            f"host pages mismatch {node!r}"
        )
    else:
        assert node.host_pages is None, f"stale host pages {node!r}"
    if node.device_complete:
        assert node.device is RESIDENT, f"complete device copy of no device {node!r}"
    if node.host is FILLING:
        assert node.device is RESIDENT, f"host filling without device copy {node!r}"
    if node.device is FILLING:
        assert node.host is RESIDENT, f"device filling without host copy {node!r}"
    filling = node.host is FILLING or node.device is FILLING
    assert (node.op is not None) == filling, f"op/state mismatch {node!r}"
    backing_up = node.storage is FILLING
    assert (node.backup is not None) == backing_up, f"backup/state mismatch {node!r}"
    if backing_up:
        assert node.host is RESIDENT, f"backup without a host copy {node!r}"
