"""The engine refuses bad input where it is given, with a typed error, and changes nothing:
``model_threads`` or ``storage_wait`` out of range, a ``cache`` that is not a ``HiCache``, non-bool
``pad_decodes`` / ``keep_logits``, and a prompt of bools (which the forward pass would refuse
at step time, failing every request of that batch with it)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import aiocache_kv as akv
from aiocache_kv.errors import ConfigError, InvalidTypeError
from aiocache_kv.models import GPT2Spec, build_gpt2, cache_config_for, check_token_ids
from aiocache_kv.numeric import MAX_THREADS
from aiocache_kv.serving import Engine
from aiocache_kv.serving.runner import ModelRunner

GOOD = [5, 6, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def model() -> Any:
    spec = GPT2Spec(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=64, seed=3)
    return build_gpt2(spec)


def config(model: Any) -> akv.CacheConfig:
    return cache_config_for(
        model, page_size=4, device_pages=32, host_pages=64, host_memory_reserve_bytes=0
    )


@pytest.mark.parametrize("threads", [MAX_THREADS + 1, 2**31, 2**40, 2**64], ids=repr)
async def test_model_threads_bounded(model: Any, threads: int) -> None:
    async with akv.HiCache(config(model)) as cache:
        with pytest.raises(ConfigError, match=f"model_threads.*{threads}"):
            Engine(model, cache, model_threads=threads)
        async with Engine(model, cache, model_threads=1) as eng:  # a valid one still serves
            assert len((await eng.generate(GOOD, max_new_tokens=2)).tokens) == 2


@pytest.mark.parametrize(
    "wait", [float("nan"), float("inf"), -0.1, 3600.5, "1", None, True], ids=repr
)
async def test_storage_wait_is_a_finite_number_in_range(model: Any, wait: Any) -> None:
    async with akv.HiCache(config(model)) as cache:
        with pytest.raises(ConfigError, match="storage_wait"):
            Engine(model, cache, storage_wait=wait)
        for good in (0, 0.0, 2.5, 3600):
            assert Engine(model, cache, storage_wait=good).storage_wait == float(good)


def test_model_runner_threads_bounded() -> None:
    with pytest.raises(ConfigError, match="model_threads"):
        ModelRunner(None, 2**40)  # type: ignore[arg-type]


async def test_cache_must_be_a_hicache(model: Any) -> None:
    for bad in (None, config(model), "cache"):
        with pytest.raises(InvalidTypeError, match="cache must be a HiCache"):
            Engine(model, bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["yes", 1, 0], ids=repr)
async def test_pad_decodes_must_be_a_bool(model: Any, value: object) -> None:
    async with akv.HiCache(config(model)) as cache:
        with pytest.raises(ConfigError, match="pad_decodes"):
            Engine(model, cache, pad_decodes=value)  # type: ignore[arg-type]
        Engine(model, cache, pad_decodes=False)
        Engine(model, cache, pad_decodes=None)


@pytest.mark.parametrize("value", ["no", 1, None], ids=repr)
async def test_keep_logits_must_be_a_bool(model: Any, value: object) -> None:
    async with akv.HiCache(config(model)) as cache, Engine(model, cache) as eng:
        with pytest.raises(InvalidTypeError, match="keep_logits"):
            await eng.generate(GOOD, max_new_tokens=2, keep_logits=value)  # type: ignore[arg-type]
        assert eng.statistics().submitted == 0  # nothing was admitted
        r = await eng.generate(GOOD, max_new_tokens=2, keep_logits=False)
        assert r.logits is None
        kept = await eng.generate(GOOD, max_new_tokens=2, keep_logits=True)
        assert kept.logits is not None and len(kept.logits) == 2
        eng.check_invariants()


def test_check_token_ids_refuses_bools(model: Any) -> None:
    with pytest.raises(InvalidTypeError, match=r"bool.*at position 1"):
        check_token_ids(model, [3, True, 4])
    assert check_token_ids(model, [3, 1, 4]) == [3, 1, 4]


async def test_bool_prompt_fails_alone_at_submit(model: Any) -> None:
    """Two concurrent calls, one with a prompt of bools: only that call fails, at submit
    (nothing admitted); the innocent one in the same batch gets its tokens."""
    async with (
        akv.HiCache(config(model)) as cache,
        Engine(model, cache, max_batch_tokens=64, max_running=4) as eng,
    ):
        alone = await eng.generate(GOOD, max_new_tokens=4)
        before = eng.statistics()
        good, bad = await asyncio.gather(
            eng.generate(GOOD, max_new_tokens=4),
            eng.generate([True, False, True, True, False], max_new_tokens=4),  # type: ignore[list-item]
            return_exceptions=True,
        )
        assert isinstance(bad, InvalidTypeError), bad
        assert "bool" in str(bad)
        assert not isinstance(good, BaseException), good
        assert good.tokens == alone.tokens
        after = eng.statistics()
        assert after.submitted == before.submitted + 1  # the bad call was never admitted
        assert after.failed == before.failed
        eng.check_invariants()


@pytest.mark.parametrize("field", ["tenant", "lora"])
async def test_a_name_utf8_cannot_encode_fails_alone_at_submit(model: Any, field: str) -> None:
    """Found by an adversarial round: a ``lora`` with a lone surrogate passed submit, then
    the insert's ``BlockStored`` encoded it strictly and raised ``UnicodeEncodeError`` after
    the tree had pinned the new leaf: the step loop failed every request in the batch, the
    pin leaked and the task that entered the engine was cancelled."""
    async with (
        akv.HiCache(config(model)) as cache,
        Engine(model, cache, max_batch_tokens=64, max_running=4) as eng,
    ):
        alone = await eng.generate(GOOD, max_new_tokens=4)
        good, bad = await asyncio.gather(
            eng.generate(GOOD, max_new_tokens=4),
            eng.generate([9, 8, 7, 6, 5, 4], max_new_tokens=4, **{field: "a\udcff"}),
            return_exceptions=True,
        )
        assert isinstance(bad, akv.InvalidInputError), bad
        assert f"{field} must be text UTF-8 can encode" in str(bad) and "udcff" in str(bad)
        assert not isinstance(good, BaseException) and good.tokens == alone.tokens
        ok = await eng.generate([9, 8, 7, 6, 5, 4], max_new_tokens=2, **{field: "é-ok"})
        assert len(ok.tokens) == 2
        eng.check_invariants()
    cache.check_invariants()


async def test_aclose_from_another_task_is_refused_with_nothing_changed(model: Any) -> None:
    """The engine's task group exits only in the task that entered it: ``aclose`` from
    another task raised anyio's bare ``RuntimeError`` and left the engine half closed (its
    admissions never closed, a second ``aclose`` silently did nothing)."""
    async with akv.HiCache(config(model)) as cache:
        eng = Engine(model, cache)
        await eng.__aenter__()
        with pytest.raises(akv.OwnershipError, match="the task that entered the engine"):
            await asyncio.create_task(eng.aclose(), name="other")
        r = await eng.generate(GOOD, max_new_tokens=2)  # still serving
        assert len(r.tokens) == 2
        await eng.aclose()  # where it was entered: closes
        with pytest.raises(akv.EngineClosedError):
            await eng.generate(GOOD, max_new_tokens=2)
        eng.check_invariants()
    cache.check_invariants()
