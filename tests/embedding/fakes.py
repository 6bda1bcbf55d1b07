"""The in-memory Mooncake client the embedding tests use: the package's shared fake
(:mod:`aiocache_kv.testing.fake_mooncake`), under the names these tests import.

The embedding tests count what a push re-sends, so their store asks ``batch_is_exist`` before
each put (``check_existing=True``): then ``put_skipped`` / ``bytes_written`` are exact.
"""

from typing import Any

from aiocache_kv.testing.fake_mooncake import FakeMooncakeClient as FakeClient
from aiocache_kv.testing.fake_mooncake import FakeMooncakeStorage as _FakeStorage

__all__ = ["FakeClient", "FakeMooncakeStorage"]


class FakeMooncakeStorage(_FakeStorage):
    """The shared fake storage, checking existence before each put."""

    def __init__(self, client: FakeClient | None = None, **options: Any) -> None:
        options.setdefault("check_existing", True)
        super().__init__(client, **options)
