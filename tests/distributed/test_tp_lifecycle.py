"""Start and close under tensor parallelism (real gloo ranks on 127.0.0.1).

* A rank whose first ``start`` failed and which started again registered the abandoned
  storage tier's agreement queue too: its vectors were wider than its peers' and gloo aborted
  the process at the first agreement.
* A rank whose peer left got ``AgreementError`` from ``aclose`` with its storage tier, copy
  engine and agreement thread left running.
"""

from __future__ import annotations

from pathlib import Path

from tests.distributed.test_tp import run_ranks

WORKER = "tests.distributed.tp_lifecycle_worker"


async def test_a_rank_that_retried_its_start_agrees_with_the_others(tmp_path: Path) -> None:
    results = await run_ranks(2, tmp_path, "--scenario", "retry_start", worker=WORKER)
    assert [r["retried"] for r in results] == [False, True]
    assert results[0]["shape"] == results[1]["shape"]
    assert results[0]["collectives"] == results[1]["collectives"]
    assert results[0]["backup_ok"] == results[1]["backup_ok"] > 0


async def test_a_close_after_the_group_broke_still_closes_every_part(tmp_path: Path) -> None:
    results = await run_ranks(2, tmp_path, "--scenario", "peer_gone", worker=WORKER)
    r0 = next(r for r in results if r["rank"] == 0)
    assert r0["sync"] == "AgreementError"
    assert r0["aclose"] == "AgreementError"  # raised once every part was closed
    assert r0["store_closed"] is True
    assert r0["threads"] == [], r0["threads"]
