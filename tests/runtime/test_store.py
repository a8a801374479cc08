"""ExpertStore pinning: whole when it can, else slices up to the plan's arena with the budget marked exhausted."""

from __future__ import annotations

import numpy as np

from strata_core.api.backend import PinnedBudget
from strata_core.reference.kernels import ExpertPool
from strata_core.runtime.runlog import RunLog
from strata_core.runtime.store import ExpertStore, phantom_pool_of_bytes
from strata_core.builtin.sim import FaultPlan, SimPinnedAllocator

MIB = 1 << 20


def _store(rows=64, hidden=32, ffn=32) -> ExpertStore:
    specs = ExpertPool.array_specs("f16", rows, hidden, ffn)
    pool = ExpertPool("f16", {k: np.zeros(shape, dt) for k, (shape, dt) in specs.items()})
    return ExpertStore(pool, layers=4, experts_per_layer=rows // 4)


def test_the_whole_arena_is_registered_when_it_fits():
    st, log = _store(), RunLog()
    budget = PinnedBudget(64 * MIB, 1 * MIB)
    st.pin(SimPinnedAllocator(budget, None), budget, 63 * MIB, log)
    assert st.whole and st.pinned_fraction == 1.0 and not budget.exhausted
    assert budget.used_bytes == st.nbytes
    st.close()
    assert budget.used_bytes == 0


def test_a_failed_whole_registration_marks_exhausted_and_pins_slices_up_to_the_arena():
    st, log = _store(), RunLog()
    budget = PinnedBudget(64 * MIB, 1 * MIB)
    faults = FaultPlan.parse([f"arena-register:above={st.nbytes // 2}"])
    arena = st.nbytes * 3 // 4
    st.pin(SimPinnedAllocator(budget, None, faults=faults), budget, arena, log)
    assert budget.exhausted, "a failed whole-arena registration must be carried forward"
    assert not st.whole and 0 < st.pinned_bytes <= arena
    assert budget.used_bytes == st.pinned_bytes
    assert len(log.fallbacks) == 1 and "FAILED" in log.fallbacks[0].why and "slices" in log.fallbacks[0].why


def test_an_arena_larger_than_the_plan_allows_is_pinned_in_part_as_the_seed_describes():
    # the seed's 3090: a 33 GiB arena on a host that can lock less; accounting-only phantoms
    rows, slot = 48 * 512, 1439000
    st, log = ExpertStore(phantom_pool_of_bytes(rows, slot), 48, 512), RunLog()
    budget = PinnedBudget(8 << 30, 512 * MIB)
    st.pin(SimPinnedAllocator(budget, 30 << 30, accounting_only=True), budget, (8 << 30) - 512 * MIB, log)
    assert budget.exhausted and not st.whole
    assert st.pinned_bytes <= (8 << 30) - 512 * MIB and budget.left_bytes >= 512 * MIB, "the floor is kept"
    assert len(log.lines) == 1


def test_no_allocator_means_pageable_with_one_line():
    st, log = _store(), RunLog()
    st.pin(None, PinnedBudget(64 * MIB, 0), 64 * MIB, log)
    assert st.pinned_bytes == 0 and len(log.fallbacks) == 1
