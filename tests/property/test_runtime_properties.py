"""The runtime's bookkeeping under random plans and request streams.

- the prompt loan never lends more than it has, always gets back what it lent, and never halves a chunk the plan
  proved (seed #2090);
- the expert cache's hits and misses add up against an independent model of which expert is in which slot;
- the pinned pool never exceeds its budget, grows each buffer once, and logs each fallback once (seed #1756).
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, assume, event, given, settings as hyp_settings
from hypothesis import strategies as st
from prop_strategies import devices, hosts, models, platform_defaults, prompt_lengths, settings

from strata_core.api.backend import PinnedBudget
from strata_core.errors import PlanRefused
from strata_core.planner import make_plan
from strata_core.runtime.cache import EMPTY, ExpertCache
from strata_core.runtime.loan import Loan, NoLoan, PromptLoan
from strata_core.runtime.pinned import PinnedPool
from strata_core.runtime.runlog import RunLog
from strata_core.builtin.sim import FaultPlan, SimPinnedAllocator

MIB = 1 << 20


class CacheModel:
    """An independent record of slot -> expert row, kept from what the cache's calls return."""

    def __init__(self):
        self.row_in: dict[int, int] = {}

    def resident(self) -> set[int]:
        """Rows held by some slot."""
        return set(self.row_in.values())

    def emptied(self, slots) -> None:
        """These slots hold nothing now (lent, trimmed)."""
        for s in np.asarray(slots, dtype=np.int64).tolist():
            self.row_in.pop(s, None)

    def filled(self, slots, rows) -> None:
        """These slots hold these rows now (EMPTY slots are skipped)."""
        for s, r in zip(np.asarray(slots).tolist(), np.asarray(rows).tolist()):
            if s != EMPTY:
                self.row_in[s] = r


def _activity(cache: ExpertCache, model: CacheModel, data, forbidden: frozenset = frozenset()) -> None:
    """Random decode-like traffic: lookups, admissions of the misses, ticks; checks hits against the model."""
    for _ in range(data.draw(st.integers(0, 4), label="steps")):
        layer = data.draw(st.integers(0, cache.layers - 1), label="layer")
        k = data.draw(st.integers(1, min(8, cache.experts_per_layer)), label="k")
        experts = np.array(data.draw(st.lists(st.integers(0, cache.experts_per_layer - 1), min_size=k, max_size=k),
                                     label="experts"), dtype=np.int64)
        rows = cache.row(layer, experts)
        expected_hits = sum(1 for r in rows.tolist() if r in model.resident())
        h0, m0 = cache.hits, cache.misses
        slots = cache.lookup(layer, experts)
        assert cache.hits - h0 == expected_hits
        assert (cache.hits - h0) + (cache.misses - m0) == len(experts)
        for s, r in zip(slots.tolist(), rows.tolist()):
            if s != EMPTY:
                assert model.row_in[s] == r and s not in forbidden
        miss = np.unique(experts[slots == EMPTY])
        if len(miss):
            got = cache.admit(layer, miss, keep=slots[slots != EMPTY])
            assert not set(got.tolist()) & forbidden, "an expert was admitted into a slot on loan"
            assert not set(got.tolist()) & set(slots[slots != EMPTY].tolist()), "a hit of this step was evicted"
            model.filled(got, cache.row(layer, miss))
        cache.tick()
        cache.check()


def _plan_or_skip(device, host, model, s, defaults):
    try:
        plan = make_plan(device, host, model, s, defaults)
    except PlanRefused:
        assume(False)
    assume(not plan.prompt.owned_buffers and plan.expert_cache.slots > 0)
    return plan


@hyp_settings(max_examples=150, deadline=None,
              suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow, HealthCheck.data_too_large])
@given(device=devices(), host=hosts(), model=models(), s=settings(), defaults=platform_defaults(),
       requests=st.lists(prompt_lengths(), min_size=1, max_size=6), data=st.data())
def test_the_prompt_loan_lends_what_it_has_gets_it_back_and_never_halves_a_proven_chunk(
        device, host, model, s, defaults, requests, data):
    plan = _plan_or_skip(device, host, model, s, defaults)
    cache = ExpertCache(plan.expert_cache.slots, model.moe_layers, model.experts_per_layer)
    cmodel = CacheModel()
    cmodel.filled(cache.place(np.arange(min(cache.slots, model.experts_total))),
                  np.arange(min(cache.slots, model.experts_total)))
    log = RunLog()
    loans = PromptLoan(plan, cache, log)
    auto = plan.loan_for(plan.prompt.chunk).loan_slots
    larger_chunks: set[int] = set()
    for prompt_tokens in requests:
        _activity(cache, cmodel, data)
        before = cache.available_slots
        loan = loans.lend(prompt_tokens)
        if not plan.streams(prompt_tokens):
            assert isinstance(loan, NoLoan) and cache.slots_on_loan == 0
            continue
        assert isinstance(loan, Loan), f"a {prompt_tokens}-token request the plan proved was not lent: {loan}"
        event("lent" + (", larger than auto" if loan.loan_slots > auto else ""))
        assert loan.halvings == 0 and loan.chunk_tokens == plan.request_chunk(prompt_tokens)
        lent = loan.slots.tolist()
        assert len(lent) == len(set(lent)) == loan.loan_slots == plan.loan_for(loan.chunk_tokens).loan_slots
        assert loan.loan_slots <= before and all(0 <= x < cache.slots for x in lent)
        assert cache.slots - loan.loan_slots >= plan.prompt.min_keep_slots
        assert cache.slots_on_loan == loan.loan_slots
        assert (cache.expert_in[loan.slots] == EMPTY).all(), "a lent slot still holds an expert"
        cmodel.emptied(loan.slots)
        if loan.loan_slots > auto:
            larger_chunks.add(loan.chunk_tokens)
        _activity(cache, cmodel, data, forbidden=frozenset(lent))  # the prompt runs while the slots are lent
        loans.give_back(loan)
        assert cache.slots_on_loan == 0 and cache.available_slots == cache.slots
        cache.check()
    said = log.lines_matching("is larger than the auto chunk's")
    assert len(said) == len(larger_chunks), "each larger-than-auto chunk is said exactly once"


@hyp_settings(max_examples=150, deadline=None,
              suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow, HealthCheck.data_too_large])
@given(device=devices(), host=hosts(), model=models(), s=settings(), defaults=platform_defaults(),
       requests=st.lists(prompt_lengths(), min_size=1, max_size=6),
       shrink_to=st.one_of(st.floats(0.6, 1.0), st.floats(0.0, 1.0)))
def test_a_loan_that_no_longer_fits_halves_or_reads_unlent_and_never_overlends(
        device, host, model, s, defaults, requests, shrink_to):
    """The cache can lose slots after planning (elastic trimming, another request's loan): the loan halves."""
    plan = _plan_or_skip(device, host, model, s, defaults)
    slots = max(1, int(plan.expert_cache.slots * shrink_to))
    cache = ExpertCache(slots, model.moe_layers, model.experts_per_layer)
    log = RunLog()
    loans = PromptLoan(plan, cache, log)
    for prompt_tokens in requests:
        loan = loans.lend(prompt_tokens)
        if isinstance(loan, Loan):
            assert loan.loan_slots <= slots and slots - loan.loan_slots >= plan.prompt.min_keep_slots
            assert loan.chunk_tokens <= plan.request_chunk(prompt_tokens)
            assert len(set(loan.slots.tolist())) == loan.loan_slots
            if loan.halvings:
                assert log.lines_matching("cannot be lent")
            event(f"lent after {min(loan.halvings, 2)}+ halvings")
        else:
            assert cache.slots_on_loan == 0
            event(f"not lent: {loan.why}")
        loans.give_back(loan)
        assert cache.slots_on_loan == 0


@hyp_settings(max_examples=150, deadline=None)
@given(limit=st.integers(0, 64 * MIB), floor=st.integers(0, 16 * MIB),
       pinnable=st.one_of(st.none(), st.integers(0, 64 * MIB)), from_floor=st.booleans(),
       fault=st.sampled_from([None, "pinned-alloc:every", "pinned-alloc:nth=1", "pinned-alloc:nth=3"]),
       ops=st.lists(st.tuples(st.sampled_from(["cpu_x", "cpu_rows", "staging"]), st.integers(0, 24 * MIB)),
                    max_size=12))
def test_the_pinned_pool_never_exceeds_its_budget_grows_once_and_falls_back_once(limit, floor, pinnable, from_floor,
                                                                                 fault, ops):
    budget = PinnedBudget(limit_bytes=limit, floor_bytes=min(floor, limit))
    faults = FaultPlan.parse([fault] if fault else [])
    alloc = SimPinnedAllocator(budget, pinnable, faults=faults, accounting_only=True)
    log = RunLog()
    pool = PinnedPool(alloc, budget, log, from_floor=from_floor, name="cpu share")
    first_size: dict[str, int] = {}
    for key, nbytes in ops:
        buf = pool.reserve(key, nbytes)
        cap = budget.limit_bytes if from_floor else budget.limit_bytes - budget.floor_bytes
        assert budget.used_bytes <= cap and budget.used_bytes == pool.held_bytes == alloc.locked_bytes
        if pinnable is not None:
            assert alloc.locked_bytes <= pinnable
        if buf is not None:
            first_size.setdefault(key, buf.nbytes)
            assert buf.nbytes >= nbytes and buf.nbytes == first_size[key]
            assert pool.reserve(key, nbytes) is buf
        elif key in first_size:
            assert nbytes > first_size[key]  # only a larger ask of a grown buffer is refused
    keys = [k for k, _ in pool.allocations]
    assert len(keys) == len(set(keys)), "a buffer was allocated twice"
    whats = [f.what for f in log.fallbacks]
    assert len(whats) == len(set(whats)), "a fallback was logged more than once"
    pool.close()
    assert budget.used_bytes == 0 and alloc.locked_bytes == 0
