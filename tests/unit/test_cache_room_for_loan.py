"""A cache that holds every expert grows by the slots its chunk borrows, so lending the prompt path evicts nothing."""

from __future__ import annotations

import numpy as np

from strata_core.api.facts import GIB, DeviceInfo, HostInfo, PlatformDefaults
from strata_core.config.settings import StrataSettings
from strata_core.models.synthetic import tiny_model_spec
from strata_core.planner import make_plan
from strata_core.runtime.cache import EMPTY, ExpertCache
from strata_core.runtime.loan import PromptLoan
from strata_core.runtime.runlog import RunLog

BIG = DeviceInfo(backend="sim", name="80 GiB card", vram_total_bytes=80 * GIB, vram_free_bytes=80 * GIB)
HOST = HostInfo(os="linux", ram_total_bytes=64 * GIB, ram_available_bytes=64 * GIB)


def _plan(device=BIG, **memory):
    s = StrataSettings()
    for k, v in memory.items():
        setattr(s.memory, k, v)
    return make_plan(device, HOST, tiny_model_spec(), s, PlatformDefaults())


def _max_loan(plan) -> int:
    return max(r.loan_slots for r in plan.prompt.loans)


def test_auto_cache_on_a_large_card_holds_every_expert_plus_the_largest_loan():
    plan, total = _plan(), tiny_model_spec().experts_total
    loan = _max_loan(plan)
    assert loan > 0 and not plan.prompt.owned_buffers
    assert plan.expert_cache.slots == total + loan
    assert plan.prompt.lendable_slots >= loan
    assert plan.vram.expert_cache_bytes == (total + loan) * plan.expert_cache.slot_bytes
    said = [d for d in plan.decisions if d.what == "expert_cache.slots" and "evicts no expert" in d.why]
    assert said and said[-1].value == total + loan and said[-1].source == "core"


def test_an_explicit_cache_above_every_expert_is_kept_up_to_the_loan():
    total = tiny_model_spec().experts_total
    loan = _max_loan(_plan())
    assert _plan(expert_cache=total + loan).expert_cache.slots == total + loan
    assert _plan(expert_cache=total + loan // 2).expert_cache.slots == total + loan // 2
    assert _plan(expert_cache=total + loan + 100).expert_cache.slots == total + loan
    assert _plan(expert_cache=total).expert_cache.slots == total


def test_vram_that_leaves_only_part_of_the_loan_grows_the_cache_by_that_part():
    auto = _plan()
    total, loan, slot = tiny_model_spec().experts_total, _max_loan(auto), auto.expert_cache.slot_bytes
    # the same card with VRAM for every expert and half the loan, all else unchanged
    short = (loan - loan // 2) * slot
    dev = DeviceInfo(backend="sim", name="tight card", vram_total_bytes=BIG.vram_total_bytes - short,
                     vram_free_bytes=BIG.vram_free_bytes - (auto.vram.left_bytes + short))
    plan = _plan(dev)
    assert total <= plan.expert_cache.slots < total + loan
    assert plan.vram.left_bytes < slot


def test_lending_the_largest_loan_from_a_full_cache_evicts_no_expert():
    plan, model = _plan(), tiny_model_spec()
    cache = ExpertCache(plan.expert_cache.slots, model.moe_layers, model.experts_per_layer)
    cache.place(np.arange(model.experts_total))
    chunk = max(plan.prompt.loans, key=lambda r: r.loan_slots).chunk
    loan = PromptLoan(plan, cache, RunLog()).lend(chunk)
    assert loan.loan_slots == _max_loan(plan)
    assert (cache.slot_of[: model.experts_total] != EMPTY).all(), "lending evicted an expert"
