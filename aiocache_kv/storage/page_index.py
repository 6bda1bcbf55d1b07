"""The in-memory index of a :class:`~aiocache_kv.storage.file.FileStorage`: which pages exist,
their sizes, the chains they form, and which page to evict next.

Pages of a prompt form a chain (page ``i`` depends on page ``i - 1``: a prefetch commits only
the leading run), so evicting by plain LRU drops a prompt's first page first and leaves the rest
unreachable.  The index therefore evicts *chain ends* first: pages no stored page depends on
(``children == 0``), least recently used among them.  A page whose parent is not stored (never
was, or its parent is unknown) is still a chain end when nothing depends on it.  Reading a run
of pages refreshes its ancestors too (:meth:`PageIndex.touch_run`), so a prompt that keeps
hitting keeps its whole chain.

The refresh of the ancestors is lazy: only a chain end is ever a victim, and a page becomes a
chain end only when its last dependant leaves, so a hit records its tick on the pages it read
(``hit``) and each page hands the newest hit of its subtree to its parent when it is removed.
A page that becomes a chain end is then exactly as recent as the newest hit below it, as if
every hit had walked up to the root - without the walk, which made a prefetch of a long prompt
in chunks cost the prompt's length per chunk (quadratic in its pages).

Cycles cannot come from hash chains; should hostile parents form one, nothing in it is a chain
end and eviction falls back to the least recently used page of all, so the capacity bound
always holds.

Per-tenant budgets (issue #26): each page records the namespace tag of its key, and the index
keeps the pages of each tag in least-recently-used order, so the storage can count a tenant's
pages (the sum over its tags) and evict its oldest pages when it is over its budget
(:meth:`PageIndex.pick_tag_victims`: chain ends first among the oldest, as above).

Not thread-safe: the owning storage guards every call with its lock.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["PageIndex"]


@dataclass(slots=True)
class _Entry:
    size: int
    parent: str | None
    tick: int
    children: int = 0  #: stored pages whose parent this is
    hit: int = 0  #: the newest hit (touch_run) of this page or of a removed page below it
    tag: str | None = None  #: the namespace tag of its key (``None``: unknown)
    gen: int = 0  #: which :meth:`PageIndex.add` recorded it (unique in the index)


#: how many of a tag's oldest pages :meth:`PageIndex.pick_tag_victims` looks through for a
#: chain end before it takes the oldest page itself
_CHAIN_END_SCAN = 64


class PageIndex:
    """Pages by name: size, parent, dependants and recency (see the module docstring)."""

    def __init__(self) -> None:
        self._pages: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._leaves: list[tuple[int, str]] = []  # heap of (tick, name), stale entries skipped
        #: parent name -> stored pages that name it while it is not stored
        self._orphans: dict[str, int] = {}
        self._tick = 0
        self.total = 0  #: sum of the sizes
        #: tag -> its pages, least recently used first
        self._by_tag: dict[str, OrderedDict[str, None]] = {}

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, name: object) -> bool:
        return name in self._pages

    def names(self) -> list[str]:
        """Every name, least recently used first."""
        return list(self._pages)

    def size(self, name: str) -> int | None:
        """The file size recorded for ``name`` (``None``: not stored)."""
        entry = self._pages.get(name)
        return None if entry is None else entry.size

    def present(self, names: list[str], sizes: list[int]) -> list[int]:
        """The indices ``i`` whose ``names[i]`` is stored with size ``sizes[i]``, in order;
        each of those pages is touched (:meth:`touch`: a put of a present page is a use)."""
        pages = self._pages
        hit = [
            i
            for i, (name, size) in enumerate(zip(names, sizes, strict=True))
            if (entry := pages.get(name)) is not None and entry.size == size
        ]
        for i in hit:
            self.touch(names[i])
        return hit

    def generation(self, name: str) -> int | None:
        """Which :meth:`add` recorded ``name`` (``None``: not stored): a number no other entry
        of this index had or will have, so a caller that saw one entry before working outside
        the lock can tell whether the page was removed or stored again meanwhile (a touch
        keeps it)."""
        entry = self._pages.get(name)
        return None if entry is None else entry.gen

    def parent(self, name: str) -> str | None:
        """The parent recorded for ``name`` (``None``: a chain start or unknown)."""
        return self._pages[name].parent

    def children(self, name: str) -> int:
        """How many stored pages depend on ``name``."""
        return self._pages[name].children

    def _next(self) -> int:
        self._tick += 1
        return self._tick

    def _push_leaf(self, name: str, entry: _Entry) -> None:
        heapq.heappush(self._leaves, (entry.tick, name))
        if len(self._leaves) > 2 * len(self._pages) + 64:  # drop the stale entries
            self._leaves = [(e.tick, n) for n, e in self._pages.items() if not e.children]
            heapq.heapify(self._leaves)

    def add(self, name: str, size: int, parent: str | None, tag: str | None = None) -> None:
        """Record a new page (replacing one of the same name) as the most recently used
        (``tag``: the namespace tag of its key, for per-tenant budgets)."""
        self.remove(name)
        if parent == name:
            parent = None  # a page cannot depend on itself
        tick = self._next()
        entry = _Entry(size, parent, tick, self._orphans.pop(name, 0), tag=tag, gen=tick)
        self._pages[name] = entry
        if tag is not None:
            self._by_tag.setdefault(tag, OrderedDict())[name] = None
        self.total += size
        if parent is not None:
            up = self._pages.get(parent)
            if up is None:
                self._orphans[parent] = self._orphans.get(parent, 0) + 1
            else:
                up.children += 1
        if not entry.children:
            self._push_leaf(name, entry)

    def add_many(self, items: list[tuple[str, int, str | None, str | None]]) -> None:
        """:meth:`add` of each ``(name, size, parent, tag)`` in order, as one step: a page
        that a later item of the batch depends on is never pushed as a chain end (a put of
        a prompt's chain pushes only its last page)."""
        pages = self._pages
        orphans = self._orphans
        by_tag = self._by_tag
        tick = self._tick
        total = self.total
        fresh: list[_Entry] = []
        for name, size, parent, tag in items:
            if name in pages:
                self.total = total
                self.remove(name)
                total = self.total
            if parent == name:
                parent = None  # a page cannot depend on itself
            tick += 1
            kids = orphans.pop(name, 0) if orphans else 0
            pages[name] = entry = _Entry(size, parent, tick, kids, 0, tag, tick)
            if tag is not None:
                mine = by_tag.get(tag)
                if mine is None:
                    mine = by_tag[tag] = OrderedDict()
                mine[name] = None
            total += size
            if parent is not None:
                up = pages.get(parent)
                if up is None:
                    orphans[parent] = orphans.get(parent, 0) + 1
                else:
                    up.children += 1
            fresh.append(entry)
        self._tick = tick
        self.total = total
        for (name, *_), entry in zip(items, fresh, strict=True):
            if not entry.children and pages.get(name) is entry:
                self._push_leaf(name, entry)

    def remove(self, name: str) -> int | None:
        """Forget ``name``; its size, or ``None`` when it was not there."""
        entry = self._pages.pop(name, None)
        if entry is None:
            return None
        self.total -= entry.size
        if entry.tag is not None:
            mine = self._by_tag[entry.tag]
            del mine[name]
            if not mine:
                del self._by_tag[entry.tag]
        if entry.children:  # its dependants wait for it as orphans
            self._orphans[name] = self._orphans.get(name, 0) + entry.children
        parent = entry.parent
        if parent is not None:
            up = self._pages.get(parent)
            if up is not None:
                up.children -= 1
                assert up.children >= 0, f"page {parent} has {up.children} children"
                up.hit = max(up.hit, entry.hit)  # the subtree's newest hit moves up
                if not up.children:
                    up.tick = max(up.tick, up.hit)  # a new chain end: as recent as its hits
                    self._push_leaf(parent, up)
            else:
                left = self._orphans.get(parent, 0) - 1
                if left > 0:
                    self._orphans[parent] = left
                else:
                    self._orphans.pop(parent, None)
        return entry.size

    def touch(self, name: str) -> None:
        """``name`` was used now (a verified read, or a put of a present page)."""
        entry = self._pages.get(name)
        if entry is None:
            return
        entry.tick = self._next()
        self._pages.move_to_end(name)
        if entry.tag is not None:
            self._by_tag[entry.tag].move_to_end(name)
        if not entry.children:
            self._push_leaf(name, entry)

    def touch_run(self, names: list[str]) -> None:
        """``names`` and every stored ancestor of theirs were used now (a prefetch hit its
        chains).  The pages get one new tick; their ancestors get it when they become chain
        ends (see the module docstring), so a run costs its length, not its chains'."""
        tick = self._next()
        for name in names:
            entry = self._pages.get(name)
            if entry is None:
                continue
            entry.tick = entry.hit = tick
            self._pages.move_to_end(name)
            if entry.tag is not None:
                self._by_tag[entry.tag].move_to_end(name)
            if not entry.children:
                self._push_leaf(name, entry)

    def pick_victims(self, capacity: int) -> list[str]:
        """Remove and return pages until the total fits ``capacity``: chain ends, least
        recently used first (the fallback for a cycle: the least recently used page)."""
        victims: list[str] = []
        while self.total > capacity and self._pages:
            name = self._pop_leaf()
            if name is None:
                name = next(iter(self._pages))
            self.remove(name)
            victims.append(name)
        return victims

    def tag_pages(self, tag: str) -> int:
        """How many pages of ``tag`` are stored."""
        mine = self._by_tag.get(tag)
        return 0 if mine is None else len(mine)

    def pick_tag_victims(self, tags: list[str], limit: int) -> list[str]:
        """Remove and return pages of ``tags`` (one tenant's) until at most ``limit`` are
        left: the least recently used tag's oldest chain end among its oldest pages (else
        that oldest page), page by page."""
        victims: list[str] = []
        count = sum(self.tag_pages(t) for t in tags)
        while count > limit:
            oldest: tuple[int, str] | None = None
            for t in tags:
                mine = self._by_tag.get(t)
                if mine:
                    first = next(iter(mine))
                    tick = self._pages[first].tick
                    if oldest is None or tick < oldest[0]:
                        oldest = (tick, t)
            assert oldest is not None, f"{count} pages of {tags} counted, none found"
            mine = self._by_tag[oldest[1]]
            name = next(iter(mine))
            for i, candidate in enumerate(mine):
                if i >= _CHAIN_END_SCAN:
                    break
                if not self._pages[candidate].children:
                    name = candidate
                    break
            self.remove(name)
            victims.append(name)
            count -= 1
        return victims

    def _pop_leaf(self) -> str | None:
        while self._leaves:
            tick, name = heapq.heappop(self._leaves)
            entry = self._pages.get(name)
            if entry is not None and entry.tick == tick and not entry.children:
                return name
        return None

    def check(self) -> None:
        """Assert the counts agree with the entries (tests; O(pages))."""
        children: dict[str, int] = {}
        orphans: dict[str, int] = {}
        for entry in self._pages.values():
            if entry.parent is None:
                continue
            if entry.parent in self._pages:
                children[entry.parent] = children.get(entry.parent, 0) + 1
            else:
                orphans[entry.parent] = orphans.get(entry.parent, 0) + 1
        for name, entry in self._pages.items():
            assert entry.children == children.get(name, 0), (
                f"page {name}: {entry.children} children counted, {children.get(name, 0)} stored"
            )
        assert orphans == self._orphans, f"orphans {self._orphans} != {orphans}"
        total = sum(e.size for e in self._pages.values())
        assert self.total == total, f"total {self.total} != {total}"
        by_tag: dict[str, set[str]] = {}
        for name, entry in self._pages.items():
            if entry.tag is not None:
                by_tag.setdefault(entry.tag, set()).add(name)
        got = {t: set(names) for t, names in self._by_tag.items()}
        assert got == by_tag, "pages per tag disagree with the entries"
