"""A deliberately simple reference model of a ``HiCache``, used by ``test_state_machine.py``.

It knows nothing about trees, tiers or copies.  It only remembers what the test did:

* :class:`KVOracle` - the KV a test writes for a token is a pure function of
  ``(tenant, token prefix up to and including it, layer, K|V)``, so anything read back from the
  device pool can be compared bit for bit with what was written, however the pages travelled
  (write-through, demotion, eviction, load-back) in between.
* :class:`PrefixModel` - the page-aligned token sequences inserted per namespace: a match can
  never be longer than the longest common prefix with one of them.
* :class:`EventLedger` - replays KV events: every block hash belongs to exactly one
  ``(namespace, token prefix)`` (two namespaces never share a hash), hashes chain through
  ``parent_block_hash``, and per medium a block is stored before it is removed and never stored
  twice without a removal in between.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from aiocache_kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

Tenant = str | None
Tokens = tuple[int, ...]

MEDIA = ("GPU", "CPU")


def aligned_common(a: Sequence[int], b: Sequence[int], page_size: int) -> int:
    """Page-aligned length of the common prefix of ``a`` and ``b``."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n - n % page_size


@dataclass
class KVOracle:
    """Deterministic KV rows: exactly representable in float32, distinct per tenant/prefix."""

    num_layers: int
    heads: int
    head_dim: int
    dtype: torch.dtype
    _rows: dict[tuple[Tenant, Tokens], torch.Tensor] = field(default_factory=dict)

    def _row(self, tenant: Tenant, prefix: Tokens) -> torch.Tensor:
        """``[layers, 2, heads, head_dim]`` for the last token of ``prefix``."""
        key = (tenant, prefix)
        row = self._rows.get(key)
        if row is None:
            digest = hashlib.blake2b(repr(key).encode(), digest_size=2).digest()
            base = int.from_bytes(digest, "little") * 256  # < 2**24: exact in float32
            width = self.heads * self.head_dim
            offs = torch.arange(self.num_layers * 2 * width, dtype=torch.float64)
            row = (base + offs).to(self.dtype).view(self.num_layers, 2, self.heads, self.head_dim)
            self._rows[key] = row
        return row

    def expected(self, tenant: Tenant, tokens: Sequence[int], n: int) -> torch.Tensor:
        """``[layers, 2, n, heads, head_dim]``: the KV of ``tokens[:n]``."""
        toks = tuple(tokens)
        if n == 0:
            return torch.empty((self.num_layers, 2, 0, self.heads, self.head_dim), dtype=self.dtype)
        rows = [self._row(tenant, toks[: i + 1]) for i in range(n)]
        return torch.stack(rows, dim=2)


@dataclass
class PrefixModel:
    """Page-aligned sequences inserted per namespace (never forgotten: an upper bound)."""

    page_size: int
    inserted: dict[Tenant, set[Tokens]] = field(default_factory=dict)

    def add(self, tenant: Tenant, tokens: Tokens) -> None:
        """Record an insert of ``tokens`` (already page-aligned)."""
        assert len(tokens) % self.page_size == 0
        if tokens:
            self.inserted.setdefault(tenant, set()).add(tokens)

    def upper_bound(self, tenant: Tenant, tokens: Sequence[int]) -> int:
        """Longest page-aligned prefix of ``tokens`` that was ever inserted in ``tenant``."""
        return max(
            (aligned_common(s, tokens, self.page_size) for s in self.inserted.get(tenant, ())),
            default=0,
        )


class LedgerError(AssertionError):
    """The KV event stream contradicts itself or the model."""


@dataclass
class EventLedger:
    """Replays KV events of one cache; raises :class:`LedgerError` on any inconsistency."""

    page_size: int
    owner: dict[int, tuple[Tenant, Tokens]] = field(default_factory=dict)
    resident: dict[str, set[int]] = field(default_factory=lambda: {m: set() for m in MEDIA})
    cleared: int = 0

    def _register(self, h: int, tenant: Tenant, prefix: Tokens) -> None:
        known = self.owner.get(h)
        if known is None:
            self.owner[h] = (tenant, prefix)
        elif known != (tenant, prefix):
            raise LedgerError(
                f"block hash {h:#x} names {known} and also {(tenant, prefix)}: "
                "namespaces or prefixes share a hash"
            )

    def absorb(
        self, events: Iterable[KVEvent], insert: tuple[Tenant, Tokens] | None = None
    ) -> None:
        """Apply ``events``.  With ``insert=(tenant, tokens)``, every ``BlockStored`` in them
        was emitted by that insert and is attributed to that namespace; other stored blocks
        must already be known (a block is inserted on device before it moves anywhere)."""
        p = self.page_size
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                self.cleared += 1
                for s in self.resident.values():
                    s.clear()
                continue
            if isinstance(ev, BlockRemoved):
                if ev.medium not in self.resident:
                    raise LedgerError(f"unexpected medium in {ev}")
                for h in ev.block_hashes:
                    if h not in self.owner:
                        raise LedgerError(f"removed block {h:#x} was never stored")
                    if h not in self.resident[ev.medium]:
                        raise LedgerError(
                            f"removed block {h:#x} {self.owner[h]} from {ev.medium}, "
                            "where it is not stored"
                        )
                    self.resident[ev.medium].discard(h)
                continue
            assert isinstance(ev, BlockStored), f"unknown event {ev!r}"
            if ev.medium not in self.resident:
                raise LedgerError(f"unexpected medium in {ev}")
            if ev.block_size != p:
                raise LedgerError(f"block_size {ev.block_size} != page size {p}")
            if len(ev.token_ids) != p * len(ev.block_hashes) or not ev.block_hashes:
                raise LedgerError(f"{len(ev.token_ids)} tokens for {len(ev.block_hashes)} blocks")
            if ev.parent_block_hash is None:
                base_tenant: Tenant | object = _ANY
                base: Tokens = ()
            else:
                if ev.parent_block_hash not in self.owner:
                    raise LedgerError(f"parent {ev.parent_block_hash:#x} of {ev} unknown")
                base_tenant, base = self.owner[ev.parent_block_hash]
            if insert is not None and ev.medium == "GPU":
                tenant, tokens = insert
                if base_tenant is not _ANY and base_tenant != tenant:
                    raise LedgerError(
                        f"insert into {tenant!r} chained to a block of {base_tenant!r}"
                    )
                for j, h in enumerate(ev.block_hashes):
                    prefix = base + tuple(ev.token_ids[: (j + 1) * p])
                    if tuple(tokens[: len(prefix)]) != prefix:
                        raise LedgerError(f"insert of {tokens} stored foreign prefix {prefix}")
                    self._register(h, tenant, prefix)
            else:
                for j, h in enumerate(ev.block_hashes):
                    if h not in self.owner:
                        raise LedgerError(f"{ev.medium} stored block {h:#x} never inserted")
                    tenant, prefix = self.owner[h]
                    want = base + tuple(ev.token_ids[: (j + 1) * p])
                    if prefix != want or (base_tenant is not _ANY and base_tenant != tenant):
                        raise LedgerError(
                            f"block {h:#x} is {(tenant, prefix)} but event says {want}"
                        )
            for h in ev.block_hashes:
                if h in self.resident[ev.medium]:
                    raise LedgerError(f"block {h:#x} {self.owner[h]} stored twice on {ev.medium}")
                self.resident[ev.medium].add(h)

    def tenants_of(self, hashes: Iterable[int]) -> set[Tenant]:
        """Namespaces that own ``hashes``."""
        return {self.owner[h][0] for h in hashes}


_ANY = object()

__all__ = ["EventLedger", "KVOracle", "LedgerError", "PrefixModel", "aligned_common"]
