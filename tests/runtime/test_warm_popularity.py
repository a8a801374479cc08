"""The engine's warm-up places the most popular experts first: the routers' own choice (weights), the synthetic
routing law (accounting mode); equal popularity keeps the expert-major order it had before."""

from __future__ import annotations

import numpy as np

from strata_core.api.backend import PinnedBudget
from strata_core.builtin.sim import FaultPlan, SimPinnedAllocator
from strata_core.builtin.sim.memory import SimDeviceMemory
from strata_core.models.synthetic import generate_weights, tiny_cache_slots, tiny_model_spec
from strata_core.reference.kernels import ReferenceKernels
from strata_core.runtime.engine import Engine, warm_order
from strata_core.runtime.runlog import RunLog

from .plans import sim_plan


def test_equal_popularity_keeps_the_expert_major_order():
    L, E = 3, 5
    order = warm_order(np.full((L, E), 1.0 / E))
    assert order.tolist() == [layer * E + e for e in range(E) for layer in range(L)]


def test_the_most_popular_rows_come_first_ties_expert_major():
    pop = np.array([[0.1, 0.6, 0.3], [0.3, 0.3, 0.4]])
    # 0.3 ties: rows 3 (expert 0 of layer 1), 4 (expert 1), 2 (expert 2 of layer 0), as expert-major lists them
    assert warm_order(pop).tolist() == [1, 5, 3, 4, 2, 0]


def _engine(weights, slots: int, accounting: bool = False) -> Engine:
    _, plan = sim_plan(weights.spec, {"memory": {"expert_cache": slots}})
    budget = PinnedBudget(plan.pinned.limit_bytes, plan.pinned.floor_bytes)
    fp = FaultPlan.parse([])
    return Engine(plan, dm=SimDeviceMemory(plan.device.vram_free_bytes, faults=fp),
                  allocator=SimPinnedAllocator(budget, None, faults=fp), kernels=ReferenceKernels(), budget=budget,
                  weights=None if accounting else weights, log=RunLog(), accounting_only=accounting,
                  strict_memory=True)


def test_warm_up_caches_the_experts_a_skewed_router_prefers():
    spec = tiny_model_spec()
    w = generate_weights(spec, seed=0, popularity_skew=4.0)
    slots = tiny_cache_slots(spec) // 4
    eng = _engine(w, slots)
    try:
        pop = eng.expert_popularity()
        assert pop.shape == (spec.moe_layers, spec.experts_per_layer) and np.allclose(pop.sum(axis=1), 1.0)
        held = set(eng.cache.expert_in[eng.cache.expert_in >= 0].tolist())
        assert held == set(warm_order(pop)[:slots].tolist())
        # what the cache holds takes far more than its share of the routing the sampled tokens make
        rows = np.array(sorted(held))
        assert pop.reshape(-1)[rows].sum() / spec.moe_layers > 3 * slots / (spec.moe_layers * spec.experts_per_layer)
        # and the experts by id (the old warm-up) would not
        by_id = warm_order(np.ones_like(pop))[:slots]
        assert pop.reshape(-1)[rows].sum() > 2 * pop.reshape(-1)[by_id].sum()
    finally:
        eng.close()


def test_accounting_warm_up_follows_the_synthetic_routing_law():
    spec = tiny_model_spec()
    w = generate_weights(spec, seed=0)
    slots = tiny_cache_slots(spec) // 4
    eng = _engine(w, slots, accounting=True)
    try:
        law = np.stack(eng.executor.ops._popularity)
        held = set(eng.cache.expert_in[eng.cache.expert_in >= 0].tolist())
        assert held == set(warm_order(law)[:slots].tolist())
    finally:
        eng.close()
