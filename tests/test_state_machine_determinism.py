"""The state machine is deterministic: two runs of the same examples walk the same states.

Hypothesis replays the prefix of an earlier example when it looks for new ones; a machine
whose state at some step depends on timing (a worker thread, the real clock) takes another
branch there and the run fails as ``FlakyStrategyDefinition``, on a loaded CI machine only.
This runs one machine class twice in one process, with the drop's zeroing thread slowed at
random (the timing that broke it), and compares the pools and the machine's own lists after
every step.
"""

from __future__ import annotations

import random
import time
import unittest
from typing import Any

import pytest

import tests.test_state_machine as sm
from aiocache_kv.purge import Purger


def _run(cls: type[unittest.TestCase]) -> None:
    res = unittest.TextTestRunner(stream=_Null(), verbosity=0).run(
        unittest.defaultTestLoader.loadTestsFromTestCase(cls)
    )
    assert res.wasSuccessful(), (res.failures, res.errors)


class _Null:
    def write(self, _: str) -> int:
        return 0

    def flush(self) -> None:
        pass


def test_two_runs_of_the_same_examples_walk_the_same_states(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trace: list[tuple[int, ...]] = []
    settle = sm.HiCacheMachine._settle_background

    def traced(self: Any) -> None:
        settle(self)
        st = self.cache.statistics()
        trace.append(
            (
                st.device.free_pages,
                st.device.evictable_pages,
                st.host.free_pages,
                st.host.evictable_pages,
                st.nodes,
                len(self.engine.pending),
                len(self.held),
                len(self.live),
                len(self.pins),
                len(self.tasks),
            )
        )

    zero = Purger._zero_pages
    rng = random.Random(0)

    def slow_zero(self: Any, dflat: Any, hflat: Any) -> int:
        time.sleep(rng.random() * 0.004)  # a loaded machine's worker thread
        return zero(self, dflat, hflat)

    monkeypatch.setattr(sm.HiCacheMachine, "_settle_background", traced)
    monkeypatch.setattr(Purger, "_zero_pages", slow_zero)
    runs = []
    for _ in range(2):
        trace.clear()
        _run(sm.TestWriteThroughP1)
        runs.append(list(trace))
    assert runs[0], "no step was traced"
    first = next((i for i, (a, b) in enumerate(zip(*runs, strict=False)) if a != b), None)
    assert first is None and len(runs[0]) == len(runs[1]), (
        f"the runs diverged at step {first}: {runs[0][first] if first is not None else ''} vs "
        f"{runs[1][first] if first is not None else ''} (lengths {len(runs[0])}, {len(runs[1])})"
    )
