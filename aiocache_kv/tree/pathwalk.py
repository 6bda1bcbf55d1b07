"""The walks along a node's path that every request makes: down from a root (match,
insert plan), and up: pin (and stamp), unpin, run lengths.

A match pins its path and stamps it as used, a release unpins it, and each handle reads the
lengths of its device run and of the host-only run after it.  Two implementations return
the same values: a C extension (``_pathwalk``, built by ``pip install -e .`` where a C
compiler is at hand), which reads and writes a node's slots at the offsets its class gives,
and the functions below (the reference, used where the extension is missing).
:data:`PATHWALK_IMPL` says which one runs.

:func:`descend` only reads: it returns where the walk ends, and the caller checks the tokens
it did not compare and changes the tree.  The C walk compares only exact ints (nothing it
does can run Python code) and returns ``None`` at anything else; the caller then takes
:func:`py_descend`, which checks the tokens as it goes.

:func:`pin_match` is the common match whole: the walk down, ending on a node boundary, the
check of the tokens after it, the pin and stamp of the path.  :func:`grow` is the common
insert whole: the walk down over nodes held on device, one new
leaf, its path pinned.  It changes nothing, and returns ``None``, wherever the insert is not
that simple (a split, a host-only node, one still loading, pages the caller passed for tokens
the tree has, an item that is not a plain int); the tree's general insert then runs.

Each walk up stops below the namespace root (the caller handles a root itself).  The pin
counts move pages between the tiers' evictable and protected counts by
:func:`protect_delta`'s rule; the walks return those counts and leave applying them, and
offering nodes to the victim heaps, to the tree (``tiers.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiocache_kv.extensions import optional_extension
from aiocache_kv.tree.keycmp import int_common_len, page_key
from aiocache_kv.tree.node import ABSENT, FILLING, RESIDENT, Node
from aiocache_kv.validate import check_token_ints

__all__ = [
    "PATHWALK_IMPL",
    "Descent",
    "descend",
    "grow",
    "may_be_victim",
    "path_lens",
    "pin_match",
    "pin_path",
    "protect_delta",
    "py_descend",
    "py_grow",
    "py_path_lens",
    "py_pin_match",
    "py_pin_path",
    "py_unpin_path",
    "unpin_path",
]


#: ``(node, pos, child, same, steps)``: see :func:`py_descend`
Descent = tuple[Node, int, "Node | None", int, "list[Node] | None"]


def _walk_key(tokens: list[Any], pos: int, p: int, unchecked: bool) -> tuple[Any, bool]:
    """The child key of the page at ``pos`` (page size ``p``: the token itself at 1, else a
    tuple) and whether ``tokens`` are still unchecked.  Looking up anything but exact ints
    could run code, so a page with another item has ``tokens`` checked whole first (raising
    at a bad one: nothing has changed yet).

    Raises:
        InvalidTypeError / InvalidInputError: as :func:`check_token_ints`.
    """
    if p == 1:
        key: Any = tokens[pos]
        if unchecked and type(key) is not int:
            check_token_ints(tokens)
            unchecked = False
        return key, unchecked
    key = page_key(tokens, pos, p)
    if key is None:
        if unchecked:
            check_token_ints(tokens)
            unchecked = False
        key = tuple(tokens[pos : pos + p])
    return key, unchecked


def py_descend(node: Node, page_size: int, tokens: list[Any], n: int, plan: bool) -> Descent:
    """The walk down from ``node`` along ``tokens[:n]`` (page-aligned) that a match or an
    insert takes, changing nothing.  Returns ``(node, pos, child, same, steps)``: the last
    node whose whole key matched (``node`` itself if none) and ``pos``, the tokens down to
    it; ``child``, the node below it whose key matched only its first ``same`` tokens (a
    split point when ``same`` reaches a page boundary), else ``None`` and 0; with ``plan``
    (an insert's walk), ``steps``, the nodes whose whole key matched, in order, and the walk
    also ends at a child of a node still loading that is not that load's (nothing may hang
    below a node still loading), else ``None``.  Every token before ``pos + same`` is an int
    equal to a cached key's (checked); those after it are the caller's to check.

    Raises:
        InvalidTypeError / InvalidInputError: a page the walk reaches holds an item that is
            not an exact int, and ``tokens`` hold a bad item (nothing changed).
    """
    pos = 0
    unchecked = True
    steps: list[Node] | None = [] if plan else None
    while pos < n:
        key, unchecked = _walk_key(tokens, pos, page_size, unchecked)
        child = node.children.get(key)
        if child is None:
            break
        if plan and node.device is FILLING and child.device is not FILLING:
            break
        same = int_common_len(child.key, tokens, pos, n - pos)  # in place, no slice
        if same < len(child.key):
            return node, pos, child, same, steps
        if steps is not None:
            steps.append(child)
        node = child
        pos += same
    return node, pos, None, 0, steps


def protect_delta(node: Node, page_size: int) -> tuple[int, int]:
    """The device and host pages that move between evictable and protected when ``node``
    gets its first pin or loses its last: none while a copy in flight protects the node
    anyway, and no host pages while a backup reads them or a hard host pin holds them."""
    if node.device is FILLING or node.host is FILLING:
        return 0, 0
    k = len(node.key) // page_size
    dev = k if node.device is not ABSENT else 0
    read = node.storage is FILLING or node.host_pins  # a backup or a hard pin holds them
    host = k if node.host is not ABSENT and not read else 0
    return dev, host


def py_pin_path(node: Node, page_size: int, clock: int | None) -> tuple[int, int]:
    """Add one pin to ``node`` (not a root) and each ancestor below the root, and stamp each
    ``last_access = clock`` unless ``clock`` is ``None``.  Returns the device and host pages
    that went from evictable to protected (nodes that had no pin)."""
    dev = host = 0
    while node.parent is not None:
        if node.pins == 0:
            d, h = protect_delta(node, page_size)
            dev += d
            host += h
        node.pins += 1
        if clock is not None:
            node.last_access = clock
        node = node.parent
    return dev, host


def may_be_victim(node: Node) -> bool:
    """Whether ``node``, without a pin, may be a victim of a tier now: device-resident with
    no device-present child (a device candidate), or device-absent and childless (a host
    candidate).  The victim heaps' own tests (``tiers.py``) decide; a node failing this
    fails those."""
    if node.device is RESIDENT:
        return node.n_dev_children == 0
    return node.device is ABSENT and not node.children


def py_unpin_path(node: Node, page_size: int) -> tuple[int, int, list[Node] | None]:
    """Drop one pin from ``node`` (not a root) and each ancestor below the root.  Returns
    the device and host pages that went from protected to evictable, and the nodes left
    without a pin that :func:`may_be_victim`, in walk order (``None``: no node was left
    without a pin; an empty list: some were, none may be a victim).

    Raises:
        AssertionError: a node of the path had no pin (those below it were unpinned).
    """
    dev = host = 0
    unpinned: list[Node] | None = None
    while node.parent is not None:
        pins = node.pins
        if pins <= 0:
            raise AssertionError(f"unpin of unpinned {node!r}")
        node.pins = pins - 1
        if pins == 1:
            d, h = protect_delta(node, page_size)
            dev += d
            host += h
            if unpinned is None:
                unpinned = []
            if may_be_victim(node):
                unpinned.append(node)
        node = node.parent
    return dev, host, unpinned


_NEITHER, _ON_DEVICE, _HOST_ONLY = 0, 1, 2


def py_path_lens(node: Node) -> tuple[int, int]:
    """``(device_len, host_len)`` of the path to ``node``: the tokens of its leading
    device-resident run, and of the host-resident (not corrupt) run right after it, without
    trailing-window rules (``MatchResult.lens``)."""
    # one walk up: ``run`` is the segment that reaches the current node from below and
    # ``dev`` / ``host`` the runs it would give if it reached the root
    run = _NEITHER
    dev = host = 0
    while node.parent is not None:
        k = len(node.key)
        if node.device is RESIDENT:
            if run == _ON_DEVICE:
                dev += k
            else:
                host = host if run == _HOST_ONLY else 0
                dev, run = k, _ON_DEVICE
        elif node.host is RESIDENT and not node.corrupt:
            if run == _HOST_ONLY:
                host += k
            else:
                host, run = k, _HOST_ONLY
        else:
            run = _NEITHER
        node = node.parent
    if run == _ON_DEVICE:
        return dev, host
    return 0, host if run == _HOST_ONLY else 0


#: tokens :func:`grow` takes without the Python check: exact ints in ``[0, 2**30)``
_PLAIN = 1 << 30


def py_grow(
    root: Node,
    page_size: int,
    tokens: list[Any],
    n: int,
    skip: int,
    anchor: Node | None,
    pages: Any,
    clock: int,
    ns: Any,
) -> tuple[Node, int, int, int] | None:
    """The common insert of ``tokens[:n]`` (page-aligned) below ``root``, whole: the walk
    down passes only nodes on device (``RESIDENT``) whose keys ``tokens`` match whole, and
    ends after exactly ``skip`` pages, on ``anchor`` or an ancestor of it (when ``skip`` >
    0), with no child there for the next page.  The tokens from there on (all of them, the
    unaligned tail too) are exact ints in ``[0, 2**30)``.  Then a new leaf for
    ``tokens[pos:n]`` in namespace ``ns`` takes ``pages`` (its device page ids), is stamped
    ``clock`` and pinned with its path (:func:`py_pin_path`).  Returns ``(leaf, pos, dev,
    host)`` (``pos``: the tokens above the leaf; ``dev``/``host``: the pages the pin
    protected, as :func:`py_pin_path` returns them), or ``None`` with nothing changed where
    the insert is not that simple.  The caller keeps the tree's counts."""
    p = page_size
    assert root.parent is None and 0 <= n <= len(tokens) and n % p == 0, (
        "grow starts at a root, with n page-aligned tokens"
    )
    node, pos = root, 0
    key: Any = None
    while pos < n:
        page = tokens[pos : pos + p]
        if any(type(t) is not int for t in page):
            return None
        key = page[0] if p == 1 else tuple(page)
        child = node.children.get(key)
        if child is None:
            break
        k = len(child.key)
        run = tokens[pos : min(pos + k, n)]
        if child.device is not RESIDENT or any(type(t) is not int for t in run):
            return None
        if run != child.key:
            return None  # the walk ends inside the child: a split
        node, pos = child, pos + k
    if pos >= n or pos != skip * p or any(type(t) is not int for t in tokens[pos:]):
        return None
    if not all(0 <= t < _PLAIN for t in tokens[pos:]):
        return None
    if skip:
        up = anchor
        while up is not None and up is not node:
            up = up.parent
        if up is None:
            return None
    leaf = Node(tokens[pos:n], node, ns)
    leaf.last_access = clock
    leaf.device_pages = pages
    leaf.device = RESIDENT
    node.children[key] = leaf
    node.n_dev_children += 1
    dev, host = py_pin_path(leaf, p, clock)
    return leaf, pos, dev, host


def py_pin_match(
    root: Node, page_size: int, tokens: list[Any], n: int, clock: int
) -> tuple[Node, int, int, int] | None:
    """The common match of ``tokens[:n]`` (page-aligned) below ``root``, whole: the walk
    down matches whole nodes only and ends below the root on a node boundary (the next page
    has no child, or ``n`` is reached), and every token after it (the unaligned tail too)
    is an exact int in ``[0, 2**30)``.  Then the path is pinned and stamped ``clock``
    (:func:`py_pin_path`).  Returns ``(node, pos, dev, host)`` (``pos``: the tokens matched;
    ``dev``/``host`` as :func:`py_pin_path` returns them), or ``None`` with nothing changed
    where the match is not that simple (a miss, a split, another token)."""
    p = page_size
    assert root.parent is None and 0 <= n <= len(tokens) and n % p == 0, (
        "pin_match starts at a root, with n page-aligned tokens"
    )
    node, pos = root, 0
    while pos < n:
        page = tokens[pos : pos + p]
        if any(type(t) is not int for t in page):
            return None
        child = node.children.get(page[0] if p == 1 else tuple(page))
        if child is None:
            break
        k = len(child.key)
        run = tokens[pos : min(pos + k, n)]
        if any(type(t) is not int for t in run) or run != child.key:
            return None  # the match ends inside the child: a split
        node, pos = child, pos + k
    if not pos or not all(type(t) is int and 0 <= t < _PLAIN for t in tokens[pos:]):
        return None
    dev, host = py_pin_path(node, p, clock)
    return node, pos, dev, host


_EXT: Any = optional_extension("aiocache_kv.tree._pathwalk")
if _EXT is not None:
    _EXT.bind(Node, ABSENT, FILLING, RESIDENT)
    _EXT.prototype(Node([], None, None))  # what grow's new leaves start from, as Node() makes

#: ``"c"`` where the C extension walks, else ``"python"``.
PATHWALK_IMPL = "python" if _EXT is None else "c"

#: :func:`py_pin_path`, in C where the extension is built.
pin_path: Callable[[Node, int, int | None], tuple[int, int]] = (
    py_pin_path if _EXT is None else _EXT.pin_path
)
#: :func:`py_unpin_path`, in C where the extension is built.
unpin_path: Callable[[Node, int], tuple[int, int, list[Node] | None]] = (
    py_unpin_path if _EXT is None else _EXT.unpin_path
)
#: :func:`py_descend` in C where the extension is built (it gives ``None`` where the walk
#: meets an item that is not an exact int: take :func:`py_descend` then).
descend: Callable[[Node, int, list[Any], int, bool], Descent | None] = (
    py_descend if _EXT is None else _EXT.descend
)
#: :func:`py_path_lens`, in C where the extension is built.
path_lens: Callable[[Node], tuple[int, int]] = py_path_lens if _EXT is None else _EXT.path_lens
#: :func:`py_grow`, in C where the extension is built.
grow: Callable[..., tuple[Node, int, int, int] | None] = py_grow if _EXT is None else _EXT.grow
#: :func:`py_pin_match`, in C where the extension is built.
pin_match: Callable[[Node, int, list[Any], int, int], tuple[Node, int, int, int] | None] = (
    py_pin_match if _EXT is None else _EXT.pin_match
)
