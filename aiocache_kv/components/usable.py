"""The usable end of a prefix: the minimum over components, as one pure function.

Used both when matching (validity comes from tree nodes) and when committing a prefetch
(validity comes from what arrived), so the two can never disagree.
"""

from __future__ import annotations

from collections.abc import Sequence

Trailing = tuple[int, Sequence[bool], int]
"""``(window_pages, valid, offset)``: ``valid[offset + i]`` tells whether page ``i`` is present;
the ``offset`` entries before page 0 describe pages before the region (e.g. already cached)."""


def feasible_ends(all_run: int, trailing: Sequence[Trailing], limit: int) -> list[bool]:
    """For each end ``E`` in ``1..limit`` (pages): can a prefix of ``E`` pages be used?

    ``all_run`` - leading pages present for the KV and every ALL_PAGES component.
    ``trailing`` - per TRAILING_PAGES component, see :data:`Trailing`.  End ``E`` needs that
    component's pages ``[E - window, E)`` present (clipped at the start of ``valid``).
    """
    missing = []  # per trailing component: prefix counts of absent entries of ``valid``
    for _, valid, offset in trailing:
        acc = [0]
        for i in range(offset + limit):
            acc.append(acc[-1] + (0 if i < len(valid) and valid[i] else 1))
        missing.append(acc)
    out = []
    for end in range(1, limit + 1):
        ok = end <= all_run
        for (window, _, offset), acc in zip(trailing, missing, strict=True):
            if not ok:
                break
            hi = offset + end
            ok = acc[hi] - acc[max(0, hi - window)] == 0
        out.append(ok)
    return out


def usable_end(all_run: int, trailing: Sequence[Trailing], limit: int) -> int:
    """The largest feasible end (pages), or 0."""
    flags = feasible_ends(all_run, trailing, limit)
    for end in range(limit, 0, -1):
        if flags[end - 1]:
            return end
    return 0
