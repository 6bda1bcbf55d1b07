"""Stores whose first ``open`` fails (a directory not mounted yet, a master still starting):
the fault of a start that gives up, for the tests of a retried start."""

from __future__ import annotations

from pathlib import Path

from aiocache_kv.errors import StorageUnavailableError
from aiocache_kv.storage import FileStorage
from aiocache_kv.testing import MemoryStorage


class FailingOpens:
    """Mixin before a store class: the next ``fails`` calls of ``open`` raise
    ``StorageUnavailableError``, then ``open`` works."""

    fails = 1

    def open(self) -> None:
        if self.fails:
            self.fails -= 1
            raise StorageUnavailableError("injected: the open fails (not mounted yet)")
        super().open()  # type: ignore[misc]


class FlakyMemory(FailingOpens, MemoryStorage):
    """A ``MemoryStorage`` whose first ``fails`` opens fail."""

    def __init__(self, fails: int = 1) -> None:
        super().__init__()
        self.fails = fails


class FlakyFile(FailingOpens, FileStorage):
    """A ``FileStorage`` at ``path`` (no capacity bound) whose first ``fails`` opens fail."""

    def __init__(self, path: Path, fails: int = 1) -> None:
        super().__init__(path, capacity_bytes=None)
        self.fails = fails
