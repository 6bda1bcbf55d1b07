"""The model thread: one forward pass at a time, off the event loop.

:class:`ModelRunner` runs each step's :meth:`~aiocache_kv.models.batched.PagedBatch.forward`
on one worker thread (``anyio.to_thread.run_sync`` with a limiter of one) and picks each
sequence's next token there, so the loop never waits on the model and never syncs a device
tensor (the argmax and its ``tolist`` run on the model thread).  The model thread's torch
intra-op threads leave a core to the loop: with every core in the forward pass, the loop
thread waits for the OS to schedule it (measured on 2 cores: event-loop lag p99 3.0-3.7 ms
with two intra-op threads, 1.1 ms with one, and the forward passes no slower).

A step cannot be abandoned: ``run_sync`` does not return before the thread does, so the rows
a step writes stay the step's until it returns (rule 2), however the engine is cancelled or
closed.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import anyio.to_thread
import torch

from aiocache_kv.errors import ConfigError
from aiocache_kv.models.batched import PagedBatch, SeqChunk
from aiocache_kv.numeric import MAX_THREADS, check_int

__all__ = ["ModelRunner", "Picked"]

#: per chunk of a step: its next token and kept logits, each ``None`` where not asked for
Picked = list[tuple[int | None, torch.Tensor | None]]


class ModelRunner:
    """Runs ``batch``'s steps on one model thread, with ``threads`` torch intra-op threads
    there (OpenMP keeps the setting per thread: the loop's thread is untouched).

    Raises:
        ConfigError: ``threads`` is not an int in ``[1, MAX_THREADS]`` (1024): checked here,
            or every step would fail in ``torch.set_num_threads``.
    """

    def __init__(self, batch: PagedBatch, threads: int) -> None:
        self.batch = batch
        self.threads = check_int(
            "model_threads", threads, minimum=1, maximum=MAX_THREADS, error=ConfigError
        )
        self._limiter = anyio.CapacityLimiter(1)

    def _step(self, chunks: list[SeqChunk], produce: list[bool], keep: list[bool]) -> Picked:
        if torch.get_num_threads() != self.threads:  # a worker thread new to this runner
            torch.set_num_threads(self.threads)
        with torch.no_grad():
            logits = self.batch.forward(chunks)
            if not any(produce):
                return [(None, None)] * len(chunks)
            picked = logits.argmax(dim=-1).tolist()  # on the model thread: a sync is fine here
            kept = logits.float().cpu() if any(keep) else None
        return [
            (tok if want else None, kept[i].clone() if kept is not None and k and want else None)
            for i, (tok, want, k) in enumerate(zip(picked, produce, keep, strict=True))
        ]

    async def step(
        self, chunks: Sequence[SeqChunk], produce: Sequence[bool], keep: Sequence[bool]
    ) -> Picked:
        """One forward pass over ``chunks``; per chunk whose ``produce`` is set (its chunk
        ends at its sequence's last position) the greedy next token, and its logits (on the
        CPU) where ``keep`` is set too; ``(None, None)`` for the others.

        Raises:
            What the forward pass raises (the engine fails the step's requests with it).
        """
        return await anyio.to_thread.run_sync(
            self._step, list(chunks), list(produce), list(keep), limiter=self._limiter
        )
