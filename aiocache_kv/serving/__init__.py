"""A batched asyncio serving engine on the cache (a layer above the runtime: nothing in the
runtime imports it).

:class:`Engine` runs many requests per forward pass (continuous batching with chunked prefill)
over a :class:`~aiocache_kv.HiCache`: see :mod:`aiocache_kv.serving.engine`.
"""

from __future__ import annotations

from aiocache_kv.serving.engine import Engine
from aiocache_kv.serving.request import GenerationResult, RequestState
from aiocache_kv.serving.stats import EngineStatistics
from aiocache_kv.serving.stream import TokenStream

__all__ = ["Engine", "EngineStatistics", "GenerationResult", "RequestState", "TokenStream"]
