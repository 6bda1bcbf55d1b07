"""Greedy generation over the cache: the serving loop of one request.

:meth:`CachedLM.generate` is what a serving loop does per request::

    p = await cache.prefetch(prompt)        # storage -> host (only with an L3 tier)
    m = cache.match_prefix(prompt)          # device / host hit lengths; pins the prefix
    await cache.load_back(m)                # host part -> device
    slots = await cache.alloc_wait(n)       # rows for the uncached suffix and the reply
    ... prefill the suffix, decode token by token (K/V written to the pool by PagedKV) ...
    r = cache.insert(prompt + reply, rows)  # the new pages join the tree (write-through)
    cache.release(r); cache.release(m)

:func:`reference_generate` runs the same greedy loop on ``transformers``' own
``DynamicCache`` without any prefix cache: the baseline for TTFT and for the identity check.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from aiocache_kv.cache import HiCache
from aiocache_kv.errors import CacheClosedError, ConfigError, InvalidInputError
from aiocache_kv.handles import MatchResult
from aiocache_kv.logs import get_logger
from aiocache_kv.models.arch import check_layout, check_request, is_hybrid, max_positions
from aiocache_kv.models.compat import cache_kwargs
from aiocache_kv.models.paged import PagedKV
from aiocache_kv.telemetry import PromptAttribution, PromptCounters, attribute

log = get_logger(__name__)

T = TypeVar("T")

#: Runs a forward pass: ``await run(fn)`` returns ``fn()``.  Default: inline on the loop.
#: Cancelling the await may leave ``fn`` running on the runner's thread: the request's rows
#: stay reserved until it returns (``CachedLM`` tracks that; the runner need not).
Runner = Callable[[Callable[[], Any]], Awaitable[Any]]


async def run_inline(fn: Callable[[], T]) -> T:
    """Run a forward pass on the loop thread (CPU work; other tasks wait for it)."""
    return fn()


@dataclass
class Generation:
    """One greedy generation and where its prompt's KV came from."""

    prompt_len: int
    tokens: list[int]  #: generated token ids
    ttft: float  #: seconds from the request to the first generated token
    total: float  #: seconds for the whole request
    #: prompt tokens whose KV was on device at match time (the match, not what was reused:
    #: see :attr:`attribution`)
    hit_device: int = 0
    hit_host: int = 0  #: ... on host (loaded back)
    hit_storage: int = 0  #: ... in storage (prefetched to host, then loaded back)
    reused: int = 0  #: prompt tokens not recomputed (<= the hits: the last one is always run)
    computed: int = 0  #: prompt tokens run through the model in the prefill
    prefetch_s: float = 0.0  #: awaiting ``prefetch`` (storage -> host)
    load_back_s: float = 0.0  #: awaiting ``load_back`` (host -> device)
    backup_s: float = 0.0  #: awaiting the write-through ack after ``insert`` (device -> host)
    logits: torch.Tensor | None = field(default=None, repr=False)  #: [tokens, vocab] if kept

    @property
    def hit_tokens(self) -> int:
        """Prompt tokens found in any tier."""
        return self.hit_device + self.hit_host + self.hit_storage

    @property
    def attribution(self) -> PromptAttribution:
        """Where the prompt's KV came from, counting only the ``reused`` tokens as cached
        (a fully cached prompt still recomputes its last page): ``cached + computed`` is the
        prompt, which is what a server reports as ``cached_tokens`` per request."""
        return attribute(
            self.prompt_len,
            self.reused,
            device=self.hit_device,
            host=self.hit_host,
            storage=self.hit_storage,
        )


def _argmax(logits: torch.Tensor) -> int:
    return int(torch.argmax(logits).item())


class _Lease(enum.Enum):
    PENDING = "pending"  #: handed to the runner, not started
    RUNNING = "running"  #: the model thread is writing/reading the request's rows
    DONE = "done"
    ABANDONED = "abandoned"  #: the request left before the pass started: it never runs


class _RowLease:
    """Whether a forward pass may still touch a request's device rows.

    The buffer-lease rule (docs/ARCHITECTURE.md) for rows handed to a model thread: a request
    that is cancelled while its pass runs must not free its rows (another request could be
    given them and the abandoned pass would overwrite its KV), so its clean-up waits for
    :attr:`idle`.  A pass that had not started yet is abandoned: it will not run.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()  # held for a few bytecodes by either side
        self._state = _Lease.DONE
        self.idle: asyncio.Future[None] = loop.create_future()
        self.idle.set_result(None)

    def wrap(self, fn: Callable[[], torch.Tensor]) -> Callable[[], tuple[torch.Tensor, int]]:
        """The pass to hand to the runner; also computes the greedy token off the loop."""
        loop = self._loop
        idle = self.idle = loop.create_future()
        self._state = _Lease.PENDING

        def settle() -> None:
            if not idle.done():
                idle.set_result(None)

        def call() -> tuple[torch.Tensor, int]:
            with self._lock:
                if self._state is _Lease.ABANDONED:
                    raise asyncio.CancelledError("request left before its forward pass")
                self._state = _Lease.RUNNING
            try:
                logits = fn()
                return logits, _argmax(logits)  # .item() syncs: never on the loop
            finally:
                with self._lock:
                    self._state = _Lease.DONE
                with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits
                    loop.call_soon_threadsafe(settle)

        return call

    def abandon(self) -> bool:
        """The request is leaving: ``True`` if a pass still runs (wait for :attr:`idle`)."""
        with self._lock:
            if self._state is _Lease.PENDING:
                self._state = _Lease.ABANDONED
                self.idle.set_result(None)
            return self._state is _Lease.RUNNING


def reference_generate(
    model: Any, prompt: Sequence[int], max_new_tokens: int, *, keep_logits: bool = False
) -> Generation:
    """Greedy generation with ``transformers``' own ``DynamicCache`` (sliding layers keep
    their window) and no prefix cache: the baseline of every identity check.

    Raises:
        InvalidTypeError: the prompt is not a sequence of ints.
        InvalidInputError: empty prompt, a token id outside the model's vocabulary, bad
            ``max_new_tokens``, or too long for the model (see
            :func:`~aiocache_kv.models.arch.check_request`).
        ConfigError: the model's config gives no vocabulary size or positions.
    """
    from transformers import DynamicCache

    toks = check_request(model, prompt, max_new_tokens)
    t0 = time.perf_counter()
    kv = DynamicCache(config=model.config)
    out: list[int] = []
    kept: list[torch.Tensor] = []
    ttft = 0.0
    device = getattr(model, "device", None)  # the model's own (a GPU's, say)
    with torch.no_grad():
        ids = torch.tensor([toks], dtype=torch.long, device=device)
        for step in range(max_new_tokens):
            res = model(input_ids=ids, use_cache=True, logits_to_keep=1, **cache_kwargs(model, kv))
            logits = res.logits[0, -1]
            tok = _argmax(logits)
            if step == 0:
                ttft = time.perf_counter() - t0
            out.append(tok)
            if keep_logits:
                kept.append(logits.clone())
            ids = torch.tensor([[tok]], dtype=torch.long, device=device)
    return Generation(
        prompt_len=len(toks),
        tokens=out,
        ttft=ttft,
        total=time.perf_counter() - t0,
        computed=len(toks),
        logits=torch.stack(kept) if keep_logits else None,
    )


class CachedLM:
    """A model whose attention KV lives in ``cache``'s device pool.

    Call :meth:`generate` on the loop thread that runs ``cache``.  Forward passes run through
    ``runner`` (default: inline on the loop; pass one that uses a single worker thread to keep
    the loop responsive in a server).  :attr:`prompt_tokens` sums every finished request's
    :attr:`Generation.attribution` (export it with ``aiocache_kv.metrics.CacheCollector``).

    Raises:
        ConfigError: an unsupported model (:data:`~aiocache_kv.models.arch.SUPPORTED_MODEL_TYPES`)
            or a hybrid one (serve it with ``HybridLM``), the cache's KV shape does not match
            the model, or ``yield_every`` is not an int (values below 1 mean 1).
    """

    def __init__(
        self,
        model: Any,
        cache: HiCache,
        *,
        runner: Runner | None = None,
        tenant: str | None = None,
        await_backup: bool = True,
        yield_every: int = 1,
    ) -> None:
        self._check_model(model, cache)
        if isinstance(yield_every, bool) or not isinstance(yield_every, int):
            raise ConfigError(f"yield_every must be an int, got {yield_every!r}")
        self.model = model
        self.cache = cache
        self.runner: Runner = runner if runner is not None else run_inline
        self.tenant = tenant
        self.await_backup = await_backup
        self.yield_every = max(1, yield_every)
        self.max_positions = max_positions(model)
        #: prompt tokens of the finished requests by source (device/host/storage/computed)
        self.prompt_tokens = PromptCounters()

    def _check_model(self, model: Any, cache: HiCache) -> None:
        """Raise ``ConfigError`` unless ``cache`` is laid out for ``model``."""
        if is_hybrid(model):
            raise ConfigError(
                f"{type(model).__name__} has sliding-window layers kept in a sidecar: serve "
                "it with aiocache_kv.models.HybridLM over hybrid_cache_config(model)"
            )
        check_layout(model, cache.config)

    async def generate(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        *,
        keep_logits: bool = False,
        prefetched_tokens: int = 0,
    ) -> Generation:
        """Greedy-generate ``max_new_tokens`` after ``prompt``, reusing and filling the cache.

        The prompt and the reply (all but the last token, whose KV is never computed) are
        inserted into the cache when the request ends, so the next turn of a conversation
        hits them.  With a storage tier the prompt is prefetched first (storage -> host).
        ``prefetched_tokens``: tokens of this prompt that an earlier prefetch made for this
        same request already committed to host (a server that prefetches on arrival and
        generates on admission); they are attributed to storage, not host.

        Everything about the request is checked before the cache is touched: a bad request
        leaves the cache as it was.

        Raises:
            InvalidTypeError: the prompt is not a sequence of ints.
            InvalidInputError: empty prompt, a token id outside the model's vocabulary (the
                message names it and the vocabulary size), bad ``max_new_tokens`` or
                ``prefetched_tokens``, or prompt + ``max_new_tokens`` past the model's
                positions.
            CapacityError: the device pool cannot hold the request (nothing leaks).
        """
        toks = check_request(self.model, prompt, max_new_tokens)
        if type(prefetched_tokens) is not int or not 0 <= prefetched_tokens <= len(toks):
            raise InvalidInputError(
                f"prefetched_tokens must be an int in [0, {len(toks)}], got {prefetched_tokens!r}"
            )
        cache = self.cache
        p = cache.config.page_size
        t0 = time.perf_counter()
        # the reusable part: whole pages, never the last prompt token (its logits give the
        # first reply token)
        reusable = (len(toks) - 1) // p * p
        wanted = self._match_tokens(toks, reusable)
        hit_storage = prefetched_tokens
        prefetch_s = load_back_s = backup_s = 0.0
        if cache.config.storage is not None:
            res = await cache.prefetch(wanted, tenant=self.tenant)
            hit_storage += res.hit_tokens
            prefetch_s = time.perf_counter() - t0
        m: MatchResult | None = cache.match_prefix(wanted, tenant=self.tenant)
        assert m is not None
        try:
            hit_device = m.device_len
            hit_storage = min(hit_storage, m.host_len)
            hit_host = m.host_len - hit_storage
            if m.host_len:
                t1 = time.perf_counter()
                await cache.load_back(m)
                load_back_s = time.perf_counter() - t1
            reused = min(m.device_len, reusable)
            prefix_rows = m.device_indices[:reused]
            n_kv = len(toks) + max_new_tokens - 1  # positions whose K/V get written
            own = await cache.alloc_wait(n_kv - reused)
            lease = _RowLease(asyncio.get_running_loop())
            try:
                gen = await self._run(
                    lease, toks, prefix_rows, own, max_new_tokens, t0, keep_logits
                )
                kv_toks = toks + gen.tokens[:-1]
                rows = torch.cat([prefix_rows, own])[: len(kv_toks)]
            except BaseException:
                if lease.abandon():  # the model thread still uses the rows: free them later
                    self._release_after(lease, own, m)
                    m = None
                else:
                    cache.free(own)
                raise
            r = cache.insert(kv_toks, rows, tenant=self.tenant)
            aligned = len(kv_toks) // p * p
            if aligned - reused < own.numel():  # slots past the last whole page stay ours
                cache.free(own[aligned - reused :])
            try:
                if self.await_backup and r.write_through is not None:
                    t1 = time.perf_counter()
                    await r.write_through
                    backup_s = time.perf_counter() - t1
            finally:
                cache.release(r)
        finally:
            if m is not None:
                cache.release(m)
        gen.total = time.perf_counter() - t0
        gen.hit_device, gen.hit_host, gen.hit_storage = hit_device, hit_host, hit_storage
        gen.reused = reused
        gen.prefetch_s, gen.load_back_s, gen.backup_s = prefetch_s, load_back_s, backup_s
        self.prompt_tokens.record(gen.attribution)
        log.debug(
            "generated",
            prompt=len(toks),
            device=hit_device,
            host=hit_host,
            storage=hit_storage,
            computed=gen.computed,
            ttft_ms=round(gen.ttft * 1e3, 2),
        )
        return gen

    def _release_after(self, lease: _RowLease, own: torch.Tensor, m: MatchResult) -> None:
        """Free a cancelled request's rows and its match once its forward pass is done."""
        cache = self.cache

        def release(_: object) -> None:
            try:
                cache.free(own)
                cache.release(m)
            except CacheClosedError:
                return  # the cache closed meanwhile: its pools are gone with it

        lease.idle.add_done_callback(release)

    def _match_tokens(self, toks: list[int], reusable: int) -> list[int]:
        """What to match and prefetch: the whole prompt (hits are reported in full; only the
        reusable part is used)."""
        del reusable
        return toks

    def _sequence(self, rows: torch.Tensor, filled: int) -> Any:
        """The model-side view of one request's KV rows (the first ``filled`` are cached)."""
        cache = self.cache
        views = [cache.device_kv(layer) for layer in range(cache.config.num_layers)]
        return PagedKV(views, rows, filled=filled)

    async def _run(
        self,
        lease: _RowLease,
        toks: list[int],
        prefix_rows: torch.Tensor,
        own: torch.Tensor,
        max_new_tokens: int,
        t0: float,
        keep_logits: bool,
    ) -> Generation:
        reused = prefix_rows.numel()
        seq = self._sequence(torch.cat([prefix_rows, own]), reused)
        model = self.model
        suffix = toks[reused:]
        logits, tok = await self.runner(lease.wrap(lambda: seq.forward(model, suffix)))
        ttft = time.perf_counter() - t0
        out = [tok]
        kept = [logits.clone()] if keep_logits else []
        for step in range(1, max_new_tokens):
            if step % self.yield_every == 0:
                await asyncio.sleep(0)  # let other requests on the loop make progress
            last = [tok]
            logits, tok = await self.runner(
                lease.wrap(lambda: seq.forward(model, last))  # noqa: B023
            )
            out.append(tok)
            if keep_logits:
                kept.append(logits.clone())
        return Generation(
            prompt_len=len(toks),
            tokens=out,
            ttft=ttft,
            total=0.0,
            computed=len(suffix),
            logits=torch.stack(kept) if keep_logits else None,
        )


__all__ = ["CachedLM", "Generation", "Runner", "reference_generate", "run_inline"]
