"""What a handle hands out is the caller's: writing to it never changes the tree.

``MatchResult.device_pages`` / ``device_indices`` and ``InsertResult.device_pages`` /
``device_indices`` were views of a node's own page-id array whenever the path's device part
was one node (at page size 1 ``device_indices`` too): a serving loop shifting or filling the
tensor in place (``rows += base``, ``rows[-1] = pad``) rewrote the tree's page ids, so a later
match served other pages' KV for these tokens (rule 3) and ``check_invariants`` failed.
"""

from __future__ import annotations

import random

import pytest
import torch

import aiocache_kv as akv
from tests.conftest import small_config


def _scribble(t: torch.Tensor) -> None:
    """What a caller may do to a tensor it was handed: in place, every element."""
    t.add_(1000)


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize(
    "what",
    ["match.device_pages", "match.device_indices", "insert.device_pages", "insert.device_indices"],
)
async def test_writing_to_handed_rows_leaves_the_tree_as_it_was(page: int, what: str) -> None:
    async with akv.HiCache(small_config(page_size=page, host_pages=0)) as cache:
        toks = list(range(1, 8 * page + 1))
        own = cache.alloc(len(toks))
        r = cache.insert(toks, own)  # one node: its array was handed out as is
        m = cache.match_prefix(toks)
        want_pages = m.device_pages.clone()
        want_rows = m.device_indices.clone()
        handle = m if what.startswith("match") else r
        _scribble(getattr(handle, what.split(".")[1]))
        again = cache.match_prefix(toks)
        assert torch.equal(again.device_pages, want_pages), f"{what} wrote into the tree"
        assert torch.equal(again.device_indices, want_rows)
        assert torch.equal(r.device_pages, want_pages)
        cache.check_invariants()
        for h in (again, m, r):
            cache.release(h)


async def test_handed_rows_of_a_path_of_several_nodes_are_the_callers_too() -> None:
    """Seeded: random splits make paths of one node or several; whatever a caller does to
    any handed tensor, every later match reads the pages the inserts gave."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    async with akv.HiCache(small_config(page_size=2, host_pages=0, device_pages=256)) as cache:
        truth: dict[tuple[int, ...], torch.Tensor] = {}
        held = []
        for _ in range(12):
            base = [rng.randrange(3) for _ in range(rng.randrange(1, 4) * 2)]
            toks = [*base, *(rng.randrange(100, 200) for _ in range(rng.randrange(1, 4) * 2))]
            m = cache.match_prefix(toks)
            own = cache.alloc(len(toks) - m.device_len)
            r = cache.insert(toks, own, prefix=m)
            for t in (m.device_pages, m.device_indices, r.device_pages, r.device_indices):
                _scribble(t)
            cache.release(m)
            held.append(r)
            check = cache.match_prefix(toks)
            truth[tuple(toks)] = check.device_pages.clone()
            cache.release(check)
        for toks, pages in truth.items():
            got = cache.match_prefix(list(toks))
            assert torch.equal(got.device_pages, pages), f"seed {seed}: pages moved for {toks}"
            cache.release(got)
        cache.check_invariants()
        for r in held:
            cache.release(r)
