"""EmbeddingCache refuses bad input with typed errors before anything changes.

Tensors the pool copy cannot read (meta, sparse, nested, fake), batch arguments that are not
sequences, and a bad ``pin_memory`` / ``pool_bytes``: each is a typed error naming the value,
the statistics are unchanged, the invariants hold and a later valid call works.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch

import aiocache_kv.embedding.cache as cache_mod
from aiocache_kv.embedding import EmbeddingCache
from aiocache_kv.errors import (
    ConfigError,
    HostMemoryError,
    InvalidInputError,
    InvalidTypeError,
)

DIM = 8


def emb(seed: int, tokens: int = 4) -> torch.Tensor:
    return torch.randn(tokens, DIM, generator=torch.Generator().manual_seed(seed))


def _fake() -> torch.Tensor:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(4, DIM)


def _nested(layout: torch.layout) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "prototype stage"
        return torch.nested.nested_tensor([emb(1), emb(2, tokens=3)], layout=layout)


def _csr() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "beta state"
        return torch.zeros(4, DIM).to_sparse_csr()


#: tensors that have no dense data the pool copy can read: (builder, what the error names)
UNCOPYABLE: dict[str, tuple[Callable[[], torch.Tensor], str]] = {
    "meta": (lambda: torch.empty(4, DIM, device="meta"), "meta device"),
    "sparse_coo": (lambda: torch.zeros(4, DIM).to_sparse(), "layout torch.sparse_coo"),
    "sparse_csr": (_csr, "layout torch.sparse_csr"),
    "nested_strided": (lambda: _nested(torch.strided), "nested tensor"),
    "nested_jagged": (lambda: _nested(torch.jagged), "nested tensor"),
    "fake": (_fake, "tensor subclass FakeTensor"),
}
if torch.backends.mkldnn.is_available():
    UNCOPYABLE["mkldnn"] = (lambda: torch.zeros(4, DIM).to_mkldnn(), "layout torch._mkldnn")


@pytest.fixture(params=sorted(UNCOPYABLE))
def uncopyable(request: pytest.FixtureRequest) -> tuple[Callable[[], torch.Tensor], str]:
    """A builder of one kind of tensor without dense data, and what the error names; it is
    called once here, off the loop (the first build imports torch internals)."""
    build, names = UNCOPYABLE[request.param]
    build()
    return build, names


async def test_a_tensor_without_dense_data_is_refused_and_the_batch_stores_nothing(
    uncopyable: tuple[Callable[[], torch.Tensor], str],
) -> None:
    build, names = uncopyable
    async with EmbeddingCache(pool_bytes=1 << 16) as cache:
        await cache.insert_batch(["old"], [emb(0)])
        before = cache.statistics()
        with pytest.raises(InvalidInputError, match=f"tensors\\[0\\].*{names}"):
            await cache.insert_batch(["bad"], [build()])
        # a mixed batch is all-or-nothing: the good entry before the bad one is not cached
        with pytest.raises(InvalidInputError, match=f"tensors\\[1\\].*{names}"):
            await cache.insert_batch(["good", "bad"], [emb(1), build()])
        assert cache.statistics() == before
        cache.check_invariants()
        assert await cache.get_batch(["good", "bad"]) == [None, None]
        x = emb(2)
        assert (await cache.insert_batch(["good"], [x])).new == 1
        (y,) = await cache.get_batch(["good"])
        assert y is not None and torch.equal(x, y)
        cache.check_invariants()


def test_a_parameter_is_still_a_plain_tensor() -> None:
    from aiocache_kv.embedding.checks import check_tensors

    p = torch.nn.Parameter(emb(1))
    assert check_tensors([p], 1, torch.float32) == [p]


INSERT_BAD: list[tuple[object, object, str]] = [
    (None, [], "hashes must be a sequence of str/bytes, got NoneType"),
    (7, [], "hashes must be a sequence of str/bytes, got int: 7"),
    (3.5, [], "got float: 3.5"),
    (torch.tensor(1), [], "hashes must be a sequence.*got Tensor"),
    ([b"a"], None, "tensors must be a sequence of torch.Tensor.*got NoneType"),
    ([b"a"], 3, "tensors must be a sequence of torch.Tensor.*got int: 3"),
    ([b"a"], "t", "tensors must be a sequence of torch.Tensor.*got a single str"),
    ([b"a", b"b"], b"ab", "tensors must be a sequence of torch.Tensor.*got a single bytes"),
    (b"ab", [emb(1), emb(2)], "hashes must be a sequence of str/bytes, got a single bytes"),
]


@pytest.mark.parametrize(("hashes", "tensors", "match"), INSERT_BAD)
async def test_insert_batch_refuses_arguments_that_are_not_sequences(
    hashes: object, tensors: object, match: str
) -> None:
    async with EmbeddingCache(pool_bytes=1 << 16) as cache:
        await cache.insert_batch(["old"], [emb(0)])
        before = cache.statistics()
        with pytest.raises(InvalidTypeError, match=match):
            await cache.insert_batch(hashes, tensors)  # type: ignore[arg-type]
        assert cache.statistics() == before
        cache.check_invariants()
        assert (await cache.insert_batch(["new"], [emb(1)])).new == 1


@pytest.mark.parametrize(
    ("hashes", "match"),
    [
        (None, "got NoneType"),
        (42, "got int: 42"),
        ("ab", "got a single str"),
        (bytearray(b"ab"), "got a single bytearray"),
    ],
)
async def test_get_batch_refuses_hashes_that_are_not_a_sequence(hashes: object, match: str) -> None:
    async with EmbeddingCache(pool_bytes=1 << 16) as cache:
        x = emb(0)
        await cache.insert_batch(["old"], [x])
        before = cache.statistics()
        with pytest.raises(InvalidTypeError, match=f"hashes must be a sequence.*{match}"):
            await cache.get_batch(hashes)  # type: ignore[arg-type]
        assert cache.statistics() == before
        cache.check_invariants()
        (y,) = await cache.get_batch(iter(["old"]))  # any iterable of hashes still works
        assert y is not None and torch.equal(x, y)


async def test_a_bad_batch_before_the_first_start_leaves_the_cache_new() -> None:
    cache = EmbeddingCache(pool_bytes=1 << 16)
    with pytest.raises(InvalidTypeError):
        await cache.insert_batch(None, [])  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="meta"):
        await cache.insert_batch(["m"], [torch.empty(2, 2, device="meta")])
    assert cache.statistics().state == "new"
    await cache.aclose()


@pytest.mark.parametrize("pin", ["no", 1, 0, "True", 1.0])
def test_pin_memory_must_be_a_bool(pin: object) -> None:
    with pytest.raises(ConfigError, match=f"pin_memory must be a bool or None, got {pin!r}"):
        EmbeddingCache(pool_bytes=1 << 16, pin_memory=pin)  # type: ignore[arg-type]


async def test_pin_memory_true_pins_with_cuda_and_is_refused_without() -> None:
    """One test for both machines (no skip either way): without CUDA ``pin_memory=True`` is a
    ``ConfigError`` at construction; with it, the pool is pinned."""
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="pin_memory=True needs CUDA"):
            EmbeddingCache(pool_bytes=1 << 16, pin_memory=True)
    else:
        async with EmbeddingCache(pool_bytes=1 << 16, pin_memory=True) as cache:
            assert cache._pool.memory.is_pinned()
    EmbeddingCache(pool_bytes=1 << 16, pin_memory=None)
    async with EmbeddingCache(pool_bytes=1 << 16, pin_memory=False) as cache:
        assert not cache._pool.memory.is_pinned()


@pytest.mark.parametrize("size", [2**63, 2**64, 10**30])
def test_pool_bytes_beyond_int64_is_a_config_error(size: int) -> None:
    with pytest.raises(ConfigError, match=f"pool_bytes must be an int in .*got {size}"):
        EmbeddingCache(pool_bytes=size)


async def test_pool_bytes_beyond_available_memory_is_refused_at_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cache_mod, "available_host_bytes", lambda: 1 << 12)
    cache = EmbeddingCache(pool_bytes=1 << 16)
    before = cache.statistics()
    with pytest.raises(HostMemoryError, match=r"pool_bytes=65536 .* exceeds the 4096 bytes"):
        await cache.start()
    with pytest.raises(HostMemoryError):  # the implicit start of a first call too
        await cache.insert_batch(["a"], [emb(1)])
    assert cache.statistics() == before
    assert before.state == "new"
    cache.check_invariants()
    monkeypatch.undo()  # the memory is there now: the next start works
    assert (await cache.insert_batch(["a"], [emb(1)])).new == 1
    await cache.aclose()


async def test_a_huge_pool_is_a_host_memory_error_not_a_torch_error() -> None:
    cache = EmbeddingCache(pool_bytes=2**62)
    with pytest.raises(HostMemoryError, match=f"pool_bytes={2**62}"):
        await cache.start()
    assert cache.statistics().state == "new"
    await cache.aclose()


async def test_a_failed_allocation_is_a_host_memory_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # admission passes (as on a host that reports more than it can map): torch refuses
    monkeypatch.setattr(cache_mod, "available_host_bytes", lambda: 1 << 63)
    cache = EmbeddingCache(pool_bytes=2**62)
    with pytest.raises(HostMemoryError, match="could not be allocated") as info:
        await cache.start()
    assert isinstance(info.value.__cause__, RuntimeError)
    assert cache.statistics().state == "new"
    await cache.aclose()
