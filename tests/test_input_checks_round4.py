"""Bad input to a public API raises a typed error naming the value, and changes nothing:
huge ints for seconds, config components and copy threads, the copy worker's setup, file and
Mooncake storage options, ``page_hashes`` and the ZeroMQ event publisher."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import aiocache_kv as akv
from aiocache_kv import page_hashes
from aiocache_kv.blocks import MAX_PAGE_SIZE
from aiocache_kv.embedding import EmbeddingCache
from aiocache_kv.errors import (
    ConfigError,
    InvalidInputError,
    InvalidTypeError,
)
from aiocache_kv.numeric import MAX_THREADS, check_int, check_real
from aiocache_kv.storage import FileStorage, MooncakeStorage
from aiocache_kv.storage.executor import StorageIO
from aiocache_kv.storage.mooncake_options import MAX_RPC_TIMEOUT_MS, MAX_SIZE_BYTES
from aiocache_kv.testing import MemoryStorage
from aiocache_kv.transfer.engine import ThreadCopyEngine
from tests.conftest import small_config

HUGE = 10**400


# ---------------------------------------------------------------- numeric.check_real


@pytest.mark.parametrize("value", [HUGE, -HUGE, 10**5000], ids=["1e400", "-1e400", "1e5000"])
def test_check_real_refuses_huge_ints_by_name(value: int) -> None:
    with pytest.raises(InvalidInputError, match="delay"):
        check_real("delay", value)
    with pytest.raises(ConfigError, match="delay"):
        check_real("delay", value, minimum=None, error=ConfigError)


def test_check_real_huge_int_with_unbounded_maximum() -> None:
    with pytest.raises(InvalidInputError, match="finite"):
        check_real("ts", HUGE, maximum=float("inf"))
    assert check_real("ts", 10**300, maximum=float("inf")) == 1e300
    assert check_real("delay", 2) == 2.0  # a valid call still works


def test_check_int_maximum() -> None:
    assert check_int("n", 4, maximum=4) == 4
    with pytest.raises(ConfigError, match=r"n must be an int in \[0, 4\], got 5"):
        check_int("n", 5, maximum=4, error=ConfigError)


@pytest.mark.parametrize(
    "field", ["storage_timeout", "max_pin_ttl", "max_pinned_fraction", "prefetch_timeout_max"]
)
def test_config_seconds_huge_int(field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        small_config(**{field: HUGE})


async def test_call_seconds_huge_int_changes_nothing() -> None:
    async with akv.HiCache(small_config()) as cache:
        r = cache.insert([1, 2, 3, 4], cache.alloc(4))
        before = cache.statistics().device.free_pages
        with pytest.raises(InvalidInputError, match="timeout"):
            await cache.alloc_wait(2, timeout=HUGE)
        with pytest.raises(InvalidInputError, match="ttl"):
            cache.pin([1, 2, 3, 4], ttl=HUGE)
        with pytest.raises(InvalidInputError, match="retention"):
            cache.insert([1, 2, 3, 4], r.device_indices, priority=5, retention=HUGE)
        assert cache.statistics().device.free_pages == before
        cache.check_invariants()
        cache.release(r)
        m = cache.match_prefix([1, 2, 3, 4])  # still usable
        assert m.device_len == 4
        cache.release(m)


# ---------------------------------------------------------------- CacheConfig


@pytest.mark.parametrize("value", [None, 5, 2.5, "sw"], ids=repr)
def test_config_components_not_a_sequence(value: object) -> None:
    with pytest.raises(ConfigError, match="components"):
        small_config(components=value)


def test_config_components_bad_entry_named() -> None:
    with pytest.raises(ConfigError, match="'oops'"):
        small_config(components=["oops"])
    assert small_config(components=[]).components == ()


@pytest.mark.parametrize("value", [MAX_THREADS + 1, 2**31, 2**40, 2**64], ids=repr)
def test_config_copy_threads_bounded(value: int) -> None:
    with pytest.raises(ConfigError, match=f"copy_threads.*{value}"):
        small_config(copy_threads=value)


@pytest.mark.parametrize("value", [MAX_THREADS + 1, 2**40, 10**12])
def test_worker_pool_sizes_are_bounded(value: int) -> None:
    """``storage_workers`` and an ``EmbeddingCache``'s ``workers`` took any size: a pool of
    10**12 threads was accepted until enough concurrent calls tried to start them."""
    with pytest.raises(
        ConfigError, match=f"storage_workers must be an int in \\[1, {MAX_THREADS}\\]"
    ):
        small_config(storage_workers=value)
    with pytest.raises(ConfigError, match=f"workers.*{MAX_THREADS}.*{value}"):
        StorageIO(MemoryStorage(), workers=value)
    with pytest.raises(ConfigError, match=f"workers.*{MAX_THREADS}.*{value}"):
        EmbeddingCache(pool_bytes=1 << 20, workers=value)
    assert small_config(storage_workers=MAX_THREADS).storage_workers == MAX_THREADS


async def test_config_copy_threads_at_bound_still_copies() -> None:
    cfg = small_config(copy_threads=1)
    assert small_config(copy_threads=MAX_THREADS).copy_threads == MAX_THREADS
    async with akv.HiCache(cfg) as cache:
        r = cache.insert([1, 2, 3, 4], cache.alloc(4))
        await asyncio.wait_for(cache.flush(), 10)
        cache.release(r)


# ---------------------------------------------------------------- the copy worker


class _Job:
    def __init__(self) -> None:
        self.ran = False

    def run(self, *, non_blocking: bool = False) -> None:
        self.ran = True


async def test_copy_worker_setup_failure_fails_its_jobs() -> None:
    """A worker whose thread setup raises (here ``torch.set_num_threads`` overflowing) fails
    every job it is given instead of dying and leaving their completions pending."""
    loop = asyncio.get_running_loop()
    eng = ThreadCopyEngine("test-copy-broken", threads=2**40)
    eng.start(loop)
    jobs = [_Job(), _Job()]
    futs: list[asyncio.Future[BaseException | None]] = [loop.create_future() for _ in jobs]
    for job, fut in zip(jobs, futs, strict=True):
        eng.submit(job, fut.set_result)
    errors = await asyncio.wait_for(asyncio.gather(*futs), 10)
    assert all(err is not None for err in errors), errors
    assert not any(job.ran for job in jobs)
    await asyncio.wait_for(eng.aclose(), 10)  # the worker still stops


async def test_cache_with_broken_copy_worker_fails_copies_not_hangs() -> None:
    eng = ThreadCopyEngine("test-copy-broken", threads=2**40)
    async with akv.HiCache(small_config(), copy_engine=eng) as cache:
        r = cache.insert([1, 2, 3, 4], cache.alloc(4))  # write-through: a copy to host
        await asyncio.wait_for(cache.flush(), 10)  # the failed copy settled, no hang
        assert cache.copies_in_flight() == 0
        assert cache.statistics().host.free_pages == 32  # the failed backup rolled back
        cache.release(r)
        cache.check_invariants()
        m = cache.match_prefix([1, 2, 3, 4])  # the device pages still serve
        assert m.device_len == 4
        cache.release(m)


# ---------------------------------------------------------------- FileStorage


@pytest.mark.parametrize("path", [None, 5, b"/tmp/x", 1.5, ""], ids=repr)
def test_file_storage_bad_path(path: object, tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="path") as exc:
        FileStorage(path)  # type: ignore[arg-type]
    assert repr(path) in str(exc.value)
    assert os.listdir(tmp_path) == []  # nothing was created in the working directory


def test_file_storage_nul_and_bytes_pathlike(tmp_path: Path) -> None:
    class BytesPath:
        def __fspath__(self) -> bytes:
            return b"/tmp/x"

    with pytest.raises(ConfigError, match="path"):
        FileStorage(BytesPath())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="path"):
        FileStorage(str(tmp_path) + "\0x")
    assert FileStorage(tmp_path).root == tmp_path  # valid paths still work
    assert FileStorage(str(tmp_path)).root == tmp_path


# ---------------------------------------------------------------- MooncakeStorage


@pytest.mark.parametrize(
    ("kw", "name"),
    [
        ({"master": 5}, "master"),
        ({"master": [":"]}, "master"),
        ({"metadata_server": 1}, "metadata_server"),
        ({"protocol": 5}, "protocol"),
        ({"local_hostname": 3.5}, "local_hostname"),
        ({"device_name": 0}, "device_name"),
        ({"check_existing": "no"}, "check_existing"),
        ({"check_existing": 1}, "check_existing"),
        ({"rpc_timeout_ms": MAX_RPC_TIMEOUT_MS + 1}, "rpc_timeout_ms"),
        ({"rpc_timeout_ms": 2**64}, "rpc_timeout_ms"),
        ({"global_segment_size": 2**80}, "global_segment_size"),
        ({"global_segment_size": "99999999999999999999999t"}, "global_segment_size"),
        ({"local_buffer_size": MAX_SIZE_BYTES + 1}, "local_buffer_size"),
    ],
    ids=repr,
)
def test_mooncake_ctor_refuses(kw: dict[str, Any], name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        MooncakeStorage(**kw)


def test_mooncake_ctor_valid_bounds_still_accepted() -> None:
    s = MooncakeStorage(
        master="h:1",
        protocol="tcp",
        local_hostname="127.0.0.1",
        device_name="",
        check_existing=True,
        rpc_timeout_ms=MAX_RPC_TIMEOUT_MS,
        global_segment_size=MAX_SIZE_BYTES,
    )
    assert (s.master, s.protocol, s.check_existing) == ("h:1", "tcp", True)
    assert (s.rpc_timeout_ms, s.global_segment_size) == (MAX_RPC_TIMEOUT_MS, MAX_SIZE_BYTES)


# ---------------------------------------------------------------- page_hashes


@pytest.mark.parametrize(
    "tokens",
    [np.arange(4), None, 0, "", 5, {}, "abcd"],
    ids=["ndarray", "None", "0", "''", "5", "{}", "str"],
)
def test_page_hashes_refuses_non_token_containers(tokens: object) -> None:
    with pytest.raises(InvalidTypeError, match="tokens"):
        page_hashes(tokens, page_size=2, model="m")  # type: ignore[arg-type]


@pytest.mark.parametrize("page_size", [MAX_PAGE_SIZE + 1, 2**63, 2**64], ids=repr)
def test_page_hashes_page_size_bounded(page_size: int) -> None:
    with pytest.raises(InvalidInputError, match=f"page_size.*{page_size}"):
        page_hashes([1, 2, 3, 4], page_size=page_size, model="m")


def test_page_hashes_valid_inputs_still_hash() -> None:
    want = page_hashes([1, 2, 3, 4], page_size=2, model="m")
    assert len(want) == 2
    assert page_hashes(torch.tensor([1, 2, 3, 4]), page_size=2, model="m") == want
    assert page_hashes([], page_size=2, model="m") == []
    assert page_hashes(torch.empty(0, dtype=torch.int64), page_size=2, model="m") == []
    assert page_hashes([1, 2, 3], page_size=MAX_PAGE_SIZE, model="m") == []  # no whole page
    with pytest.raises(InvalidInputError):
        page_hashes(torch.empty(0), page_size=2, model="m")  # a float tensor, even empty


# ---------------------------------------------------------------- ZmqEventPublisher


@pytest.fixture
def publisher_cls() -> Any:
    from aiocache_kv.events.zmq import ZmqEventPublisher  # (pyzmq, msgpack: test extras)

    return ZmqEventPublisher


@pytest.mark.parametrize(
    ("kw", "error", "name"),
    [
        ({"topic": 5}, InvalidTypeError, "topic"),
        ({"topic": "\ud800"}, ConfigError, "topic"),
        ({"endpoint": 5}, InvalidTypeError, "endpoint"),
        ({"endpoint": "not-an-endpoint"}, ConfigError, "endpoint"),
        ({"endpoint": "tcp://"}, ConfigError, "endpoint"),
        ({"replay_endpoint": b"tcp://127.0.0.1:*"}, InvalidTypeError, "replay_endpoint"),
        ({"buffer_steps": 2**64}, ConfigError, "buffer_steps"),
        ({"hwm": 2**31}, ConfigError, "hwm"),
        ({"hwm": 2**64}, ConfigError, "hwm"),
        ({"data_parallel_rank": 2**64}, ConfigError, "data_parallel_rank"),
        ({"publish_cache_salt": "yes"}, InvalidTypeError, "publish_cache_salt"),
    ],
    ids=repr,
)
def test_zmq_publisher_ctor_refuses(
    publisher_cls: Any, kw: dict[str, Any], error: type[Exception], name: str
) -> None:
    kw = {"endpoint": "tcp://127.0.0.1:*", **kw}
    with pytest.raises(error, match=name):
        publisher_cls(**kw)


async def test_zmq_publisher_bind_failure_is_typed_and_unbinds(publisher_cls: Any) -> None:
    async with publisher_cls("tcp://127.0.0.1:*") as first:
        taken = first.endpoint
        pub = publisher_cls("tcp://127.0.0.1:*", replay_endpoint=taken)
        with pytest.raises(ConfigError, match="replay_endpoint") as exc:
            await pub.start()
        assert taken in str(exc.value)
        assert exc.value.__cause__ is not None
        await pub.aclose()
        bad = publisher_cls("tcp://no-such-interface-here:1")
        with pytest.raises(ConfigError, match="no-such-interface-here"):
            await bad.start()
        await bad.aclose()
        assert await first.publish([]) == 0  # the bound one is untouched


async def test_zmq_publisher_bounds_still_accepted(publisher_cls: Any) -> None:
    top = (1 << 31) - 1
    async with publisher_cls(
        "tcp://127.0.0.1:*", hwm=top, buffer_steps=top, data_parallel_rank=top
    ) as pub:
        assert await pub.publish([]) == 0


@pytest.mark.parametrize("field", ["tenant", "lora"])
async def test_names_utf8_cannot_encode_are_refused_with_nothing_changed(field: str) -> None:
    """A lone surrogate in a tenant or LoRA name: refused where the name is given (the
    names travel in KV events and storage tags), after the tokens' own errors."""
    async with akv.HiCache(small_config()) as cache:
        before = cache.snapshot()
        bad = {field: "x\ud800y"}
        with pytest.raises(akv.InvalidInputError, match=f"{field} must be text UTF-8 can"):
            cache.match_prefix([1, 2, 3, 4], **bad)  # type: ignore[arg-type]
        slots = cache.alloc(4)
        with pytest.raises(akv.InvalidInputError, match=f"{field} must be text UTF-8 can"):
            cache.insert([1, 2, 3, 4], slots, **bad)  # type: ignore[arg-type]
        with pytest.raises(akv.InvalidTypeError, match="tokens must be ints"):
            cache.insert([1, 2, 3, "4"], slots, **bad)  # type: ignore[arg-type, list-item]
        with pytest.raises(akv.InvalidInputError, match=f"{field} must be text UTF-8 can"):
            await cache.prefetch([1, 2, 3, 4], **bad)  # type: ignore[arg-type]
        assert cache.snapshot() == before
        cache.free(slots)
        cache.release(cache.insert([1, 2, 3, 4], cache.alloc(4), **{field: "ünïcode"}))
        cache.check_invariants()
