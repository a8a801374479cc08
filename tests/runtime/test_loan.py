"""PromptLoan: a request's own chunk decides its loan (seed #2090), halving instead of exiting, every slot returned."""

from __future__ import annotations

import numpy as np

from strata_core.runtime.cache import ExpertCache
from strata_core.runtime.loan import Loan, NoLoan, PromptLoan
from strata_core.runtime.runlog import RunLog

from .plans import scenario_plan

LARGER = "is larger than the auto chunk's"


def _cache_for(plan) -> ExpertCache:
    m = plan.model
    c = ExpertCache(plan.expert_cache.slots, m.moe_layers, m.experts_per_layer)
    c.place(np.arange(c.slots))
    # a heat gradient: slot i holds an expert used i times, so the coldest end is the low slots
    c.lookup(0, np.arange(min(c.slots, m.experts_per_layer)), tokens=np.arange(min(c.slots, m.experts_per_layer)))
    return c


def test_seed_2090_a_smaller_request_chunk_with_a_larger_loan_is_lent_and_logged_once():
    _, plan = scenario_plan("seed2090-rtx4070ti-reserve700.json")
    auto = plan.loan_for(plan.prompt.chunk).loan_slots
    chunk = plan.request_chunk(4000)
    need = plan.loan_for(chunk).loan_slots
    assert chunk < plan.prompt.chunk and need > auto, "the scenario must hold the seed's non-monotonic case"
    cache, log = _cache_for(plan), RunLog()
    loans = PromptLoan(plan, cache, log)
    for _ in range(2):
        loan = loans.lend(4000)
        assert isinstance(loan, Loan)
        assert loan.chunk_tokens == chunk and loan.halvings == 0 and loan.larger_than_auto
        assert loan.loan_slots == need, "sized by the request's chunk, not by the auto chunk's loan"
        assert len(loan.ring) == plan.loan_for(chunk).ring_slots
        assert cache.slots_on_loan == need
        loans.give_back(loan)
        assert cache.slots_on_loan == 0
    lines = log.lines_matching(LARGER)
    assert lines == [f"the loan for a chunk of {chunk} tokens ({need} slots) is larger than the auto chunk's "
                     f"({auto} slots): lent from further down the cache"]
    assert loans.halvings == 0 and loans.loans == 2
    cache.check()


def test_loans_come_from_the_coldest_end():
    _, plan = scenario_plan("seed2090-rtx4070ti-reserve700.json")
    cache = ExpertCache(plan.expert_cache.slots, plan.model.moe_layers, plan.model.experts_per_layer)
    cache.place(np.arange(cache.slots))
    hot = np.arange(cache.slots - 100, cache.slots)
    cache.lookup(0, hot % plan.model.experts_per_layer + 0, tokens=np.full(100, 50.0))  # the last 100 rows are hot
    loan = PromptLoan(plan, cache, RunLog()).lend(6000)
    assert not np.isin(loan.slots, cache.slot_of[hot]).any(), "a hot expert's slot was lent"


def test_a_loan_that_cannot_be_lent_halves_the_chunk_for_this_request_and_never_raises():
    _, plan = scenario_plan("seed2090-rtx4070ti-reserve700.json")
    cache, log = _cache_for(plan), RunLog()
    # another holder keeps slots so the plan's chunk cannot be lent now (as a cache shrunk by a failing start would)
    held = cache.lend(plan.expert_cache.slots - plan.prompt.min_keep_slots - plan.loan_for(2048).loan_slots)
    available = cache.available_slots
    assert plan.loan_for(plan.request_chunk(6000)).loan_slots > available
    loans = PromptLoan(plan, cache, log)
    loan = loans.lend(6000)
    assert isinstance(loan, Loan)
    assert loan.halvings >= 1 and loan.chunk_tokens <= plan.request_chunk(6000) // 2
    assert loan.loan_slots <= available
    assert loan.loan_slots == plan.loan_for(loan.chunk_tokens).loan_slots
    assert len(log.lines_matching("cannot be lent")) == 1, "one line per request, however many halvings"
    assert loans.halvings == loan.halvings
    loans.give_back(loan)
    cache.give_back(held)
    assert cache.slots_on_loan == 0
    cache.check()


def test_when_nothing_can_be_lent_the_request_reads_unlent_in_workspace_chunks():
    _, plan = scenario_plan("seed2090-rtx4070ti-reserve700.json")
    cache, log = _cache_for(plan), RunLog()
    held = cache.lend(cache.slots - 10)
    loan = PromptLoan(plan, cache, log).lend(20000)
    assert isinstance(loan, NoLoan) and loan.loan_slots == 0
    assert 0 < loan.chunk_tokens <= plan.prompt.stream_min_tokens
    assert log.lines_matching("without a loan")
    cache.give_back(held)


def test_short_prompts_are_read_without_a_loan():
    _, plan = scenario_plan("seed1756-rtx3090-windows-pinned.json")
    cache = _cache_for(plan)
    loans = PromptLoan(plan, cache, RunLog())
    loan = loans.lend(300)
    assert isinstance(loan, NoLoan) and cache.slots_on_loan == 0
    loans.give_back(loan)
    assert loans.loans == 0
