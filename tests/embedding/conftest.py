"""Fixtures of the embedding-cache tests.

The real-master fixtures are those of tests/storage/conftest.py (importing them registers them
here too): ``mooncake_master`` (session), ``fault_master`` (per test), ``MasterProc``; like
there, a missing mooncake dependency skips locally and FAILS when ``CI=true``.
"""

from __future__ import annotations

import uuid

import pytest

from tests.storage.conftest import (  # noqa: F401  (fixtures are registered by import)
    LOOPBACK,
    MasterProc,
    fault_master,
    master_executable,
    mooncake_master,
)

from .fakes import FakeMooncakeStorage


@pytest.fixture
def ns() -> str:
    """An embedding namespace unique to the test (keys never collide across tests)."""
    return f"e{uuid.uuid4().hex[:12]}"


@pytest.fixture
def fake_store() -> FakeMooncakeStorage:
    """A ``MooncakeStorage`` whose client is an in-memory fake with hand-held gates."""
    return FakeMooncakeStorage()
