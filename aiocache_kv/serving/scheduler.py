"""What each step runs: a token budget shared by decodes and chunked prefills (vLLM v1's shape).

Pure functions over the engine's requests; nothing here touches the cache or the model.

* :func:`plan_step`: every running request gets tokens while the step's budget lasts, in
  admission order, decodes (one token each) first so inter-token latency does not wait behind
  a long prompt, then prefill chunks (as many prompt tokens as the budget leaves).  There are
  no separate prefill and decode phases: one forward pass runs both.
* :func:`prefix_in_flight`: how much of a waiting request's prompt another running request
  is computing right now.  The engine admits such a request once those pages are in the tree,
  instead of computing them a second time (eight first turns sharing a system prompt compute
  it once).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from aiocache_kv.serving.request import Request
from aiocache_kv.tree.keycmp import common_len

__all__ = ["Slot", "plan_step", "prefix_in_flight"]


@dataclasses.dataclass(frozen=True)
class Slot:
    """A request's share of one step: ``tokens`` new positions from ``request.filled``."""

    request: Request
    tokens: int

    @property
    def produces(self) -> bool:
        """Whether the step ends at the request's last position (its logits give a token)."""
        return self.request.filled + self.tokens == self.request.length


def plan_step(running: Sequence[Request], budget: int) -> list[Slot]:
    """The step for ``running`` (in admission order) within ``budget`` tokens.

    Decodes first (a request whose prompt is written needs one token), then prefill chunks,
    each as long as the rest of its prompt or the budget left.  A request with nothing to run
    is skipped.
    """
    slots: list[Slot] = []
    left = budget
    for r in running:
        if left <= 0:
            break
        if not r.prefilling and r.filled < r.length:
            slots.append(Slot(r, 1))
            left -= 1
    for r in running:
        if left <= 0:
            break
        if r.prefilling:
            k = min(r.length - r.filled, left)
            slots.append(Slot(r, k))
            left -= k
    return slots


def prefix_in_flight(waiting: Request, others: Iterable[Request], page_size: int) -> int:
    """Prompt tokens of ``waiting`` (whole pages, at most what it could reuse) that a request
    in ``others`` shares and is computing, beyond what that one has put in the tree already:
    what admitting ``waiting`` now would compute a second time (of its own namespace: its
    tenant and LoRA).  0 when nothing is gained."""
    p = page_size
    reusable = (waiting.length - 1) // p * p
    if reusable < p:
        return 0
    best = 0
    seq = waiting.seq
    ns = (waiting.tenant or "", waiting.lora or "")  # (None is the default: the cache's rule)
    for r in others:
        if not r.prefilling or r.inserted >= reusable:
            continue
        if (r.tenant or "", r.lora or "") != ns:  # another namespace's pages: never shared
            continue
        shared = common_len(r.prompt, seq, 0, reusable) // p * p
        if shared > r.inserted and shared > best:
            best = shared
    return best
