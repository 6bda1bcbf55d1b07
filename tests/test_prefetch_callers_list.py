"""A prefetch commits what it read for the tokens it was called with, whatever the caller
does to its list meanwhile (rule 3).

The prefetch kept the caller's list and read it again when it committed: a serving loop that
reused the list for another prompt while the reads were in flight (``toks[:] = other``) got
the stored KV of the first prompt attached under the second prompt's tokens, and a match of
the second prompt hit pages computed for the first.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import aiocache_kv as akv
from aiocache_kv.storage.tier import PrefetchStatus
from tests.test_cache import read_kv
from tests.test_storage_tier import PROMPT, cfg, stored_prompt

OTHER = [t + 1000 for t in PROMPT]


def _reuse(toks: list[int]) -> None:
    toks[:] = OTHER  # the same list object, another prompt


def _extend(toks: list[int]) -> None:
    toks.extend(OTHER)  # the usual case: a generated continuation appended


def _truncate(toks: list[int]) -> None:
    del toks[3:]


@pytest.mark.parametrize("change", [_reuse, _extend, _truncate])
async def test_a_prefetch_commits_for_the_tokens_it_was_given(
    tmp_path: Path, change: Callable[[list[int]], None]
) -> None:
    written = await stored_prompt(tmp_path)
    async with akv.HiCache(cfg(tmp_path)) as cache:
        toks = list(PROMPT)
        task = asyncio.ensure_future(cache.prefetch(toks))
        await asyncio.sleep(0)  # the prefetch started: its reads are in flight
        assert not task.done()
        change(toks)
        res = await task
        assert res.status is PrefetchStatus.COMPLETE and res.hit_tokens == len(PROMPT)
        other = cache.match_prefix(OTHER)
        assert other.matched_len == 0, "another prompt's tokens hit the pages read for PROMPT"
        cache.release(other)
        m = cache.match_prefix(PROMPT)
        assert (m.device_len, m.host_len) == (0, len(PROMPT))
        await cache.load_back(m)
        for a, b in zip(read_kv(cache, m.device_indices), written, strict=True):
            assert torch.equal(a, b)
        cache.release(m)
        cache.check_invariants()
