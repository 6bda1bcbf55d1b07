"""The engine's numbers: counters and latency histograms kept on the loop, read as snapshots.

:class:`EngineCounters` is updated by the step loop as things happen (one bisect per latency
observation, :class:`~aiocache_kv.telemetry.LatencyHistogram`); :meth:`Engine.statistics`
turns it into a frozen :class:`EngineStatistics`, and
:class:`~aiocache_kv.serving.metrics.EngineCollector` into Prometheus families at scrape time.
"""

from __future__ import annotations

import dataclasses

from aiocache_kv.serving.request import GenerationResult
from aiocache_kv.telemetry import HistogramSnapshot, LatencyHistogram, PromptCounters

__all__ = ["BATCH_BUCKETS", "EngineCounters", "EngineStatistics"]

#: upper bounds of the batch-size and tokens-per-step histograms
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


@dataclasses.dataclass(frozen=True)
class EngineStatistics:
    """A snapshot of an engine (taken on the loop)."""

    waiting: int  #: requests queued, holding nothing
    admitting: int  #: requests being matched / loaded back / given rows
    running: int  #: requests in the batch
    submitted: int
    finished: int
    aborted: int  #: callers that went away, or the engine closed under them
    failed: int  #: requests that hit an error of their own
    steps: int  #: forward passes
    generated_tokens: int
    step_tokens: int  #: tokens run through the model (prefill chunks and decodes)
    preemptions: int
    #: requests re-admitted because a prefix they extended left the cache (``drop``, or a
    #: page that failed at load-back: ``PrefixDroppedError``)
    restarts: int
    #: storage reads cancelled because a running request short of rows waited for their
    #: pins longer than ``Engine(storage_wait=)`` (their requests are admitted without one)
    storage_reads_cancelled: int
    inserted_pages: int  #: pages put into the tree while their requests ran
    #: prompt tokens requests waited for another running request to compute, then reused
    shared_in_flight_tokens: int
    prompt_tokens: PromptCounters  #: prompts by source: device / host / storage / computed
    step_seconds_total: float  #: time in forward passes
    queue: HistogramSnapshot  #: arrival to joining the batch
    ttft: HistogramSnapshot  #: arrival to the first token
    itl: HistogramSnapshot  #: between consecutive tokens of a request
    step: HistogramSnapshot  #: one forward pass
    batch_size: HistogramSnapshot  #: requests per step
    tokens_per_step: HistogramSnapshot


@dataclasses.dataclass
class EngineCounters:
    """Loop-owned counters of one engine (see :class:`EngineStatistics` for each)."""

    submitted: int = 0
    finished: int = 0
    aborted: int = 0
    failed: int = 0
    steps: int = 0
    generated_tokens: int = 0
    step_tokens: int = 0
    preemptions: int = 0
    restarts: int = 0
    storage_reads_cancelled: int = 0
    inserted_pages: int = 0
    shared_in_flight_tokens: int = 0
    step_seconds_total: float = 0.0
    prompt_tokens: PromptCounters = dataclasses.field(default_factory=PromptCounters)
    queue: LatencyHistogram = dataclasses.field(default_factory=LatencyHistogram)
    ttft: LatencyHistogram = dataclasses.field(default_factory=LatencyHistogram)
    itl: LatencyHistogram = dataclasses.field(default_factory=LatencyHistogram)
    step: LatencyHistogram = dataclasses.field(default_factory=LatencyHistogram)
    batch_size: LatencyHistogram = dataclasses.field(
        default_factory=lambda: LatencyHistogram(BATCH_BUCKETS)
    )
    tokens_per_step: LatencyHistogram = dataclasses.field(
        default_factory=lambda: LatencyHistogram(BATCH_BUCKETS)
    )

    def observe_step(self, requests: int, tokens: int, seconds: float) -> None:
        """One forward pass of ``requests`` sequences and ``tokens`` tokens."""
        self.steps += 1
        self.step_tokens += tokens
        self.step_seconds_total += seconds
        self.step.observe(seconds)
        self.batch_size.observe(requests)
        self.tokens_per_step.observe(tokens)

    def observe_result(self, result: GenerationResult) -> None:
        """A finished request: its queue time, its prompt's sources, what it shared."""
        self.queue.observe(result.queue_time)
        self.prompt_tokens.record(result.attribution)
        self.shared_in_flight_tokens += result.shared_in_flight

    def snapshot(self, *, waiting: int, admitting: int, running: int) -> EngineStatistics:
        """A frozen copy, with the queue lengths given."""
        return EngineStatistics(
            waiting=waiting,
            admitting=admitting,
            running=running,
            submitted=self.submitted,
            finished=self.finished,
            aborted=self.aborted,
            failed=self.failed,
            steps=self.steps,
            generated_tokens=self.generated_tokens,
            step_tokens=self.step_tokens,
            preemptions=self.preemptions,
            restarts=self.restarts,
            storage_reads_cancelled=self.storage_reads_cancelled,
            inserted_pages=self.inserted_pages,
            shared_in_flight_tokens=self.shared_in_flight_tokens,
            prompt_tokens=dataclasses.replace(self.prompt_tokens),
            step_seconds_total=self.step_seconds_total,
            queue=self.queue.snapshot(),
            ttft=self.ttft.snapshot(),
            itl=self.itl.snapshot(),
            step=self.step.snapshot(),
            batch_size=self.batch_size.snapshot(),
            tokens_per_step=self.tokens_per_step.snapshot(),
        )
