"""KV events in vLLM's schema (``vllm/distributed/kv_events.py``).

``medium`` names the tier: ``GPU`` for the device pool (even when it lives on the CPU), ``CPU``
for the host pool, ``STORAGE`` for L3.  One :class:`BlockStored` per stored run of pages,
``block_hashes`` one per page, ``parent_block_hash`` the hash of the page before the run.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A run of pages became resident in ``medium``."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str
    lora_id: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Pages left ``medium``."""

    block_hashes: list[int]
    medium: str


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every block of every medium was dropped."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
