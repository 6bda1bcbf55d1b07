"""Stateful property test: random interleavings against a real ``HiCache``.

A hypothesis ``RuleBasedStateMachine`` drives one CPU ``HiCache`` (tiny pools, copies completed
by hand with ``ManualCopyEngine`` in any order) through inserts with shared prefixes (so nodes
with pending write-through acks split), matches, releases, double releases, evictions of both
tiers, copy completions and failures, load-backs that are awaited or cancelled at any point,
two tenants, and bad input.  After every step it runs ``cache.check_invariants()`` and checks
the cache against the simple model of ``tests/reference_model.py``:

* a match never exceeds the longest prefix inserted in its own namespace and never drops below
  a prefix pinned by a live handle;
* an insert caches all its whole pages (``inserted_len``), except that it stops right after a
  node whose load-back is still in flight, because nothing may hang below such a node on device
  (a failed load turns it back into host-only): ``inserted_len`` is then exactly where the first
  loading node on its path ends, ``prefix_len`` counts no further, the caller's pages after it
  are retained by the result until it is released, and the model records only the cached part;
* KV read back from the device pool at a live match's ``device_indices`` is bit-identical to
  what was written for those tokens, across write-through, demotion, eviction and load-back;
* device ``free + held + evictable + protected + retained == total`` (host: ``held == 0``;
  retained: the callers' rows the tree did not take, kept by unreleased results) and releasing
  everything, settling every copy and evicting everything returns every page;
* KV events replay consistently: no hash is shared by two namespaces, and the blocks stored per
  medium are exactly the pages resident in that tier;
* bad input raises a typed ``KVCacheError`` and leaves ``statistics()`` unchanged.

One machine class per (write policy, page size).  The event loop is created per run and driven
with ``run_until_complete`` on this thread, which is the thread that started the cache.

Budgets and seeds come from the Hypothesis profile that ``tests/conftest.py`` loads:

* ``ci`` (the default, and what CI runs): 80 examples per class, the same examples on every run
  (``derandomize``; ``--hypothesis-seed`` is ignored), no shrinking: a failure is reported at
  once with its steps and a ``@reproduce_failure`` blob.  ``HYPOTHESIS_PROFILE=ci-shrink``
  replays the same examples with shrinking, to minimise a CI failure.
* ``explore``: new random examples on every run, 400 per class, full shrinking.  Run it on
  its own, time-boxed, and turn what it finds into an explicit test in
  ``tests/test_state_machine_regressions.py``::

      HYPOTHESIS_PROFILE=explore pytest tests/test_state_machine.py --timeout=1800
      HYPOTHESIS_PROFILE=explore pytest tests/test_state_machine.py --hypothesis-seed=7  # replay
"""

from __future__ import annotations

import asyncio
import collections
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch
from hypothesis import HealthCheck, currently_in_test_context, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

import aiocache_kv as akv
from aiocache_kv.errors import (
    CacheClosedError,
    CapacityError,
    HandleError,
    InvalidInputError,
    InvalidTypeError,
    KVCacheError,
    NotCachedError,
    PinLimitError,
    TransferError,
)
from aiocache_kv.handles import HandleState, InsertResult, MatchResult
from aiocache_kv.hardpins import CachePin, PinState
from aiocache_kv.namespace import Namespace
from aiocache_kv.testing import ManualCopyEngine
from aiocache_kv.transfer import Direction
from aiocache_kv.tree.node import FILLING, RESIDENT
from tests.conftest import small_config
from tests.reference_model import (
    EventLedger,
    KVOracle,
    PrefixModel,
    Tenant,
    Tokens,
    aligned_common,
)


class JumpClockLoop(asyncio.SelectorEventLoop):
    """The machine's event loop: real time plus ``offset``, which the machine raises to
    let time pass (timers that became due run at the next iteration)."""

    def __init__(self) -> None:
        super().__init__()
        self.offset = 0.0

    def time(self) -> float:
        return super().time() + self.offset


# ---------------------------------------------------------------------------- settings

# The active Hypothesis profile (tests/conftest.py: ``ci`` by default, ``explore`` to hunt)
# sets the budget: each of the six machine classes runs ``max_examples`` examples (ci: 6 x 80,
# about 45 s on 2 cores; explore: 6 x 400).
PROFILE = settings(
    settings.default,
    stateful_step_count=40,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

#: the machine's clock (``JumpClockLoop``) jumps ``JUMP`` seconds when it lets time pass:
#: ``SHORT`` pin ttls and retentions lapse at the first jump, ``MEDIUM`` ones at the second,
#: ``LONG`` ones never - whatever real time a run takes.  With ttls of milliseconds on the
#: real clock, a loaded machine expired pins between other steps, so a replayed example took
#: other branches and Hypothesis failed the run as flaky (``FlakyStrategyDefinition``).
JUMP = 10.0
SHORT, MEDIUM, LONG = 5.0, 15.0, 3600.0
DEVICE_PAGES = 12
HOST_PAGES = 16
MAX_LIVE = 4  # live handles; more would pin the whole device pool most of the time
TENANTS: tuple[Tenant, ...] = (None, "tenant-b")
MAX_RELEASED = 8

tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=7)
tenant_st = st.sampled_from(TENANTS)
index_st = st.integers(0, 1 << 16)

BAD_INPUTS = (
    "insert_str_token",
    "insert_float_token",
    "insert_negative_token",
    "insert_empty",
    "insert_not_a_list",
    "insert_float_tensor_tokens",
    "match_none_token",
    "match_empty",
    "slots_float_dtype",
    "slots_2d",
    "slots_list",
    "slots_wrong_length",
    "slots_out_of_range_high",
    "slots_out_of_range_negative",
    "slots_not_from_alloc",
    "slots_owned_by_tree",
    "slots_scrambled",
    "evict_negative",
    "evict_bad_tier",
    "alloc_negative",
    "alloc_bool",
    "free_not_held",
    "release_not_a_handle",
    "device_kv_bad_layer",
    "load_back_released",
    "load_back_insert_handle",
    "pin_bad_ttl",
    "pin_storage_tier",
    "priority_out_of_range",
    "retention_nan",
    "quota_tenant_none",
    "quota_not_a_quota",
)
MAX_PINS = 3  # hard pins the machine holds at once
#: rule -> runs per machine class, over every example (the teardown of a class's test asserts
#: that each of #26's rules ran: a precondition or draw that starves one fails loudly)
COVERAGE: collections.defaultdict[str, collections.Counter[str]] = collections.defaultdict(
    collections.Counter
)
MUST_RUN = ("insert_with_priority", "set_quota", "set_quota_over_budget", "remove_quota")


@dataclass
class Live:
    """A handle the machine holds: its namespace, the tokens it covers and its length."""

    handle: MatchResult | InsertResult
    tenant: Tenant
    tokens: Tokens  #: the query (match) or the inserted page-aligned tokens (insert)
    length: int  #: matched_len / inserted_len when taken; pins keep it
    #: how much of ``tokens`` the handle still keeps matchable after drops (None: length)
    floor: int | None = None


@dataclass
class LoadTask:
    """A ``load_back`` running as a task."""

    task: asyncio.Task[MatchResult]
    live: Live


def _event(name: str) -> None:
    """``hypothesis.event``, and nothing when a rule is called by hand (a replayed sequence)."""
    if currently_in_test_context():
        event(name)


# ---------------------------------------------------------------------------- machine


class HiCacheMachine(RuleBasedStateMachine):
    """Random interleavings of the public API against the reference model."""

    POLICY: ClassVar[str] = "write_through"
    PAGE_SIZE: ClassVar[int] = 1

    def __init__(self) -> None:
        super().__init__()
        self.p = self.PAGE_SIZE
        self.loop = JumpClockLoop()
        self.engine = ManualCopyEngine()
        self.cfg = small_config(
            page_size=self.p,
            write_policy=self.POLICY,
            device_pages=DEVICE_PAGES,
            host_pages=HOST_PAGES,
        )
        self.cache = akv.HiCache(self.cfg, copy_engine=self.engine)
        self.loop.run_until_complete(self.cache.start())
        self.cache._core.tree.deadlines.now = self.loop.time  # retention on the same clock
        self.oracle = KVOracle(
            self.cfg.num_layers, self.cfg.num_kv_heads, self.cfg.head_dim, self.cfg.dtype
        )
        self.model = PrefixModel(self.p)
        self.ledger = EventLedger(self.p)
        self.live: list[Live] = []
        self.released: list[MatchResult | InsertResult] = []
        self.held: list[torch.Tensor] = []  # slots from alloc() the machine still holds
        self.tasks: list[LoadTask] = []
        #: hard pins taken (``cache.pin``), with their namespace and tokens
        self.pins: list[tuple[CachePin, Tenant, Tokens]] = []
        self.seen: list[Tokens] = []  # every token sequence used, for derived sequences
        self.closed = False
        self.steps_since_drain = 0

    # ------------------------------------------------------------------ helpers

    def _run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def _let_time_pass(self) -> None:
        """Jump the loop's clock by :data:`JUMP` and run what became due: short pins
        expire, short retentions lapse (the cache reads retention deadlines on this clock
        too)."""
        self.loop.offset += JUMP
        self._run(asyncio.sleep(0.001))

    def _tick(self, n: int = 4) -> None:
        """Let the loop run callbacks and wake tasks (no time passes)."""

        async def spin() -> None:
            for _ in range(n):
                await asyncio.sleep(0)

        self._run(spin())

    def _snapshot(self) -> tuple[akv.CacheStatistics, int]:
        return self.cache.statistics(), len(self.engine.pending)

    def _absorb(self, insert: tuple[Tenant, Tokens] | None = None) -> None:
        self.ledger.absorb(self.cache.take_events(), insert)

    def _bounds(self, tenant: Tenant, toks: Tokens) -> tuple[int, int]:
        """(lower, upper) for the cached length of ``toks`` in ``tenant``."""
        upper = self.model.upper_bound(tenant, toks)
        lower = 0
        for h in self.live:
            if h.tenant == tenant:
                pinned = h.tokens[: h.length if h.floor is None else h.floor]
                lower = max(lower, aligned_common(pinned, toks, self.p))
        for pin, ptenant, ptoks in self.pins:  # a pin in force keeps its prefix cached
            if ptenant == tenant and pin.state is PinState.ACTIVE:
                lower = max(lower, aligned_common(ptoks[: pin.pinned_len], toks, self.p))
        return lower, upper

    def _write_kv(self, tenant: Tenant, toks: Tokens, slots: torch.Tensor) -> None:
        exp = self.oracle.expected(tenant, toks, len(toks))
        for layer in range(self.cfg.num_layers):
            k, v = self.cache.device_kv(layer)
            k[slots] = exp[layer, 0]
            v[slots] = exp[layer, 1]

    def _check_data(self, h: Live) -> None:
        m = h.handle
        assert isinstance(m, MatchResult)
        d = m.device_len
        idx = m.device_indices
        assert idx.numel() == d, f"device_indices has {idx.numel()} slots for device_len {d}"
        exp = self.oracle.expected(h.tenant, h.tokens, d)
        for layer in range(self.cfg.num_layers):
            k, v = self.cache.device_kv(layer)
            for kv, got in ((0, k[idx]), (1, v[idx])):
                if not torch.equal(got, exp[layer, kv]):
                    bad = [i for i in range(d) if not torch.equal(got[i], exp[layer, kv, i])]
                    raise AssertionError(
                        f"KV mismatch for {h.tenant!r} {h.tokens[:d]} layer {layer} "
                        f"{'KV'[kv]} at token positions {bad} (slots {idx[bad].tolist()})"
                    )

    def _matches(self) -> list[Live]:
        return [h for h in self.live if isinstance(h.handle, MatchResult)]

    def _held_pages(self) -> int:
        return sum(s.numel() for s in self.held) // self.p

    def _pick(self, items: list[Any], i: int) -> Any:
        return items[i % len(items)]

    def _fail_copy(self, j: int) -> None:
        """Fail pending copy ``j``."""
        self.engine.fail(j)

    # ------------------------------------------------------------------ insert / match

    def _insert(
        self, tenant: Tenant, toks: Tokens, keep: bool, priority: int | None = None,
        retention: float | None = None,
    ) -> None:  # fmt: skip
        self.seen.append(toks)
        p = self.p
        n = len(toks) // p * p
        lower, upper = self._bounds(tenant, toks)
        try:
            slots = self.cache.alloc(len(toks))
        except CapacityError:
            return  # every device page pinned or in flight: a legitimate refusal
        self._absorb()  # alloc may have evicted
        self._write_kv(tenant, toks, slots[: len(toks)])
        want = self._insert_stop(tenant, toks, n)
        r = self.cache.insert(
            list(toks), slots[: len(toks)], tenant=tenant, priority=priority, retention=retention
        )
        self._absorb(insert=(tenant, toks[:n]))
        if len(toks) % p:  # the unaligned tail page stays ours
            self.cache.free(slots[n:])
        k = r.inserted_len
        assert k == want, f"inserted_len {k}, expected {want} of {n} for {tenant!r} {toks}"
        if k < n:
            _event("insert: stopped at a node still loading")
            assert any(job.direction is Direction.H2D for job, _ in self.engine.pending), (
                f"insert stopped at {k} of {n} with no load-back in flight"
            )
        # prefix_len counts the walked part only: an insert that stopped at a loading node
        # reports at most that far, even where a live handle pins more of the same tokens
        lower, upper = min(lower, k), min(upper, k)
        assert r.prefix_len % p == 0 and lower <= r.prefix_len <= upper, (
            f"prefix_len {r.prefix_len} outside [{lower}, {upper}] for {toks}"
        )
        self.model.add(tenant, toks[:k])
        self.live.append(Live(r, tenant, toks[:k], k))
        if not keep:
            self._release(self.live[-1])

    def _insert_stop(self, tenant: Tenant, toks: Tokens, n: int) -> int:
        """How much of ``toks[:n]`` an insert caches now: all of it, unless the path meets a
        node whose load-back is in flight (device FILLING).  Nothing may hang below such a node
        on device (a failed load turns it back into host-only), so the insert stops right
        after it (after the last of its load's nodes, when a split cut the load in several),
        or after the part of it that ``toks`` shares, and retains the pages beyond (freed when
        the result is released)."""
        ns = Namespace(self.cfg.namespace, tenant or "")
        node = next((r for r in self.cache._tree.roots() if r.ns == ns), None)
        pos = 0
        loading = False  # the walk is inside a load in flight (its nodes, split or not)
        while node is not None and pos < n:
            parent, node = node, None
            for child in parent.children.values():
                common = aligned_common(child.key, toks[pos:n], self.p)
                if not common:
                    continue
                if loading and child.device is not FILLING:
                    return pos  # nothing hangs below the load
                if child.device is FILLING:
                    if common < len(child.key):
                        return pos + common
                    loading = True
                if common == len(child.key):
                    node = child
                    pos += common
                break
        return pos if loading else n

    def _release(self, h: Live) -> None:
        self.live.remove(h)
        self.cache.release(h.handle)
        assert h.handle.state is HandleState.RELEASED
        self.released.append(h.handle)
        del self.released[:-MAX_RELEASED]

    def _make_room(self) -> None:
        """Keep at most MAX_LIVE - 1 handles before taking a new one (oldest goes first)."""
        while len(self.live) >= MAX_LIVE:
            self._release(self.live[0])

    @rule(toks=tokens_st, tenant=tenant_st, keep=st.booleans())
    def insert(self, toks: list[int], tenant: Tenant, keep: bool) -> None:
        self._make_room()
        self._insert(tenant, tuple(toks), keep)

    @rule(
        toks=tokens_st,
        tenant=tenant_st,
        keep=st.booleans(),
        priority=st.integers(0, 1000),
        retention=st.one_of(st.none(), st.sampled_from([SHORT, MEDIUM, LONG])),
    )
    def insert_with_priority(
        self, toks: list[int], tenant: Tenant, keep: bool, priority: int, retention: float | None
    ) -> None:
        """An insert with a retention priority (lapsing after ``retention`` seconds): the
        model's bounds and the KV oracle hold as for any insert."""
        self._make_room()
        _event(f"insert with priority, retention {retention}")
        self._insert(tenant, tuple(toks), keep, priority, retention)
        COVERAGE[type(self).__name__]["insert_with_priority"] += 1

    @precondition(lambda self: self.seen)
    @rule(
        base=index_st,
        cut=st.integers(0, 7),
        suffix=st.lists(st.integers(0, 2), max_size=4),
        tenant=tenant_st,
        keep=st.booleans(),
    )
    def insert_derived(
        self, base: int, cut: int, suffix: list[int], tenant: Tenant, keep: bool
    ) -> None:
        """A known sequence cut anywhere and extended: splits of existing (busy) nodes."""
        self._make_room()
        toks = self._pick(self.seen, base)[:cut] + tuple(suffix)
        self._insert(tenant, toks or self._pick(self.seen, base), keep)

    def _match(self, tenant: Tenant, toks: Tokens) -> Live:
        self._make_room()
        self.seen.append(toks)
        lower, upper = self._bounds(tenant, toks)
        m = self.cache.match_prefix(list(toks), tenant=tenant)
        n = m.matched_len
        assert n % self.p == 0 and lower <= n <= upper, (
            f"matched {n} outside [{lower}, {upper}] for {tenant!r} {toks}"
        )
        assert m.device_len + m.host_len <= n, m
        dev, host = m.parts()  # the one-walk lengths agree with the node lists
        assert m.lens() == (sum(len(x.key) for x in dev), sum(len(x.key) for x in host)), m
        h = Live(m, tenant, toks, n)
        self._check_data(h)
        self.live.append(h)
        return h

    @rule(toks=tokens_st, tenant=tenant_st)
    def match(self, toks: list[int], tenant: Tenant) -> None:
        self._match(tenant, tuple(toks))

    @precondition(lambda self: self.seen)
    @rule(base=index_st, cut=st.integers(1, 8), tenant=tenant_st)
    def match_known(self, base: int, cut: int, tenant: Tenant) -> None:
        self._match(tenant, self._pick(self.seen, base)[:cut])

    @precondition(lambda self: self.model.inserted)
    @rule(
        base=index_st,
        n=st.integers(1, DEVICE_PAGES),
        tenant=tenant_st,
        settle=st.booleans(),
        load=st.booleans(),
    )
    def demote_then_match(
        self, base: int, n: int, tenant: Tenant, settle: bool, load: bool
    ) -> None:
        """Evict device pages (settling copies around it: write-through acks before, write-back
        stages after), then match an inserted sequence: host hits to load back (at once, if
        ``load``: the round trip device -> host -> device must keep the KV bit-identical)."""
        if settle:
            self.engine.complete_all()
        self.cache.evict(n, "device")
        if settle:
            self.engine.complete_all()
        self._tick()
        known = sorted(self.model.inserted.get(tenant, ())) or sorted(
            t for ts in self.model.inserted.values() for t in ts
        )
        h = self._match(tenant, self._pick(known, base))
        _event(f"demote_then_match: host hit {h.handle.host_len > 0}")  # type: ignore[union-attr]
        if load:
            task = self.loop.create_task(self.cache.load_back(h.handle))  # type: ignore[arg-type]
            self._await_task(LoadTask(task, h), [])

    @precondition(lambda self: self.seen)
    @rule(base=index_st)
    def same_tokens_both_tenants(self, base: int) -> None:
        """Insert the same tokens in both namespaces, then match in each."""
        toks = self._pick(self.seen, base)
        for tenant in TENANTS:
            self._make_room()
            self._insert(tenant, toks, keep=True)
        for tenant in TENANTS:
            self._match(tenant, toks)

    # ------------------------------------------------------------------ release

    @precondition(lambda self: self.live)
    @rule(i=index_st)
    def release(self, i: int) -> None:
        self._release(self._pick(self.live, i))

    @precondition(lambda self: self.released)
    @rule(i=index_st)
    def double_release(self, i: int) -> None:
        handle = self._pick(self.released, i)
        before = self._snapshot()
        with pytest.raises(HandleError):
            self.cache.release(handle)
        assert self._snapshot() == before

    @precondition(lambda self: self.live)
    @rule(i=index_st, what=st.sampled_from(["device_pages", "device_indices"]))
    def scribble_handed(self, i: int, what: str) -> None:
        """What a live handle hands out is the caller's: changing it in place changes nothing
        the cache holds or serves (the invariants and the KV check after every step)."""
        h = self._pick(self.live, i)
        before = self._snapshot()
        getattr(h.handle, what).add_(1 << 20)
        assert self._snapshot() == before

    # ------------------------------------------------------------------ alloc / free

    @precondition(lambda self: len(self.held) < 2)
    @rule(n=st.integers(1, 4))
    def alloc_and_hold(self, n: int) -> None:
        try:
            slots = self.cache.alloc(n)
        except CapacityError:
            return
        assert slots.numel() == -(-n // self.p) * self.p
        self.held.append(slots)

    @precondition(lambda self: self.held)
    @rule(i=index_st)
    def free_held(self, i: int) -> None:
        slots = self.held.pop(i % len(self.held))
        self.cache.free(slots)

    # ------------------------------------------------------------------ hard pins

    @precondition(lambda self: self.seen)
    @rule(
        base=index_st,
        cut=st.integers(1, 8),
        tenant=tenant_st,
        host=st.booleans(),
        short=st.booleans(),
    )
    def pin_known(self, base: int, cut: int, tenant: Tenant, host: bool, short: bool) -> None:
        self.pin(self._pick(self.seen, base)[:cut], tenant, host, short)

    @rule(toks=tokens_st, tenant=tenant_st, host=st.booleans(), short=st.booleans())
    def pin(self, toks: list[int], tenant: Tenant, host: bool, short: bool) -> None:
        while len(self.pins) >= MAX_PINS:
            self.cache.unpin(self.pins.pop(0)[0])
        before = self._snapshot()
        tier = "host" if host else "device"
        try:
            pin = self.cache.pin(toks, ttl=SHORT if short else LONG, tier=tier, tenant=tenant)
        except (NotCachedError, PinLimitError) as exc:
            _event(f"pin refused: {type(exc).__name__}")
            assert self._snapshot() == before, "a refused pin changed the cache"
            return
        _event(f"pin {tier}")
        assert 0 < pin.pinned_len <= len(toks) // self.p * self.p and pin.pinned_len % self.p == 0
        self.pins.append((pin, tenant, toks))

    @precondition(lambda self: self.pins)
    @rule(i=index_st)
    def unpin(self, i: int) -> None:
        pin, _, _ = self.pins.pop(i % len(self.pins))
        active = pin.state is PinState.ACTIVE
        assert self.cache.unpin(pin) is active  # an expired pin: nothing to do
        assert pin.state is (PinState.RELEASED if active else PinState.EXPIRED)

    @precondition(lambda self: self.pins)
    @rule()
    def let_pins_expire(self) -> None:
        self._let_time_pass()
        due = self.loop.time() - 1.0
        for pin, _, _ in self.pins:
            if pin.expires_at <= due:
                assert pin.state is not PinState.ACTIVE, f"{pin!r} outlived its deadline"

    # ------------------------------------------------------------------ drop

    @rule(base=index_st, cut=st.integers(0, 8), tenant=tenant_st, zeroize=st.booleans())
    def drop(self, base: int, cut: int, tenant: Tenant, zeroize: bool) -> None:
        """Drop a known prefix (its last whole page and what continues it) or the tenant:
        nothing of it matches afterwards; live handles keep reading their pages (checked by
        the data invariant), hard pins on them end, and every page comes back once the
        handles are released."""
        p = self.p
        toks = self._pick(self.seen, base)[:cut] if self.seen else None
        if toks is not None and len(toks) < p:
            toks = None
        self._run(self.cache.drop(toks, tenant=tenant, zeroize=zeroize))
        self._absorb()
        _event("drop tenant" if toks is None else "drop prefix")
        keep = 0 if toks is None else (len(toks) // p - 1) * p
        page = None if toks is None else toks[: keep + p]

        def floor(held: Tokens, length: int) -> int:
            if page is None:
                return 0
            return keep if length > keep and held[: keep + p] == page else length

        for h in self.live:
            if h.tenant == tenant:
                h.floor = floor(h.tokens, h.length if h.floor is None else h.floor)
        # a hard pin on dropped pages was ended by the drop (RELEASED); the others hold
        self.pins = [x for x in self.pins if x[0].state is not PinState.RELEASED]
        if toks is not None:
            assert self.cache.cached_len(toks, tenant=tenant) <= keep
        else:
            for seen in self.seen:
                assert self.cache.cached_len(seen, tenant=tenant) == 0, seen

    # ------------------------------------------------------------------ quotas

    @rule(
        tenant=tenant_st,
        # mostly below what a tenant holds, so that a change often finds it over
        device=st.one_of(st.none(), st.integers(0, 2), st.integers(0, DEVICE_PAGES)),
        host=st.one_of(st.none(), st.integers(0, 2), st.integers(0, HOST_PAGES)),
        remove=st.booleans(),
        shrink=st.booleans(),
    )
    def set_quota(
        self, tenant: Tenant, device: int | None, host: int | None, remove: bool, shrink: bool
    ) -> None:
        """Set (small budgets) or remove a tenant's quota, maybe while it is over it: only
        that tenant's pages go, and those of tenants over their own budgets (the pass
        enforces every budget: one held over by pins since may go now); another tenant's
        cached prefixes stay exactly as they were, its own never grow, and handles and pins
        keep theirs (the invariants)."""
        name = tenant or ""
        usage = self.cache.tenant_usage(name)
        if shrink:  # a page below what it holds now: over it at once
            device = usage["device"] - 1 if usage["device"] else device
            host = usage["host"] - 1 if usage["host"] else host
        quota = None if remove else akv.TenantQuota(device_pages=device, host_pages=host)
        known = set(self.seen)
        others = [(t, x, self.cache.cached_len(x, tenant=t)) for t in TENANTS for x in known]
        over_before = {t for t in TENANTS if self._over_budget(t or "")}
        over = quota is not None and (
            (device is not None and usage["device"] > device)
            or (host is not None and usage["host"] > host)
        )
        self.cache.set_tenant_quota(name, quota)
        self._absorb()
        self._tick()  # a pass scheduled by the change runs too
        self._absorb()
        assert self.cache.tenant_quota(name) == quota, (name, quota)
        for t, x, before in others:
            now = self.cache.cached_len(x, tenant=t)
            if t == tenant or t in over_before:
                assert now <= before, f"{t!r} {x}: {before} -> {now} after its quota {quota}"
            else:
                assert now == before, (
                    f"quota {quota} of {tenant!r} changed {t!r} {x}: {before} -> {now}"
                )
        kind = "remove_quota" if remove else "set_quota_over_budget" if over else "set_quota"
        _event(f"quota: {kind}")
        counts = COVERAGE[type(self).__name__]
        counts[kind] += 1
        counts["set_quota"] += kind == "set_quota_over_budget"
        if over:  # enforced at once, best effort against what cannot go (device victims
            # may move to host: write-back stages them there)
            after = self.cache.tenant_usage(name)
            assert after["device"] <= usage["device"], (usage, after, quota)

    def _holding(self) -> list[Tenant]:
        return [t for t in TENANTS if any(self.cache.tenant_usage(t or "").values())]

    @precondition(lambda self: not self.closed and self._holding())
    @rule(i=index_st)
    def quota_below_usage(self, i: int) -> None:
        """A quota a page below what a tenant holds now (so a change finds it over)."""
        self.set_quota(self._pick(self._holding(), i), None, None, remove=False, shrink=True)

    def _over_budget(self, name: str) -> bool:
        quota = self.cache.tenant_quota(name)
        if quota is None:
            return False
        usage = self.cache.tenant_usage(name)
        return any(
            (limit := quota.limit(i)) is not None and usage[tier] > limit
            for i, tier in enumerate(("device", "host"))
        )

    # ------------------------------------------------------------------ eviction

    @rule(tier=st.sampled_from(["device", "host"]), n=st.integers(0, 6))
    def evict(self, tier: str, n: int) -> None:
        before = self.cache.statistics()
        freed = self.cache.evict(n, tier)
        after = self.cache.statistics()
        b, a = (before.device, after.device) if tier == "device" else (before.host, after.host)
        assert freed >= 0 and a.free_pages == b.free_pages + freed, (tier, n, freed, b, a)

    # ------------------------------------------------------------------ copies

    @precondition(lambda self: self.engine.pending)
    @rule(i=index_st, ok=st.sampled_from([True, True, True, False]))
    def finish_copy(self, i: int, ok: bool) -> None:
        j = i % len(self.engine.pending)
        if ok:
            self.engine.complete(j)
        else:
            self._fail_copy(j)
        self._tick()

    @precondition(lambda self: self.engine.pending)
    @rule(order=st.lists(index_st, max_size=6), fail=st.lists(st.booleans(), max_size=6))
    def finish_all_copies(self, order: list[int], fail: list[bool]) -> None:
        """Settle every pending copy, in the drawn order, some failing."""
        while self.engine.pending:
            j = (order.pop() if order else 0) % len(self.engine.pending)
            if fail and fail.pop():
                self._fail_copy(j)
            else:
                self.engine.complete(j)
        self._tick()

    # ------------------------------------------------------------------ load back

    @precondition(lambda self: any(isinstance(h.handle, MatchResult) for h in self.live))
    @rule(i=index_st, start=st.booleans())
    def start_load_back(self, i: int, start: bool) -> None:
        h = self._pick(self._matches(), i)
        _event(f"load_back: started with a host part {h.handle.host_len > 0}")  # type: ignore[union-attr]
        task = self.loop.create_task(self.cache.load_back(h.handle))  # type: ignore[arg-type]
        if start:
            self._tick()
        self.tasks.append(LoadTask(task, h))

    def _settle(self, t: LoadTask) -> None:
        """Check a finished load-back task."""
        task = t.task
        assert task.done()
        if task.cancelled():
            _event("load_back: cancelled")
            return
        exc = task.exception()
        _event(f"load_back: {type(exc).__name__ if exc else 'ok'}")
        if exc is not None:
            if isinstance(exc, HandleError):  # released before the task got to run
                assert t.live.handle.state is HandleState.RELEASED, repr(exc)
                return
            assert isinstance(exc, (TransferError, CapacityError)), repr(exc)
            return
        h = t.live
        assert task.result() is h.handle
        m = h.handle
        assert isinstance(m, MatchResult)
        if m.state is HandleState.PINNED:
            assert m.host_len == 0 and m.device_len == m.matched_len == h.length, (
                f"after load_back {m} (matched {m.matched_len}) is not all on device"
            )
            self._check_data(h)

    @precondition(lambda self: self.tasks)
    @rule(i=index_st)
    def cancel_load_back(self, i: int) -> None:
        t = self.tasks.pop(i % len(self.tasks))
        t.task.cancel()
        self._tick()
        assert t.task.done(), "load_back ignored its cancellation"
        self._settle(t)
        if t.live in self.live:
            assert t.live.handle.state is HandleState.PINNED, "cancel released the match"

    @precondition(lambda self: self.tasks)
    @rule(i=index_st, order=st.lists(index_st, max_size=6))
    def await_load_back(self, i: int, order: list[int]) -> None:
        """Complete pending copies (in the drawn order) until the load-back returns."""
        self._await_task(self.tasks.pop(i % len(self.tasks)), list(order))

    def _await_task(self, t: LoadTask, order: list[int]) -> None:
        self._tick()
        while not t.task.done():
            assert self.engine.pending, "load_back still waiting with no copy pending: hang"
            j = order.pop(0) if order else 0
            self.engine.complete(j % len(self.engine.pending))
            self._tick()
        self._settle(t)

    # ------------------------------------------------------------------ bad input

    def _expect_error(
        self,
        exc_type: type[KVCacheError],
        call: Callable[[], object],
        *,
        insert: bool = False,
        runs_loop: bool = False,
    ) -> None:
        if runs_loop:  # what the loop would do meanwhile happens first: short pins expire,
            # a drop's zeroing (on a thread) hands its pages back
            self._let_time_pass()
            purger = self.cache._purger
            if purger is not None and purger._tasks:
                self._run(asyncio.wait(list(purger._tasks)))
        before = self._snapshot()
        with pytest.raises(exc_type):
            call()
        after = self._snapshot()
        assert after == before, "a rejected call changed the cache"

    @rule(kind=st.sampled_from(BAD_INPUTS), toks=tokens_st, tenant=tenant_st, i=index_st)
    def bad_input(self, kind: str, toks: list[int], tenant: Tenant, i: int) -> None:
        c = self.cache
        p = self.p
        if len(toks) < p:
            toks = toks * p
        n = len(toks)
        expect: type[KVCacheError] = InvalidInputError
        fresh: torch.Tensor | None = None  # slots to hand back afterwards
        tok_arg: Any = toks
        slot_arg: Any = None
        call: Callable[[], object] | None = None

        def need_slots(count: int) -> torch.Tensor | None:
            nonlocal fresh
            try:
                fresh = c.alloc(count)
            except CapacityError:
                return None
            self._absorb()
            return fresh

        if kind.startswith("insert_"):
            slots = need_slots(n)
            if slots is None:
                return
            slot_arg = slots[:n]
            if kind == "insert_str_token":
                tok_arg, expect = [*toks[:-1], "1"], InvalidTypeError
            elif kind == "insert_float_token":
                tok_arg, expect = [*toks[:-1], 1.0], InvalidTypeError
            elif kind == "insert_negative_token":
                tok_arg = [*toks[:-1], -1]
            elif kind == "insert_empty":
                tok_arg, slot_arg = [], slots[:0]
            elif kind == "insert_not_a_list":
                tok_arg, expect = "".join(map(str, toks)), InvalidTypeError
            elif kind == "insert_float_tensor_tokens":
                tok_arg = torch.tensor(toks, dtype=torch.float32)
        elif kind.startswith("match_"):
            arg: Any = [*toks[:-1], None] if kind == "match_none_token" else []
            expect = InvalidTypeError if kind == "match_none_token" else InvalidInputError
            call = lambda: c.match_prefix(arg, tenant=tenant)  # noqa: E731
        elif kind.startswith("slots_"):
            slots = need_slots(n)
            if slots is None:
                return
            slot_arg = slots[:n]
            limit = DEVICE_PAGES * p
            if kind == "slots_float_dtype":
                slot_arg = slot_arg.float()
            elif kind == "slots_2d":
                slot_arg = slot_arg.view(-1, 1)
            elif kind == "slots_list":
                slot_arg, expect = slot_arg.tolist(), InvalidTypeError
            elif kind == "slots_wrong_length":
                slot_arg = slots[: n - 1] if n > 1 else torch.cat([slots, slots])[: n + 1]
            elif kind == "slots_out_of_range_high":
                slot_arg = slot_arg.clone()
                slot_arg[-p:] = torch.arange(limit, limit + p)
            elif kind == "slots_out_of_range_negative":
                slot_arg = slot_arg.clone()
                slot_arg[0] = -1
            elif kind == "slots_not_from_alloc":
                c.free(slots)  # now free pages: not held by us
                fresh = None
            elif kind == "slots_owned_by_tree":
                owned = [
                    h.handle.device_indices
                    for h in self._matches()
                    if h.handle.device_len >= n  # type: ignore[union-attr]
                ]
                if not owned:
                    c.free(slots)
                    return
                slot_arg = self._pick(owned, i)[:n]
                # tokens the tree cannot hold yet, so no slot can be a legitimate duplicate
                tok_arg = [3 + (i % 5)] * n
            elif kind == "slots_scrambled":
                if p == 1:
                    if n < 2:
                        c.free(slots)
                        return
                    slot_arg = slot_arg.clone()
                    slot_arg[1] = slot_arg[0]  # a page twice
                else:  # each page's slots reversed: not the runs alloc() hands out
                    a = n // p * p
                    slot_arg = torch.cat([slots[:a].view(-1, p).flip(1).flatten(), slots[a:n]])
        elif kind == "evict_negative":
            call = lambda: c.evict(-1, "device")  # noqa: E731
        elif kind == "evict_bad_tier":
            call = lambda: c.evict(1, "disk")  # noqa: E731
        elif kind == "alloc_negative":  # alloc(0) is legal: an empty tensor
            call = lambda: c.alloc(-1)  # noqa: E731
        elif kind == "alloc_bool":
            call = lambda: c.alloc(True)  # noqa: E731
        elif kind == "free_not_held":
            slots = need_slots(1)
            if slots is None:
                return
            c.free(slots)
            fresh = None
            call = lambda: c.free(slots)  # noqa: E731
        elif kind == "release_not_a_handle":
            expect = InvalidTypeError
            call = lambda: c.release(object())  # type: ignore[arg-type]  # noqa: E731
        elif kind == "device_kv_bad_layer":
            call = lambda: c.device_kv(self.cfg.num_layers)  # noqa: E731
        elif kind == "load_back_released":
            released = [r for r in self.released if isinstance(r, MatchResult)]
            if not released:
                return
            expect = HandleError
            r = self._pick(released, i)
            call = lambda: self._run(c.load_back(r))  # noqa: E731
        elif kind == "pin_bad_ttl":
            call = lambda: c.pin(toks, ttl=float("nan"), tenant=tenant)  # noqa: E731
        elif kind == "priority_out_of_range":  # outside [0, 1000]
            slots = need_slots(n)
            if slots is None:
                return
            call = lambda: c.insert(toks, slots[:n], tenant=tenant, priority=1001)  # noqa: E731
        elif kind == "retention_nan":
            slots = need_slots(n)
            if slots is None:
                return
            nan = float("nan")
            call = lambda: c.insert(toks, slots[:n], priority=5, retention=nan)  # noqa: E731
        elif kind == "quota_tenant_none":  # the default tenant is "", None is refused
            expect = InvalidTypeError
            call = lambda: c.set_tenant_quota(None, akv.TenantQuota(1))  # type: ignore[arg-type]  # noqa: E731
        elif kind == "quota_not_a_quota":
            expect = InvalidTypeError
            call = lambda: c.set_tenant_quota("", {"device_pages": 1})  # type: ignore[arg-type]  # noqa: E731
        elif kind == "pin_storage_tier":
            call = lambda: c.pin(toks, ttl=1.0, tier="storage", tenant=tenant)  # noqa: E731
        elif kind == "load_back_insert_handle":
            inserts = [h.handle for h in self.live if isinstance(h.handle, InsertResult)]
            if not inserts:
                return
            expect = InvalidTypeError
            r2 = self._pick(inserts, i)
            call = lambda: self._run(c.load_back(r2))  # type: ignore[arg-type]  # noqa: E731
        else:  # pragma: no cover - a kind without a case is a bug in this test
            raise AssertionError(kind)
        insert = call is None
        if call is None:
            call = lambda: c.insert(tok_arg, slot_arg, tenant=tenant)  # noqa: E731
        self._expect_error(expect, call, insert=insert, runs_loop=kind.startswith("load_back"))
        if fresh is not None:
            c.free(fresh)

    # ------------------------------------------------------------------ drain / leaks

    def _drain(self, fail: list[bool]) -> None:
        """Cancel, release, settle and evict everything; then every page must be free."""
        for t in self.tasks:
            t.task.cancel()
        self._tick()
        for t in self.tasks:
            assert t.task.done(), "load_back ignored its cancellation"
            self._settle(t)
        self.tasks.clear()
        for pin, _, _ in self.pins:
            self.cache.unpin(pin)
        self.pins.clear()
        for h in self.live:
            self.cache.release(h.handle)
        self.live.clear()
        for s in self.held:
            self.cache.free(s)
        self.held.clear()
        for _ in range(64):
            while self.engine.pending:
                if fail and fail.pop():
                    self._fail_copy(0)
                else:
                    self.engine.complete(0)
                self._tick()
            self._flush()
            freed = self.cache.evict(1 << 30, "device") + self.cache.evict(1 << 30, "host")
            if not freed and not self.engine.pending:
                break
        self._absorb()
        s = self.cache.statistics()
        assert s.ops_in_flight == 0, s
        assert s.nodes == 0, f"{s.nodes} nodes survive a full eviction: {self.cache!r}"
        for tier in (s.device, s.host):
            assert tier.free_pages == tier.total_pages, f"pages leaked: {tier}"
            assert tier.held_pages == tier.evictable_pages == tier.protected_pages == 0, tier
        for medium, hashes in self.ledger.resident.items():
            assert not hashes, f"{len(hashes)} blocks still stored on {medium} per events"

    def _flush(self) -> None:
        """``flush``, completing the copies it waits for: a quota pass that runs meanwhile may
        stage write-backs (the hand-driven engine completes nothing by itself)."""
        task = self.loop.create_task(self.cache.flush())
        for _ in range(2000):
            if task.done():
                task.result()
                return
            if self.engine.pending:
                self.engine.complete(0)
                self._tick()
            else:  # zeroing on a thread, or nothing left: let time pass
                self._run(asyncio.wait([task], timeout=0.005))
        raise AssertionError(f"flush hangs with nothing pending: {self.cache!r}")

    @precondition(lambda self: self.steps_since_drain >= 12)
    @rule(fail=st.lists(st.booleans(), max_size=4))
    def drain_and_check_no_leaks(self, fail: list[bool]) -> None:
        self._drain(fail)
        self.steps_since_drain = 0

    # ------------------------------------------------------------------ invariants

    def _settle_background(self) -> None:
        """Let the loop's background work end before the next step: a drop's reap (a
        ``call_soon``) and its zeroing (a worker thread) free pages when the thread is done,
        so without this wait a replayed example could find another pool (more or fewer free
        pages) at its next step, take other branches, and fail as flaky under load."""
        self._tick()
        zeroing = self.cache._core.zeroing
        while zeroing:
            self._run(asyncio.wait(list(zeroing)))
            self._tick()

    @invariant()
    def cache_invariants(self) -> None:
        """(Runs first of the invariants: they run in name order.)"""
        if self.closed:
            return
        self._settle_background()
        self.steps_since_drain += 1  # runs once per step: the drain rule's step counter
        self.cache.check_invariants()
        self._absorb()
        s = self.cache.statistics()
        d, h = s.device, s.host
        assert d.total_pages == DEVICE_PAGES and h.total_pages == HOST_PAGES
        dev_pages = d.free_pages + d.held_pages + d.evictable_pages + d.protected_pages
        # retained by insert results; quarantined while a drop's zeroing holds them
        assert dev_pages + d.retained_pages + d.quarantined_pages == d.total_pages, d
        assert d.held_pages == self._held_pages(), (d, self._held_pages())
        assert h.held_pages == 0 and (
            h.free_pages + h.evictable_pages + h.protected_pages + h.quarantined_pages
            == h.total_pages
        ), h
        assert s.ops_in_flight == len(self.engine.pending), s

    @invariant()
    def pins_keep_their_prefix(self) -> None:
        if self.closed:
            return
        for pin, tenant, toks in self.pins:
            if pin.state is PinState.ACTIVE:
                cached = self.cache.cached_len(toks, tenant=tenant)
                assert cached >= pin.pinned_len, (pin, cached)

    @invariant()
    def handles_keep_their_prefix_and_data(self) -> None:
        if self.closed:
            return
        for h in self.live:
            assert h.handle.state is HandleState.PINNED
            if isinstance(h.handle, MatchResult):
                assert h.handle.matched_len == h.length, (h.handle, h.length)
                self._check_data(h)

    @invariant()
    def events_agree_with_tiers(self) -> None:
        """White-box: blocks stored per medium (from events) == pages resident per tier."""
        if self.closed:
            return
        self._absorb()
        tree = self.cache._tree
        gpu: set[int] = set()
        cpu: set[int] = set()
        for node in tree.walk():
            if node.device is RESIDENT:
                gpu.update(tree.block_hashes(node))
            if node.host is RESIDENT and not node.cpu_hidden:  # hidden: parent not on CPU
                cpu.update(tree.block_hashes(node))
                up = node.parent
                assert up is not None
                assert up.parent is None or (up.host is RESIDENT and not up.cpu_hidden), (
                    f"CPU block announced below a parent not announced on CPU: {node!r}"
                )
            elif node.host is RESIDENT:
                up = node.parent
                assert up is not None and up.parent is not None
                assert up.host is not RESIDENT or up.cpu_hidden, f"{node!r} hidden for nothing"
        for medium, want in (("GPU", gpu), ("CPU", cpu)):
            got = self.ledger.resident[medium]
            assert got == want, (
                f"{medium}: events say {len(got)} blocks, tree has {len(want)}; "
                f"missing events for {[self.ledger.owner.get(x) for x in want - got]}, "
                f"stale {[self.ledger.owner.get(x) for x in got - want]}"
            )

    # ------------------------------------------------------------------ teardown

    def teardown(self) -> None:
        clean = sys.exc_info()[0] is None  # teardown also runs while a failure propagates
        try:
            if clean:
                self._drain([])
        finally:
            self._close(strict=clean)

    def _close(self, *, strict: bool) -> None:
        try:
            for t in self.tasks:
                t.task.cancel()
            self._tick()
            self._run(self.cache.aclose())
            self.closed = True
            if strict:
                with pytest.raises(CacheClosedError):
                    self.cache.match_prefix([0])
                assert not self.engine.pending
        except Exception:
            if strict:
                raise
        finally:
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.run_until_complete(self.loop.shutdown_default_executor())
            self.loop.close()


# ---------------------------------------------------------------------------- variants


def _variant(policy: str, page_size: int) -> type[HiCacheMachine]:
    name = f"HiCacheMachine_{policy}_p{page_size}"
    cls = type(name, (HiCacheMachine,), {"POLICY": policy, "PAGE_SIZE": page_size})
    base = cls.TestCase

    class TestCase(base):  # type: ignore[valid-type,misc]
        settings = PROFILE

        def runTest(self) -> None:
            COVERAGE.pop(name, None)
            super().runTest()
            ran = COVERAGE[name]
            starved = [r for r in MUST_RUN if not ran[r]]
            assert not starved, f"{name}: rules never ran over the examples: {starved} ({ran})"

    TestCase.__name__ = TestCase.__qualname__ = f"{name}.TestCase"
    cls.TestCase = TestCase  # type: ignore[misc]
    return cls


WriteThroughP1 = _variant("write_through", 1)
WriteThroughP2 = _variant("write_through", 2)
SelectiveP1 = _variant("write_through_selective", 1)
SelectiveP2 = _variant("write_through_selective", 2)
WriteBackP1 = _variant("write_back", 1)
WriteBackP2 = _variant("write_back", 2)

TestWriteThroughP1 = WriteThroughP1.TestCase
TestWriteThroughP2 = WriteThroughP2.TestCase
TestSelectiveP1 = SelectiveP1.TestCase
TestSelectiveP2 = SelectiveP2.TestCase
TestWriteBackP1 = WriteBackP1.TestCase
TestWriteBackP2 = WriteBackP2.TestCase


# ---------------------------------------------------------------------------- regressions
# Minimal repros of library bugs the machine found (now fixed).


async def test_rejected_insert_leaves_namespaces_unchanged() -> None:
    async with akv.HiCache(small_config(), copy_engine=ManualCopyEngine()) as cache:
        slots = cache.alloc(2)
        cache.free(slots)  # now not held by the caller
        before = cache.statistics()
        with pytest.raises(InvalidInputError):
            cache.insert([0, 1], slots, tenant="fresh")
        assert cache.statistics() == before  # namespaces 0 -> 1


async def test_failed_load_back_under_device_child() -> None:
    engine = ManualCopyEngine()
    async with akv.HiCache(small_config(page_size=1), copy_engine=engine) as cache:
        r = cache.insert([0], cache.alloc(1))  # write-through copy pending
        engine.complete(0)  # [0] on device and host
        cache.release(r)
        assert cache.evict(1, "device") == 1  # demoted: host-only
        m = cache.match_prefix([0])
        task = asyncio.create_task(cache.load_back(m))
        await asyncio.sleep(0)  # load-back submitted: [0] is device FILLING
        r2 = cache.insert([0, 0], cache.alloc(2))  # stops at the FILLING node
        assert r2.inserted_len == 1 and cache.statistics().device.held_pages == 0
        cache.check_invariants()
        engine.fail(0)  # back to host-only: nothing was hung below it on device
        with pytest.raises(TransferError):
            await task
        cache.check_invariants()
        cache.release(m)
        cache.release(r2)
