"""One request's life in the engine: its state, its rows, its result.

A :class:`Request` belongs to the engine's loop (rule 1): only the step loop and the
admission tasks, on the loop thread, change it.  The model thread sees only the
:class:`~aiocache_kv.models.batched.SeqChunk` values a step hands it.

Rows.  While a request is admitted, ``rows`` are the device-pool rows of its sequence, in
order, a whole number of pages: first the cached prefix the match gave (pinned by ``handle``),
then pages the engine allocated for it.  ``filled`` rows hold the K/V of ``seq[:filled]``;
``inserted`` (page aligned) of them are in the tree, pinned by ``handle`` (the latest insert's
result), so they stay resident while the request attends over them.  Rows from ``inserted``
on are the request's own (HELD): freed when it finishes, is preempted or aborts.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import time
from typing import TYPE_CHECKING

import torch

from aiocache_kv.telemetry import PromptAttribution

if TYPE_CHECKING:
    import asyncio

    from anyio.streams.memory import MemoryObjectSendStream

    from aiocache_kv.handles import InsertResult, MatchResult

__all__ = ["GenerationResult", "Request", "RequestState"]


class RequestState(enum.Enum):
    """Where a request is.  Transitions: WAITING -> ADMITTING -> RUNNING -> FINISHED; RUNNING
    -> WAITING (preempted: its pages stay cached, it resumes by matching them again; or
    restarted: a prefix it extended left the cache, it recomputes what is gone); any ->
    ABORTED (its caller went away) or FAILED (an error it alone hit)."""

    WAITING = "waiting"  #: queued; holds no pins and no rows
    ADMITTING = "admitting"  #: prefetch, match, load-back and its prompt's rows in flight
    RUNNING = "running"  #: in the batch: every step gives it tokens while the budget lasts
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"


ENDED = (RequestState.FINISHED, RequestState.ABORTED, RequestState.FAILED)


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """A finished request: its tokens, its timings and where its prompt's KV came from."""

    tokens: list[int]  #: the generated token ids (greedy)
    prompt_len: int
    queue_time: float  #: seconds from arrival to joining the batch (first admission)
    ttft: float  #: seconds from arrival to the first generated token
    itl: list[float]  #: seconds between consecutive generated tokens
    total: float  #: seconds from arrival to the last token
    #: the prompt's tokens by source at first admission (``cached + computed == prompt``)
    attribution: PromptAttribution
    preemptions: int  #: times the request left the batch for room and came back
    #: prompt tokens this request waited for another running request to compute, then reused
    shared_in_flight: int
    #: ``[tokens, vocab]`` logits of each generated token (``generate(keep_logits=True)``)
    logits: torch.Tensor | None = None
    #: times the request was re-admitted because a prefix it extended left the cache
    restarts: int = 0

    @property
    def per_token(self) -> float:
        """Mean seconds between generated tokens (0.0 for a single token)."""
        return sum(self.itl) / len(self.itl) if self.itl else 0.0


class Request:
    """A generation request inside the engine (see the module doc)."""

    __slots__ = (
        "admission",
        "admitted_at",
        "arrival",
        "attribution",
        "error",
        "filled",
        "future",
        "generated",
        "handle",
        "id",
        "inserted",
        "keep_logits",
        "logits",
        "lora",
        "max_new_tokens",
        "preemptions",
        "prefetch",
        "priority",
        "prompt",
        "reading",
        "restarts",
        "retention",
        "reusable_at_admission",
        "rows",
        "sends",
        "shared_in_flight",
        "skip_storage",
        "state",
        "tenant",
        "token_times",
        "waited_for",
        "waited_from",
    )

    def __init__(
        self,
        rid: int,
        prompt: list[int],
        max_new_tokens: int,
        tenant: str | None,
        lora: str | None,
        future: asyncio.Future[GenerationResult],
        sends: MemoryObjectSendStream[int] | None,
    ) -> None:
        self.id = rid
        self.prompt = prompt
        self.max_new_tokens = max_new_tokens
        self.tenant = tenant
        self.lora = lora
        #: retention priority of every insert of its pages (``HiCache.insert``), checked
        self.priority: int | None = None
        self.retention: float | None = None
        self.future = future
        self.sends = sends  #: the caller's token stream (``Engine.stream``), if any
        self.arrival = time.perf_counter()
        self.admitted_at: float | None = None
        #: its admission task while it enters the batch, and the storage read it started on
        #: arrival while that runs (both cancelled if it ends meanwhile)
        self.admission: asyncio.Task[None] | None = None
        self.reading: asyncio.Task[None] | None = None
        self.state = RequestState.WAITING
        self.generated: list[int] = []
        self.token_times: list[float] = []
        self.handle: MatchResult | InsertResult | None = None
        self.rows = torch.empty(0, dtype=torch.int64)
        self.filled = 0
        self.inserted = 0
        self.reusable_at_admission = 0
        self.attribution: PromptAttribution | None = None
        self.preemptions = 0
        self.restarts = 0
        self.shared_in_flight = 0
        #: tokens of another request's prefix this one waits to reuse (0: not waiting)
        self.waited_for = 0
        #: tokens of that prefix the tree already held when the wait began
        self.waited_from = 0
        #: prompt tokens a prefetch on arrival committed to host (attributed to storage)
        self.prefetch = 0
        #: its storage read was cancelled for a running request short of rows (the store
        #: was slower than ``Engine(storage_wait=)``): it is admitted without one
        self.skip_storage = False
        self.error: BaseException | None = None
        self.keep_logits = False
        self.logits: list[torch.Tensor] = []

    @property
    def seq(self) -> list[int]:
        """The tokens whose K/V the request computes: the prompt, then its reply so far."""
        return self.prompt + self.generated

    def tokens(self, start: int, end: int) -> list[int]:
        """``seq[start:end]`` without building ``seq`` (a decode step reads one token)."""
        n = len(self.prompt)
        if start >= n:
            return self.generated[start - n : end - n]
        if end <= n:
            return self.prompt[start:end]
        return self.prompt[start:] + self.generated[: end - n]

    @property
    def length(self) -> int:
        """``len(seq)`` without building it."""
        return len(self.prompt) + len(self.generated)

    @property
    def prefilling(self) -> bool:
        """Whether the prompt's K/V is not all written yet."""
        return self.filled < len(self.prompt)

    @property
    def done(self) -> bool:
        """Whether every token asked for was generated."""
        return len(self.generated) >= self.max_new_tokens

    def result(self) -> GenerationResult:
        """The finished request's :class:`GenerationResult`."""
        assert self.attribution is not None, "a finished request was admitted"
        times = self.token_times
        first = times[0] if times else self.arrival
        return GenerationResult(
            tokens=list(self.generated),
            prompt_len=len(self.prompt),
            queue_time=(self.admitted_at or self.arrival) - self.arrival,
            ttft=first - self.arrival,
            itl=[b - a for a, b in itertools.pairwise(times)],
            total=(times[-1] if times else first) - self.arrival,
            attribution=self.attribution,
            preemptions=self.preemptions,
            shared_in_flight=self.shared_in_flight,
            logits=torch.stack(self.logits) if self.keep_logits and self.logits else None,
            restarts=self.restarts,
        )

    def __repr__(self) -> str:
        return (
            f"Request(id={self.id}, {self.state.value}, prompt={len(self.prompt)}, "
            f"generated={len(self.generated)}/{self.max_new_tokens}, filled={self.filled}, "
            f"inserted={self.inserted}, rows={self.rows.numel()})"
        )
