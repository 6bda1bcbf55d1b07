"""Suite-wide fixtures: every test runs under the blocking-call detector."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings

import aiocache_kv as akv
from aiocache_kv.testing import BlockingCallDetector, ManualCopyEngine

# Hypothesis profiles for every property test.  ``HYPOTHESIS_PROFILE`` picks one (or pytest's
# ``--hypothesis-profile``); the default is ``ci``, also where CI=true.  Budgets are per test:
# a test's own ``@settings(max_examples=...)`` wins over the profile's.
#
# * ``ci``: the same examples on every run (``derandomize``: a seed derived from each test's
#   source, so ``--hypothesis-seed`` is ignored), no example database, no deadline (timing on a
#   loaded 2-core runner is noise; pytest-timeout catches hangs), and no shrink phase: a
#   failure is reported at once with the steps it took and a ``@reproduce_failure`` blob
#   instead of shrinking for minutes.
# * ``ci-shrink``: the ``ci`` examples with shrinking, to minimise a CI failure locally.
# * ``explore``: fresh random seeds on every run (``--hypothesis-seed=N`` replays one), five
#   times the examples, shrinking, and the example database (.hypothesis/) to replay what
#   failed last time.  Run separately, time-boxed, e.g.
#   ``HYPOTHESIS_PROFILE=explore pytest tests/test_state_machine.py --timeout=1800``
#   (shrinking a long stateful run can take minutes; pytest-timeout's default is 300 s).
# Neither runs the ``explain`` phase: on Python < 3.12 it traces every line and takes minutes.
_DEFAULT = settings.get_profile("default")
_NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate, Phase.target)
_SHRINK = (*_NO_SHRINK, Phase.shrink)
_QUIET = (HealthCheck.too_slow,)
settings.register_profile(
    "ci",
    _DEFAULT,
    max_examples=80,
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    phases=_NO_SHRINK,
    suppress_health_check=_QUIET,
)
settings.register_profile("ci-shrink", settings.get_profile("ci"), phases=_SHRINK)
settings.register_profile(
    "explore",
    _DEFAULT,
    max_examples=400,
    deadline=None,
    print_blob=True,
    phases=_SHRINK,
    suppress_health_check=_QUIET,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def no_blocking_calls(request: pytest.FixtureRequest) -> Iterator[BlockingCallDetector | None]:
    """Fail the test if anything made a blocking call on the event-loop thread."""
    if request.node.get_closest_marker("allow_blocking"):
        yield None
        return
    with BlockingCallDetector() as detector:
        yield detector
    assert not detector.violations, f"blocking calls on the event loop: {detector.violations}"


def small_config(**overrides: object) -> akv.CacheConfig:
    """A tiny CPU config for unit tests."""
    opts: dict[str, object] = dict(
        page_size=2,
        num_layers=2,
        num_kv_heads=2,
        head_dim=4,
        dtype=torch.float32,
        device="cpu",
        device_pages=16,
        host_pages=32,
        host_memory_reserve_bytes=0,
    )
    opts.update(overrides)
    return akv.CacheConfig(**opts)  # type: ignore[arg-type]


@pytest.fixture
def engine() -> ManualCopyEngine:
    """A copy engine completed by hand."""
    return ManualCopyEngine()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """In CI (``CI=true``) a skip is a failure, except for CUDA-only tests on a CPU machine."""
    outcome = yield
    report = outcome.get_result()
    if (
        report.skipped
        and os.environ.get("CI", "").lower() == "true"
        and item.get_closest_marker("cuda") is None
        and not hasattr(report, "wasxfail")
    ):
        report.outcome = "failed"
        report.longrepr = f"skipped in CI (a missing dependency must fail): {report.longrepr}"


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--stress-seed N``: run tests/test_stress.py for that one seed."""
    parser.addoption(
        "--stress-seed",
        action="store",
        type=int,
        default=None,
        help="run the randomized stress test (tests/test_stress.py) for this seed only",
    )
