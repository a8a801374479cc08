"""Soak: many random requests on each scenario's machine, with no growth in tracked memory.

Two soaks, because the full prefill path in accounting mode streams every missed expert one by one in Python (about
0.1-0.3 s a request on these scenarios' 48 x 512 experts), so 10,000 requests a scenario do not fit CI's time:
- the full path (`Engine.serve`, what `strata simulate --requests N` runs) over SOAK_FULL_REQUESTS requests;
- the state that lives across requests (prompt loans, the expert cache's table and counters, the CPU share's
  buffer, the pinned budget, the sim device, the run log) over 10,000 requests, one routed layer a chunk.
Growth is measured from the allocators' own counters between a warm-up point and the end (`heap_growth`: as strict
as tracemalloc's byte count, without its cost on every allocation), and with the sim's own byte counters.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from heap_growth import HeapGrowth
from rel_helpers import scenario_params

from strata_core.api.backend import PinnedBudget
from strata_core.commands.plan import merge_scenario_settings
from strata_core.commands.simulate import random_requests
from strata_core.planner import plan_for_machine
from strata_core.registry import load_from_settings
from strata_core.runtime.cache import EMPTY
from strata_core.runtime.engine import Engine
from strata_core.runtime.loan import Loan
from strata_core.runtime.runlog import RunLog
from strata_core.scenario import load_scenario
from strata_core.config.settings import load_settings
from strata_core.builtin.sim import FaultPlan, SimDeviceMemory, SimPinnedAllocator

SOAK_REQUESTS = 10_000
SOAK_FULL_REQUESTS = 20
#: Bytes the heap may grow between warm-up and the end (interpreter caches, numpy's small pools).
GROWTH_BOUND_BYTES = 256 * 1024


def _engine(scenario_path: Path, tmp_path: Path, inject: tuple[str, ...] = ()):
    """The objects `strata simulate` builds for a scenario: plan, sim memory in accounting mode, the engine."""
    scenario = load_scenario(scenario_path)
    settings = merge_scenario_settings(load_settings(env={}, cwd=tmp_path), scenario).settings
    plugins = load_from_settings(settings)
    device, host = scenario.profile.device, scenario.profile.host
    plan = plan_for_machine(plugins, plugins.resolve_target(settings, profile=scenario.profile), scenario.model, settings)
    faults = FaultPlan.parse(list(inject))
    budget = PinnedBudget(plan.pinned.limit_bytes, plan.pinned.floor_bytes)
    dm = SimDeviceMemory(device.vram_free_bytes, faults=faults, accounting_only=True)
    alloc = SimPinnedAllocator(budget, host.pinnable_bytes, faults=faults, accounting_only=True)
    log = RunLog()
    engine = Engine(plan, dm=dm, allocator=alloc, kernels=None, budget=budget, weights=None, log=log,
                    accounting_only=True, seed=0)
    return scenario, settings, plan, engine, dm, alloc, budget, log


def _state(engine, dm, alloc, budget, log) -> dict:
    """Every figure that must come back to where it was between requests."""
    return {"device_used": dm.used_bytes, "device_live": dm.live_allocations, "budget_used": budget.used_bytes,
            "locked": alloc.locked_bytes, "on_loan": engine.cache.slots_on_loan, "outstanding": engine.loans.outstanding,
            "fallbacks": len(log.fallbacks)}


def _bookkeeping_request(engine, rng: np.random.Generator, n: int) -> bool:
    """One request through the state that outlives it: lend, route and admit one layer a chunk, the share, return."""
    if engine.refuse_reason(n):
        return False
    loan = engine.loans.lend(n)
    engine.cache.untrim()
    try:
        chunk = max(1, loan.chunk_tokens)
        for start in range(0, n, chunk):
            tokens = min(chunk, n - start)
            engine.cache.tick()
            layer = int(rng.integers(engine.cache.layers))
            E, k = engine.cache.experts_per_layer, engine.plan.model.top_k
            # np.unique's values (sorted, distinct) from a count per expert: the same array, without a sort a chunk
            experts = np.flatnonzero(np.bincount(rng.integers(0, E, min(E, tokens * k)), minlength=E))
            slots = engine.cache.lookup(layer, experts)
            miss = experts[slots == EMPTY]
            # with a loan, misses stream through the lent ring and are not admitted; without, they are
            if not isinstance(loan, Loan) and len(miss):
                engine.cache.admit(layer, miss, keep=slots[slots != EMPTY])
            if engine.share.armed_for(tokens):
                assert engine.share.output(tokens) is not None or not engine.share.enabled
    finally:
        engine.loans.give_back(loan)
    engine._trim_when_quiet()
    return True


def _soak_bookkeeping(scenario_path: Path, tmp_path: Path, inject: tuple[str, ...] = ()) -> None:
    """SOAK_REQUESTS random requests (after the scenario's own) through the state that outlives a request."""
    scenario, settings, plan, engine, dm, alloc, budget, log = _engine(scenario_path, tmp_path, inject)
    requests = list(scenario.requests) + random_requests(SOAK_REQUESTS, 7, settings.kv.max_context)
    rng = np.random.default_rng(7)
    warm = len(requests) // 10
    start_state = _state(engine, dm, alloc, budget, log)
    with HeapGrowth() as heap:
        served = 0
        for i, n in enumerate(requests):
            served += _bookkeeping_request(engine, rng, n)
            if i == warm:
                heap.mark()
                warm_lines = len(log.lines)
        grown = heap.grown_bytes()
    assert served == len(requests)
    assert _state(engine, dm, alloc, budget, log) == start_state
    assert engine.cache.hits + engine.cache.misses == engine.cache.lookups
    engine.cache.check()
    assert len(log.lines) - warm_lines <= 16, f"the run log grew by {len(log.lines) - warm_lines} lines"
    assert grown <= GROWTH_BOUND_BYTES, f"{grown} bytes grew after warm-up ({heap.how})"
    engine.close()
    assert dm.used_bytes == 0 and budget.used_bytes == 0 and alloc.locked_bytes == 0


@pytest.mark.slow
@pytest.mark.parametrize("scenario_path", scenario_params())
def test_ten_thousand_requests_leave_no_growth(scenario_path, tmp_path):
    _soak_bookkeeping(scenario_path, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("scenario_path", [p for p in scenario_params() if p.id == "seed2090-rtx4070ti-reserve700"]
                         or scenario_params())
def test_ten_thousand_requests_on_a_cache_shrunk_at_start_leave_no_growth(scenario_path, tmp_path):
    """Another process took VRAM before start and the pool shrank below the plan's slots: long requests halve their
    chunk, and the run log must not grow a line a request for it (it once did, for ever)."""
    free = load_scenario(scenario_path).profile.device.vram_free_bytes
    _soak_bookkeeping(scenario_path, tmp_path, (f"vram-drop:bytes={free * 6 // 10}",))


@pytest.mark.slow
@pytest.mark.parametrize("scenario_path", scenario_params())
def test_the_full_request_path_leaves_no_growth(scenario_path, tmp_path):
    scenario, settings, plan, engine, dm, alloc, budget, log = _engine(scenario_path, tmp_path)
    requests = random_requests(SOAK_FULL_REQUESTS, 11, settings.kv.max_context)
    warm = SOAK_FULL_REQUESTS // 4
    start_state = _state(engine, dm, alloc, budget, log)
    with HeapGrowth() as heap:
        for i, n in enumerate(requests):
            res = engine.serve(n, 1)
            assert res.completed or res.refused_reason
            if i == warm:
                heap.mark()
        grown = heap.grown_bytes()
    assert _state(engine, dm, alloc, budget, log) == start_state
    assert grown <= GROWTH_BOUND_BYTES, f"{grown} bytes grew after warm-up ({heap.how})"
    engine.close()
    assert dm.used_bytes == 0 and budget.used_bytes == 0 and alloc.locked_bytes == 0
