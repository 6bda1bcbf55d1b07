"""The in-memory Mooncake client the embedding tests use: the package's shared fake
(:mod:`aiocache_kv.testing.fake_mooncake`), under the names these tests import."""

from aiocache_kv.testing.fake_mooncake import FakeMooncakeClient as FakeClient
from aiocache_kv.testing.fake_mooncake import FakeMooncakeStorage

__all__ = ["FakeClient", "FakeMooncakeStorage"]
