"""Every numeric option and argument is a real, finite number in range (``bool`` is not one).

A NaN deadline breaks the event loop's timer heap: every comparison with it is false, so a
timer due now can sit below one due in seconds.  ``CacheConfig(prefetch_timeout_max=nan)`` was
accepted and an unrelated ``asyncio.sleep(0.01)`` then took 10 s.  Bad numbers now raise a
typed error naming the value, at construction (``ConfigError``) or at the call
(``InvalidInputError``), and change nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import aiocache_kv as akv
from aiocache_kv.embedding import EmbeddingCache
from aiocache_kv.errors import ConfigError, InvalidInputError
from aiocache_kv.storage import FileStorage, MooncakeStorage, StorageIO
from aiocache_kv.testing import MemoryStorage
from tests.conftest import small_config

NAN, INF = float("nan"), float("inf")
MAX_SECONDS = threading.TIMEOUT_MAX  #: the longest wait every timer accepts
NON_FINITE = [NAN, INF, -INF]
#: never valid for any option or argument here: not finite, negative, or not a number
BAD = [*NON_FINITE, -1, -1.5, True, "1"]

#: the numeric fields of CacheConfig (checked against the dataclass below)
INT_FIELDS = [
    "page_size",
    "num_layers",
    "num_kv_heads",
    "head_dim",
    "device_pages",
    "host_pages",
    "write_through_threshold",
    "host_memory_reserve_bytes",
    "copy_threads",
    "worker_nice",
    "storage_workers",
    "prefetch_threshold_tokens",
    "prefetch_batch_pages",
]
SECONDS_FIELDS = [
    "storage_timeout",
    "storage_retry_seconds",
    "storage_open_timeout",
    "prefetch_timeout_base",
    "prefetch_timeout_per_1k",
    "prefetch_timeout_max",
    "max_pin_ttl",
]
#: fractions of a pool: finite, in (0, 1]
FRACTION_FIELDS = ["max_pinned_fraction"]


def named(exc: pytest.ExceptionInfo[BaseException], *names: str, value: object) -> None:
    """The message names the option and shows the offending value."""
    msg = str(exc.value)
    for name in names:
        assert name in msg, msg
    assert repr(value) in msg, msg


def test_every_numeric_config_field_is_listed() -> None:
    numeric = {
        f.name
        for f in dataclasses.fields(akv.CacheConfig)
        if "int" in str(f.type) or "float" in str(f.type)
    }
    assert numeric == set(INT_FIELDS) | set(SECONDS_FIELDS) | set(FRACTION_FIELDS)


@pytest.mark.parametrize("value", [*BAD, 0, 0.0, 1.5, 2], ids=repr)
@pytest.mark.parametrize("name", FRACTION_FIELDS)
def test_config_fractions_in_unit_interval(name: str, value: object) -> None:
    with pytest.raises(ConfigError) as exc:
        small_config(**{name: value})
    named(exc, name, value=value)
    assert getattr(small_config(**{name: 1.0}), name) == 1.0
    assert getattr(small_config(**{name: 0.25}), name) == 0.25


@pytest.mark.parametrize("value", BAD, ids=repr)
@pytest.mark.parametrize("name", INT_FIELDS + SECONDS_FIELDS)
def test_config_rejects_non_finite_negative_and_non_numbers(name: str, value: object) -> None:
    with pytest.raises(ConfigError) as exc:
        small_config(**{name: value})
    named(exc, name, value=value)


@pytest.mark.parametrize("value", [1.5, 2.0], ids=repr)
@pytest.mark.parametrize("name", INT_FIELDS)
def test_config_counts_are_ints(name: str, value: float) -> None:
    with pytest.raises(ConfigError) as exc:
        small_config(**{name: value})
    named(exc, name, value=value)


@pytest.mark.parametrize("name", SECONDS_FIELDS)
def test_config_seconds_bounds(name: str) -> None:
    with pytest.raises(ConfigError) as exc:
        small_config(**{name: MAX_SECONDS * 2})  # finite, but no timer accepts it
    named(exc, name, value=MAX_SECONDS * 2)
    assert getattr(small_config(**{name: 0.25}), name) == 0.25
    assert getattr(small_config(**{name: 3}), name) == 3  # an int is a number
    if name in ("storage_timeout", "storage_open_timeout", "max_pin_ttl"):  # 0: useless
        with pytest.raises(ConfigError, match=name):
            small_config(**{name: 0})
    else:
        assert getattr(small_config(**{name: 0}), name) == 0


def test_replace_revalidates() -> None:
    cfg = small_config()
    with pytest.raises(ConfigError, match="prefetch_timeout_max"):
        dataclasses.replace(cfg, prefetch_timeout_max=NAN)


async def lateness(delay: float = 0.01) -> float:
    """How much later than asked an ``asyncio.sleep(delay)`` ends."""
    t0 = time.monotonic()
    await asyncio.sleep(delay)
    return time.monotonic() - t0 - delay


def test_a_nan_prefetch_deadline_is_refused_at_construction() -> None:
    for name in ("prefetch_timeout_max", "prefetch_timeout_base", "storage_timeout"):
        with pytest.raises(ConfigError) as exc:
            small_config(storage=MemoryStorage(), **{name: NAN})
        named(exc, name, value=NAN)


async def test_a_nan_deadline_never_reaches_the_loop_timer_heap() -> None:
    """The executor every storage call goes through refuses a NaN (or infinite) deadline, so
    an unrelated sleep keeps its time (before: a NaN timer among later ones delayed the sleep
    until theirs, 5 s here)."""
    loop = asyncio.get_running_loop()
    later = [loop.call_later(5.0, lambda: None) for _ in range(4)]  # other deadlines pending
    io = StorageIO(MemoryStorage(), workers=1)
    errors: list[InvalidInputError] = []
    try:
        await io.open()
        submitted = io.io_statistics().submitted
        for bad in NON_FINITE:
            try:
                await io.exists(["k"], timeout=bad)
            except InvalidInputError as exc:
                errors.append(exc)
        later += [loop.call_later(5.0, lambda: None) for _ in range(4)]
        late = await lateness()
        assert late < 1.0, f"a 10 ms sleep ended {late:.2f} s late, behind later timers"
        assert [str(e) for e in errors] == [
            f"timeout must be a finite number, got {bad!r}" for bad in NON_FINITE
        ]
        assert io.io_statistics().submitted == submitted  # none was handed to a worker
        assert await io.exists(["k"], timeout=1.0) == [False]  # the executor still works
    finally:
        for h in later:
            h.cancel()
        await io.aclose(timeout=5.0)


async def test_a_cache_with_extreme_valid_deadlines_keeps_the_loop_on_time() -> None:
    """Zero-length prefetch deadlines (the smallest valid) on a slow store: prefetches end
    PARTIAL or MISS at once, and the loop's timers stay in order."""
    store = MemoryStorage(max_delay=0.02)
    cfg = small_config(
        storage=store,
        prefetch_threshold_tokens=0,
        prefetch_timeout_base=0,
        prefetch_timeout_per_1k=0,
        prefetch_timeout_max=0,
        storage_retry_seconds=0,
    )
    async with akv.HiCache(cfg) as cache:
        loop = asyncio.get_running_loop()
        later = [loop.call_later(5.0, lambda: None) for _ in range(4)]
        try:
            results = await asyncio.gather(
                *(cache.prefetch(list(range(k, k + 16))) for k in range(0, 160, 16)),
                lateness(),
            )
            assert results[-1] < 1.0
            assert all(r.hit_tokens == 0 for r in results[:-1])
        finally:
            for h in later:
                h.cancel()


# ---------------------------------------------------------------- HiCache arguments


@pytest.mark.parametrize("value", [*BAD, 1.0], ids=repr)
@pytest.mark.parametrize(
    "call",
    [
        lambda c, v: c.alloc(v),
        lambda c, v: c.evict(v),
        lambda c, v: c.evict(v, "host"),
        lambda c, v: c.device_kv(v),
    ],
    ids=["alloc", "evict_device", "evict_host", "device_kv"],
)
async def test_cache_methods_reject_bad_numbers(
    call: Callable[[akv.HiCache, Any], object], value: object
) -> None:
    async with akv.HiCache(small_config()) as cache:
        before = cache.statistics()
        with pytest.raises(InvalidInputError) as exc:
            call(cache, value)
        named(exc, value=value)
        after = cache.statistics()
        assert (after.device, after.host, after.nodes) == (before.device, before.host, 0)


@pytest.mark.parametrize("value", [*BAD, 1.0], ids=repr)
async def test_alloc_wait_rejects_bad_numbers(value: object) -> None:
    async with akv.HiCache(small_config()) as cache:
        with pytest.raises(InvalidInputError) as exc:
            await cache.alloc_wait(value)  # type: ignore[arg-type]
        named(exc, value=value)
        assert cache.statistics().device.free_pages == 16


# ---------------------------------------------------------------- storage, embedding, events


@pytest.mark.parametrize("value", [*BAD, 0, 1.0], ids=repr)
def test_file_storage_capacity(tmp_path: Path, value: object) -> None:
    with pytest.raises(ConfigError) as exc:
        FileStorage(tmp_path, capacity_bytes=value)  # type: ignore[arg-type]
    named(exc, "capacity_bytes", value=value)


@pytest.mark.parametrize("value", BAD, ids=repr)
@pytest.mark.parametrize(
    "name", ["no_space_retry_delay", "rpc_timeout_ms", "global_segment_size", "local_buffer_size"]
)
def test_mooncake_storage_numbers(name: str, value: object) -> None:
    if name.endswith("_size") and value == "1":
        value = "1x"  # "1" is a valid size string (1 byte)
    with pytest.raises(ConfigError) as exc:
        MooncakeStorage(**{name: value})
    named(exc, name, value=value)


def test_mooncake_retry_delay_bounds() -> None:
    assert MooncakeStorage(no_space_retry_delay=0).no_space_retry_delay == 0
    with pytest.raises(ConfigError, match="no_space_retry_delay"):
        MooncakeStorage(no_space_retry_delay=MAX_SECONDS * 2)  # time.sleep overflows


@pytest.mark.parametrize("value", [*BAD, 0], ids=repr)
@pytest.mark.parametrize("name", ["workers", "default_timeout", "max_pending", "intra_op_threads"])
def test_storage_io_numbers(name: str, value: object) -> None:
    if name == "max_pending" and value == 0:
        value = 1  # below workers (2)
    with pytest.raises(ConfigError) as exc:
        StorageIO(MemoryStorage(), **{name: value})
    named(exc, name, value=value)


@pytest.mark.parametrize("value", [*BAD, 0], ids=repr)
@pytest.mark.parametrize("name", ["pool_bytes", "timeout", "workers"])
def test_embedding_cache_numbers(name: str, value: object) -> None:
    opts: dict[str, Any] = {"pool_bytes": 1 << 16, name: value}
    with pytest.raises(ConfigError) as exc:
        EmbeddingCache(**opts)
    named(exc, name, value=value)


@pytest.mark.parametrize("value", [*BAD, 1.0], ids=repr)
async def test_embedding_evict_rejects_bad_numbers(value: object) -> None:
    async with EmbeddingCache(1 << 16) as emb:
        with pytest.raises(InvalidInputError) as exc:
            emb.evict(value)  # type: ignore[arg-type]
        named(exc, "nbytes", value=value)


@pytest.mark.parametrize("value", BAD, ids=repr)
@pytest.mark.parametrize("name", ["snapshot_interval", "buffer_steps", "hwm", "data_parallel_rank"])
def test_event_publisher_numbers(name: str, value: object) -> None:
    pytest.importorskip("zmq")
    from aiocache_kv.events.zmq import ZmqEventPublisher

    with pytest.raises(InvalidInputError) as exc:
        ZmqEventPublisher("tcp://127.0.0.1:*", **{name: value})
    named(exc, name, value=value)


@pytest.mark.parametrize("value", BAD, ids=repr)
async def test_event_publisher_timestamp(value: object) -> None:
    pytest.importorskip("zmq")
    from aiocache_kv.events.zmq import ZmqEventPublisher

    pub = ZmqEventPublisher("tcp://127.0.0.1:*")
    with pytest.raises(InvalidInputError) as exc:
        await pub.publish([], ts=value)  # type: ignore[arg-type]
    named(exc, "ts", value=value)
    assert pub.next_seq == 0 and pub.batches_published == 0


@pytest.mark.parametrize("value", [*BAD, 1.0], ids=repr)
def test_components_windows_and_shapes(value: object) -> None:
    dims = dict(num_layers=1, num_kv_heads=1, head_dim=4, page_size=2)
    with pytest.raises(ConfigError):
        akv.SlidingWindow(value, **dims)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        akv.MambaState((4, value), page_size=2)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [*BAD, 1.0], ids=repr)
@pytest.mark.parametrize("at", range(5))
def test_attribution_counts(value: object, at: int) -> None:
    from aiocache_kv.telemetry import attribute

    counts: list[object] = [8, 4, 4, 0, 0]
    counts[at] = value
    prompt, reused, device, host, storage = counts
    with pytest.raises(InvalidInputError) as exc:
        attribute(prompt, reused, device=device, host=host, storage=storage)  # type: ignore[arg-type]
    assert str(value) in str(exc.value)
