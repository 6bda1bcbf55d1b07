"""KV events (vLLM schema) and the log that buffers them."""

from aiocache_kv.errors import MissingDependencyError
from aiocache_kv.events.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from aiocache_kv.events.log import EventLog
from aiocache_kv.events.zmq import ZmqEventPublisher

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventLog",
    "KVEvent",
    "MissingDependencyError",
    "ZmqEventPublisher",
]
