"""Retention priority (issue #26): lower priority evicted first, LRU within a priority,
priorities that lapse after their retention time, soft (never blocks an eviction), kept by
splits, the max on shared prefixes; hostile inputs change nothing."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch

import aiocache_kv as akv
from aiocache_kv.errors import InvalidInputError, InvalidTypeError
from aiocache_kv.models import GPT2Spec, build_gpt2, cache_config_for
from aiocache_kv.serving import Engine
from aiocache_kv.tree import RadixTree
from aiocache_kv.tree.node import Node
from aiocache_kv.tree.retention import PRIORITY_MAX, check_priority
from tests.conftest import small_config
from tests.test_capacity_wait import _TwoRanksAlone
from tests.test_split_ack import write_kv


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Tree:
    """A page-size-1 tree whose inserts take fresh page ids; a hand-driven clock."""

    def __init__(self) -> None:
        self.tree = RadixTree(1)
        self.clock = Clock()
        self.tree.deadlines.now = self.clock
        self.next_page = 0

    def insert(
        self, tokens: list[int], priority: int = 0, retention: float = math.inf, ns: str = "a"
    ) -> Node:
        pages = torch.arange(self.next_page, self.next_page + len(tokens))
        self.next_page += len(tokens)
        out = self.tree.insert(ns, tokens, len(tokens), pages, pin=False)
        if priority:
            self.tree.deadlines.raise_path(out.node, priority, retention)
        self.tree.check_invariants()
        return out.node

    def node(self, tokens: list[int], ns: str = "a") -> Node:
        node, n = self.tree.match(ns, tokens, len(tokens))
        assert n == len(tokens)
        return node

    def victims(self, k: int = 1 << 30) -> list[list[int]]:
        """Device victims in eviction order, one at a time (device-only nodes: deleted)."""
        out = []
        while len(out) < k:
            ev = self.tree.evict_device(1)
            if not ev.nodes:
                break
            out += [list(n.key) for n in ev.nodes]
            self.tree.check_invariants()
        return out


def test_lower_priority_goes_first_lru_within_a_priority() -> None:
    t = Tree()
    t.insert([1], priority=5)
    t.insert([2])
    t.insert([3], priority=5)
    t.insert([4])
    t.insert([5], priority=9)
    assert t.victims() == [[2], [4], [1], [3], [5]]


def test_default_priority_is_plain_lru() -> None:
    t = Tree()
    for tok in (3, 1, 2):
        t.insert([tok])
    t.node([3])  # touched: most recent
    assert t.victims() == [[1], [2], [3]]


def test_soft_a_high_priority_page_is_still_evicted_when_nothing_else_is() -> None:
    t = Tree()
    t.insert([1, 2], priority=PRIORITY_MAX)
    ev = t.tree.evict_device(1)
    assert [list(n.key) for n in ev.nodes] == [[1, 2]]
    assert t.tree.num_nodes == 0


def test_shared_prefix_takes_the_max_and_lower_leaves_it_alone() -> None:
    t = Tree()
    t.insert([1, 2, 3], priority=5)
    t.insert([1, 2, 4])  # splits [1, 2] off; the default priority changes nothing
    assert t.node([1, 2]).priority == 5
    assert t.node([1, 2, 4]).priority == 0
    t.insert([1, 2, 5], priority=9)
    assert t.node([1, 2]).priority == 9
    assert t.node([1, 2, 3]).priority == 5
    t.insert([1, 2, 3], priority=2)  # lower: the node keeps 5, the shared prefix 9
    assert (t.node([1, 2, 3]).priority, t.node([1, 2]).priority) == (5, 9)
    t.tree.check_invariants()


def test_retention_lapses_to_the_default_priority() -> None:
    t = Tree()
    t.insert([1], priority=7, retention=10.0)
    t.insert([2])  # more recent, default priority
    assert t.victims(1) == [[2]]
    t.insert([2])
    t.clock.t += 10.5  # [1]'s priority lapsed: plain LRU now
    assert t.victims(1) == [[1]]
    assert t.tree.deadlines.lapse() == 0
    assert len(t.tree.deadlines) == 0


def test_equal_priority_keeps_the_later_deadline_and_a_forever_one_wins() -> None:
    t = Tree()
    node = t.insert([1], priority=7, retention=10.0)
    t.insert([1], priority=7, retention=5.0)  # earlier: ignored
    assert node.retain_until == t.clock.t + 10.0
    t.insert([1], priority=7, retention=20.0)
    assert node.retain_until == t.clock.t + 20.0
    t.insert([1], priority=7)  # no retention: never lapses
    assert node.retain_until == math.inf
    t.clock.t += 100
    t.tree.deadlines.lapse()
    assert node.priority == 7
    t.tree.check_invariants()


def test_a_higher_priority_replaces_the_deadline() -> None:
    t = Tree()
    node = t.insert([1], priority=3)  # forever
    t.insert([1], priority=8, retention=5.0)
    assert (node.priority, node.retain_until) == (8, t.clock.t + 5.0)
    t.clock.t += 6
    t.tree.deadlines.lapse()
    assert (node.priority, node.retain_until) == (0, math.inf)  # back to the default
    t.tree.check_invariants()


def test_split_keeps_priority_and_deadline_on_both_halves() -> None:
    t = Tree()
    tail = t.insert([1, 2, 3, 4], priority=6, retention=10.0)
    head = t.node([1, 2])  # splits
    assert head is not tail and head.key == [1, 2] and tail.key == [3, 4]
    assert (head.priority, head.retain_until) == (tail.priority, tail.retain_until)
    t.tree.check_invariants()  # the head's deadline has an entry of its own
    t.clock.t += 11
    assert t.tree.deadlines.lapse() == 2
    assert head.priority == tail.priority == 0
    t.tree.check_invariants()


def test_a_re_offered_node_supersedes_its_old_heap_entry() -> None:
    t = Tree()
    t.insert([1])
    t.insert([2])
    t.insert([1], priority=4)  # [1] was the LRU victim: its old entry must not win
    assert t.victims() == [[2], [1]]


def test_check_invariants_catches_a_deadline_without_an_entry() -> None:
    t = Tree()
    node = t.insert([1], priority=4)
    node.retain_until = t.clock.t + 5  # not through raise_node: no entry
    with pytest.raises(AssertionError, match="without an entry"):
        t.tree.check_invariants()
    node.retain_until = math.inf
    node.priority = PRIORITY_MAX + 1
    with pytest.raises(AssertionError, match="out of range"):
        t.tree.check_invariants()


def test_randomized_eviction_order_matches_a_model() -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    t = Tree()
    model: dict[int, tuple[int, float, int]] = {}  # token -> (priority, until, last use)
    for use in range(1, 301):
        tok = rng.randrange(40)
        pr = rng.choice([0, 0, 0, 1, 5, 9])
        ret = rng.choice([math.inf, 3.0, 8.0])
        t.insert([tok], pr, ret if pr else math.inf)
        old_pr, old_until, _ = model.get(tok, (0, math.inf, 0))
        if old_until <= t.clock.t:  # lapsed (whether or not an eviction noticed yet)
            old_pr, old_until = 0, math.inf
        until = t.clock.t + ret
        if pr > old_pr or (pr == old_pr and pr and until > old_until):
            old_pr, old_until = pr, until
        model[tok] = (old_pr, old_until, use)
        t.clock.t += rng.random()
        if rng.random() < 0.2:
            now = t.clock.t

            def rank(tok: int, now: float = now) -> tuple[int, int]:
                pr, until, last = model[tok]
                return (pr if until > now else 0, last)

            want = min(model, key=rank)
            got = t.victims(1)
            assert got == [[want]], f"seed {seed}: got {got}, want {[want]} of {model}"
            del model[want]


# ---------------------------------------------------------------------- through HiCache


async def test_insert_priority_orders_cache_evictions() -> None:
    async with akv.HiCache(small_config(page_size=2, device_pages=16)) as cache:
        results = []
        for i, prio in enumerate([10, None, 10, None]):
            toks = [100 * (i + 1), 100 * (i + 1) + 1]
            slots = cache.alloc(2)
            write_kv(cache, slots, seed=i)
            r = cache.insert(toks, slots, priority=prio)
            assert r.write_through is not None
            await r.write_through
            cache.release(r)
            results.append(toks)
        assert cache.evict(2) == 2  # the two default-priority pages, not the older ones
        on_device = []
        for toks in results:
            m = cache.match_prefix(toks)
            on_device.append(m.device_len)
            cache.release(m)
        assert on_device == [2, 0, 2, 0]
        cache.check_invariants()


@pytest.mark.parametrize(
    ("priority", "retention", "error"),
    [
        (True, None, InvalidTypeError),
        (1.0, None, InvalidTypeError),
        ("3", None, InvalidTypeError),
        (-1, None, InvalidInputError),
        (PRIORITY_MAX + 1, None, InvalidInputError),
        (1 << 80, None, InvalidInputError),
        (5, math.nan, InvalidInputError),
        (5, -1.0, InvalidInputError),
        (5, 0, InvalidInputError),
        (5, math.inf, InvalidInputError),
        (5, 1e300, InvalidInputError),
        (5, True, InvalidInputError),
        (None, math.nan, InvalidInputError),
    ],
)
async def test_hostile_priority_or_retention_changes_nothing(
    priority: object, retention: object, error: type[Exception]
) -> None:
    async with akv.HiCache(small_config()) as cache:
        slots = cache.alloc(4)
        before = cache.statistics()
        with pytest.raises(error, match=r"priority|retention"):
            cache.insert([1, 2, 3, 4], slots, priority=priority, retention=retention)  # type: ignore[arg-type]
        after = cache.statistics()
        assert (after.nodes, after.inserted_tokens, after.device) == (
            before.nodes,
            before.inserted_tokens,
            before.device,
        )
        cache.free(slots)
        cache.check_invariants()


def test_check_priority_values() -> None:
    assert check_priority(None, None) is None
    assert check_priority(0, 5.0) is None  # the default priority has nothing to lapse
    assert check_priority(7, None) == (7, math.inf)
    assert check_priority(PRIORITY_MAX, 2) == (PRIORITY_MAX, 2.0)


# ---------------------------------------------------------------------- through the engine


@pytest.fixture(scope="module")
def gpt2() -> Any:
    return build_gpt2(GPT2Spec(n_layer=2, n_head=4, n_embd=64, vocab_size=512, seed=3))


async def test_engine_request_priority_reaches_the_tree(gpt2: Any) -> None:
    cfg = cache_config_for(
        gpt2, page_size=4, device_pages=64, host_pages=128, host_memory_reserve_bytes=0
    )
    rng = random.Random(11)
    high = [rng.randrange(512) for _ in range(16)]
    low = [rng.randrange(512) for _ in range(16)]
    async with akv.HiCache(cfg) as cache:
        async with Engine(gpt2, cache) as eng:
            await eng.generate(high, max_new_tokens=4, priority=9, retention=600.0)
            await eng.generate(low, max_new_tokens=4)  # more recent, default priority
            with pytest.raises(InvalidInputError, match="priority"):
                await eng.generate(low, max_new_tokens=4, priority=-1)
            with pytest.raises(InvalidTypeError, match="priority"):
                await eng.generate(low, max_new_tokens=4, priority=2.5)  # type: ignore[arg-type]
            assert eng.statistics().submitted == 2
        await cache.flush()
        node, n = cache._core.tree.match(cache._ns(None, None), high, 16)
        assert n == 16 and node.priority == 9 and math.isfinite(node.retain_until)

        def on_device(tokens: list[int]) -> int:
            m = cache.match_prefix(tokens)
            d = m.device_len
            cache.release(m)
            return d

        while on_device(low) == 16:  # evict page by page: the low-priority pages go first
            assert cache.evict(1) > 0
        assert on_device(high) == 16
        cache.check_invariants()


async def test_retention_is_refused_with_tensor_parallelism() -> None:
    cfg = small_config(device_pages=8, host_pages=0)
    async with akv.HiCache(cfg, tp_group=_TwoRanksAlone()) as cache:
        slots = cache.alloc(4)
        with pytest.raises(InvalidInputError, match="tensor parallelism"):
            cache.insert([1, 2, 3, 4], slots, priority=5, retention=10.0)
        assert cache.statistics().nodes == 0
        r = cache.insert([1, 2, 3, 4], slots, priority=5)  # a priority that never lapses is fine
        cache.release(r)
        cache.check_invariants()
