"""Benchmarks behind ``aiocache-kv bench``: the radix tree, the device<->host copy path, the
storage tier (L3) against its raw backend, the embedding cache, end-to-end TTFT, the batched
serving engine and multi-turn serving per cache tier.

Each suite module has an options dataclass and a ``run(options) -> dict`` that prints its
tables and returns JSON-able results; :mod:`aiocache_kv.bench.report` holds the shared
printing and JSON helpers.
"""

from __future__ import annotations

#: every suite, in the order ``aiocache-kv bench`` (``all``) runs them, with one line of help
SUITE_HELP = {
    "tree": "radix tree insert/match/evict against targets",
    "transfer": "device<->host page copies and event-loop lag",
    "cuda": "copy jobs on a GPU (staged host slots, device checksums) vs the raw pinned copy; "
    "skipped without CUDA",
    "lag": "event-loop lag while 1 GiB is written through and the engine serves a full batch",
    "storage": "storage tier (L3) through the cache vs the raw backend (file, mooncake)",
    "embedding": "embedding cache vs the raw Mooncake client, two nodes",
    "e2e": "time to first token vs cached prefix length, per tier (GPT-2)",
    "engine": "batched serving engine vs one request at a time vs transformers' continuous "
    "batching, multi-turn chat (GPT-2, Llama)",
    "serve": "multi-turn clients (SGLang bench_multiturn shape): no prefix cache vs device vs "
    "device+host vs +storage vs restart from storage vs transformers CB, hit rate per tier "
    "and round; or any OpenAI-compatible server (--url)",
    "fairness": "per-tenant quotas: one tenant's hit rate alone, under another's flood, and "
    "with the flooding tenant under a quota",
}
SUITES = tuple(SUITE_HELP)
#: ``bench engine``'s models and sides (here, so the CLI need not import the suite)
ENGINE_MODELS = ("gpt2", "llama")
ENGINE_SIDES = ("engine", "sequential", "transformers")
#: ``bench serve``'s arms (the keys of :data:`aiocache_kv.bench.serve_arms.ARMS`, in order)
SERVE_ARMS = (
    "no-cache",
    "device",
    "device+host",
    "device+host+storage",
    "storage-restart",
    "transformers",
)

__all__ = ["ENGINE_MODELS", "ENGINE_SIDES", "SERVE_ARMS", "SUITES", "SUITE_HELP"]
