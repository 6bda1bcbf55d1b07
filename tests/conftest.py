"""Suite-wide fixtures: every test runs under the blocking-call detector."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

import aiocache_kv as akv
from aiocache_kv.testing import BlockingCallDetector, ManualCopyEngine


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
