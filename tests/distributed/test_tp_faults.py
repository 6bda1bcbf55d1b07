"""What one tensor-parallel rank does alone must not part the ranks (real gloo ranks on
127.0.0.1).

* Ranks configured differently are refused at start, on every rank, naming what differs.
* A rank whose first ``start`` failed and which started again registered the abandoned
  storage tier's agreement queue too: its vectors were wider than its peers' and gloo aborted
  the process at the first agreement.
* A rank whose peer left got ``AgreementError`` from ``aclose`` with its storage tier, copy
  engine and agreement thread left running.
* A caller cancelled on one rank only (``prefetch``, ``load_back``, ``flush``, ``warm``)
  skipped applying what the call agreed: the trees parted and the collectives fell out of
  step (``AgreementError``, or gloo aborting on vectors of different lengths).
* A handle dropped unreleased had its pin released by a loop callback, which ran wherever
  each rank's loop yielded: one rank evicted its pages and the other did not.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.test_tp import run_ranks

WORKER = "tests.distributed.tp_faults_worker"


async def test_a_rank_that_retried_its_start_agrees_with_the_others(tmp_path: Path) -> None:
    results = await run_ranks(2, tmp_path, "--scenario", "retry_start", worker=WORKER)
    assert [r["retried"] for r in results] == [False, True]
    assert results[0]["shape"] == results[1]["shape"]
    assert results[0]["collectives"] == results[1]["collectives"]
    assert results[0]["backup_ok"] == results[1]["backup_ok"] > 0


async def test_ranks_configured_differently_are_refused_at_start(tmp_path: Path) -> None:
    """Found by an adversarial round: a rank with a storage tier and one without issued
    agreement vectors of different lengths; gloo answered garbage on the shorter rank (its
    first agreement "succeeded") and both failed only at the group's timeout, naming nothing.
    The first collective of a start now compares the ranks' layouts."""
    results = await run_ranks(2, tmp_path, "--scenario", "misconfigured", worker=WORKER)
    for r in results:
        assert "configured differently" in r["refused"], r
        for name in ("storage", "host_pages", "agreement queues"):
            assert name in r["refused"], (name, r["refused"])
        assert "page_size" not in r["refused"]
        assert r["threads"] == [], r["threads"]
    assert "host_pages (this rank: 48)" in results[0]["refused"]
    assert "host_pages (this rank: 40)" in results[1]["refused"]
    assert results[0]["shape"] == results[1]["shape"]
    assert results[0]["collectives"] == results[1]["collectives"]


async def test_a_close_after_the_group_broke_still_closes_every_part(tmp_path: Path) -> None:
    results = await run_ranks(2, tmp_path, "--scenario", "peer_gone", worker=WORKER)
    r0 = next(r for r in results if r["rank"] == 0)
    assert r0["sync"] == "AgreementError"
    assert r0["aclose"] == "AgreementError"  # raised once every part was closed
    assert r0["store_closed"] is True
    assert r0["threads"] == [], r0["threads"]


@pytest.mark.parametrize("call", ["prefetch", "load_back", "flush", "warm"])
async def test_a_call_cancelled_on_one_rank_keeps_the_trees_identical(
    tmp_path: Path, call: str
) -> None:
    results = await run_ranks(2, tmp_path, "--scenario", "cancel", "--call", call, worker=WORKER)
    assert results[0]["shape"] == results[1]["shape"], results
    assert results[0]["collectives"] == results[1]["collectives"]


async def test_a_leaked_handle_is_released_at_the_same_point_on_every_rank(
    tmp_path: Path,
) -> None:
    results = await run_ranks(2, tmp_path, "--scenario", "leaked_handle", worker=WORKER)
    assert [r["evicted"] for r in results] == [0, 0]  # pinned until the next sync
    assert results[0]["evicted_after_sync"] == results[1]["evicted_after_sync"] > 0
    assert results[0]["shape"] == results[1]["shape"]
