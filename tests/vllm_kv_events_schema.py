"""vLLM's KV-event msgspec structs, copied for decoding what ``ZmqEventPublisher`` sends.

Only the data-structure definitions are copied (no behaviour beyond what decoding needs):

* ``current``: ``vllm/distributed/kv_events.py`` of vllm-project/vllm ``main`` at the revision
  with typed ``ExtraKey`` entries, ``event_version``, ``locality``/``ownership`` and the topic
  frame in replay replies (the tagged-map events of vllm-project/vllm#42892; ``EventBatch``
  still ``array_like``).  The search index that served the file did not record its commit.
  vLLM's newer KV-event tests (the revision that adds ``session_id``) default
  ``event_version`` to ``None`` and expect events with typed ``extra_keys`` to carry ``1`` on
  the wire; both decode what the publisher sends, since it writes ``event_version`` with
  ``extra_keys``.
* ``legacy``: the same file before #42892 (``array_like=True`` events, ``lora_name`` the last
  positional field; e.g. vLLM v0.10.x), what older consumers decode.

Kept without ``from __future__ import annotations``: msgspec resolves these annotations at
definition time.
"""

import types
from typing import Any

import msgspec

# ------------------------------------------------------------------ current (map events)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class ExtraKey(msgspec.Struct, gc=False, frozen=True, tag=True):
    pass


class LoRAKey(ExtraKey, frozen=True, tag="lora"):
    name: str


class CacheSaltKey(ExtraKey, frozen=True, tag="cache_salt"):
    salt: str


class PromptEmbedsKey(ExtraKey, frozen=True, tag="prompt_embeds"):
    hash: bytes


class MultiModalKey(ExtraKey, frozen=True, tag="mm"):
    modality: str
    hash: str
    block_offset: int


class LegacyExtraKey(ExtraKey, frozen=True, tag="legacy"):
    value: Any


ExtraKeyUnion = ExtraKey | LoRAKey | CacheSaltKey | PromptEmbedsKey | MultiModalKey | LegacyExtraKey

ExternalBlockHash = bytes | int


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    event_version: int = 1
    extra_keys: list[tuple[ExtraKeyUnion, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""``ZmqEventPublisher.END_SEQ``: the seq frame of the replay end marker."""


# ------------------------------------------------------------------ legacy (array events)


class _LegacyEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _LegacyKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class _LegacyBlockStored(_LegacyKVCacheEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]  # bytes | int since ExternalBlockHash (before #42892)
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class _LegacyBlockRemoved(_LegacyKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None


class _LegacyAllBlocksCleared(_LegacyKVCacheEvent, tag="AllBlocksCleared"):
    pass


class _LegacyKVEventBatch(_LegacyEventBatch):
    events: list[_LegacyBlockStored | _LegacyBlockRemoved | _LegacyAllBlocksCleared]


legacy = types.SimpleNamespace(
    KVEventBatch=_LegacyKVEventBatch,
    BlockStored=_LegacyBlockStored,
    BlockRemoved=_LegacyBlockRemoved,
    AllBlocksCleared=_LegacyAllBlocksCleared,
)
"""The pre-#42892 structs (their class names are the wire tags)."""
